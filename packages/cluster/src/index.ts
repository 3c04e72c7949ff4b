/**
 * @dsec/cluster — assembles DSec clusters: a whole single node in one process
 * (`startSingleNode`, single-node.ts: what `dsec up` runs, and the in-process
 * test cluster SDK and CLI tests use), the roles of a multi-node cluster
 * (roles.ts), a local cluster of edge processes (local-cluster.ts), and the
 * cluster config file (config.ts).
 */
export { startSingleNode, type SingleNode, type SingleNodeOptions } from './single-node.js';
export {
  nodeBuildNetwork,
  nodeImageBuilder,
  type NodeImageBuilderOptions,
} from './image-builder.js';
export {
  apiBoundsOptions,
  ClusterConfigSchema,
  fncallOptions,
  loadClusterConfig,
  nodeRegistrySettings,
  parseClusterConfig,
  type ApiBoundsConfig,
  type ApiLimitsConfig,
  type ApiserverConfig,
  type ClusterConfig,
  type EdgeConfig,
  type FnCallConfig,
  type RegistriesConfig,
  type UpConfig,
  type WatcherConfig,
} from './config.js';
export { RegistryFleet, type RegistryFleetOptions } from './fleet.js';
export {
  cordonEdge,
  drainEdge,
  leaveEdge,
  listEdges,
  type DrainOptions,
  type EdgeSummary,
} from './edge-ops.js';
export {
  joinEdge,
  startApiserver,
  startEdgeServer,
  startWatcher,
  type ApiserverHandle,
  type EdgeServerHandle,
} from './roles.js';
export {
  PROCESSES_FILE,
  startLocalCluster,
  type LocalCluster,
  type LocalClusterOptions,
  type LocalEdgeProcess,
} from './local-cluster.js';
export {
  DEFAULT_E2B_TEMPLATES,
  e2bExtension,
  type E2bOptions,
  type LifecycleOptions,
} from './extensions.js';
/** E2B's spelling of a DSec API key (`dsec key create --e2b`). */
export { e2bKeyForm } from '@dsec/iam';

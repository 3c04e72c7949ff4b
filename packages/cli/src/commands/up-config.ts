import type { Command } from 'commander';
import { DsecError } from '@dsec/core';
import {
  loadClusterConfig,
  nodeRegistrySettings,
  type ApiBoundsConfig,
  type ClusterConfig,
  type FnCallConfig,
} from '@dsec/cluster';
import {
  parseListenAddress,
  type AdmissionConfig,
  type EdgeNetworkOptions,
  type ErofsMountSetting,
} from '@dsec/edge';
import type { RegistrySettings } from '@dsec/images';
import type { CliContext } from '../context.js';
import { admissionConfig, type AdmissionFlags } from './up-admission.js';

/** `dsec up`'s own flags (besides the admission ones). */
export interface UpFlags extends AdmissionFlags {
  config?: string;
  port: string;
  host: string;
  edges?: number;
  pausedTtlSeconds?: number;
  idlePauseSeconds?: number;
  pauseSwapMaxMb?: number;
  e2bDomain?: string;
  logRequests?: boolean;
  stopSandboxes?: boolean;
  runtime?: string;
  erofsMount?: ErofsMountSetting;
  gpus?: 'auto' | 'off';
  /** Parsed by the option itself. */
  metricsListen?: { host: string; port: number };
  /** Parsed by the option itself. */
  sandboxfusionListen?: { host: string; port: number };
  sandboxfusionProject?: string;
  cgroupFavordynmods: boolean;
}

/** What `dsec up` runs with: flags over the config file (`--config`) over defaults. */
export interface UpSettings {
  stateDir: string;
  imageStore: string | undefined;
  host: string;
  port: number;
  edges: number | undefined;
  logRequests: boolean;
  /** The admin listener for `/metrics` (with `edges`, the apiserver's; edge i serves on port + i). */
  metricsListen: { host: string; port: number } | undefined;
  /** The keyless SandboxFusion listener and the project its calls run in (both or neither). */
  sandboxFusion: { host: string; port: number; projectId: string } | undefined;
  stopSandboxes: boolean;
  admission: AdmissionConfig;
  runtime: string | undefined;
  cgroupFavorDynmods: boolean;
  erofsMount: ErofsMountSetting | undefined;
  gpus: NonNullable<ClusterConfig['up']>['gpus'];
  fncall: FnCallConfig | undefined;
  network: EdgeNetworkOptions | undefined;
  blobCacheBytes: number | undefined;
  pausedTtlSeconds: number | undefined;
  idlePauseSeconds: number | undefined;
  pauseSwapMaxMb: number | undefined;
  e2b: NonNullable<ClusterConfig['e2b']>;
  /** The `apiserver` section's Host allow-list, limits and audit retention. */
  apiBounds: ApiBoundsConfig;
  /** The `registries` section plus the environment (DSEC_INSECURE_REGISTRIES, …). */
  registries: RegistrySettings;
}

/** Drops keys whose value is undefined, so they do not hide the config file's. */
function defined<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}

/**
 * Merges `dsec up`'s flags with the config file: the file's `up` section
 * (edge knobs, stateDir, edges, stopSandboxes), `apiserver` (host, port,
 * logRequests, metricsListen, allowedHosts, limits, auditRetentionDays), `imageStore` and `e2b`. A flag given on the command line wins;
 * `--state-dir` and `--image-store` too, but their environment variables
 * (DSEC_STATE_DIR, DSEC_IMAGE_STORE) only apply where the file is silent.
 */
export async function upSettings(
  flags: UpFlags,
  command: Command,
  ctx: CliContext,
): Promise<UpSettings> {
  const file: ClusterConfig = flags.config ? await loadClusterConfig(flags.config) : {};
  const up = file.up;
  const fromCli = (name: string) => command.getOptionValueSource(name) === 'cli';
  const globalFromCli = (name: string) => ctx.program.getOptionValueSource(name) === 'cli';
  const { stateDir, imageStore } = ctx.options;
  return {
    stateDir: globalFromCli('stateDir') ? stateDir : (up?.stateDir ?? stateDir),
    imageStore: globalFromCli('imageStore') ? imageStore : (file.imageStore ?? imageStore),
    host: fromCli('host') ? flags.host : (file.apiserver?.host ?? flags.host),
    port: fromCli('port') ? Number(flags.port) : (file.apiserver?.port ?? Number(flags.port)),
    edges: flags.edges ?? up?.edges,
    logRequests: flags.logRequests === true || file.apiserver?.logRequests === true,
    metricsListen:
      flags.metricsListen ??
      (file.apiserver?.metricsListen !== undefined
        ? parseListenAddress(file.apiserver.metricsListen, 'apiserver.metricsListen')
        : undefined),
    sandboxFusion: sandboxFusionListener(flags, flags.edges ?? up?.edges),
    stopSandboxes: flags.stopSandboxes === true || up?.stopSandboxes === true,
    admission: { ...up?.admission, ...defined(admissionConfig(flags)) },
    runtime: flags.runtime ?? up?.runtime,
    cgroupFavorDynmods: fromCli('cgroupFavordynmods')
      ? flags.cgroupFavordynmods
      : (up?.cgroupFavorDynmods ?? flags.cgroupFavordynmods),
    erofsMount: flags.erofsMount ?? up?.erofsMount,
    gpus: flags.gpus ?? up?.gpus,
    fncall: up?.fncall,
    network: up?.network,
    blobCacheBytes: up?.blobCacheBytes,
    pausedTtlSeconds: flags.pausedTtlSeconds ?? up?.pausedTtlSeconds,
    idlePauseSeconds: flags.idlePauseSeconds ?? up?.idlePauseSeconds,
    pauseSwapMaxMb: flags.pauseSwapMaxMb ?? up?.pauseSwapMaxMb,
    e2b: { ...file.e2b, ...defined({ sandboxDomain: flags.e2bDomain }) },
    apiBounds: defined({
      allowedHosts: file.apiserver?.allowedHosts,
      limits: file.apiserver?.limits,
      auditRetentionDays: file.apiserver?.auditRetentionDays,
    }),
    registries: nodeRegistrySettings(file, ctx.io.env),
  };
}

/** `--sandboxfusion-listen` and `--sandboxfusion-project` go together. */
function sandboxFusionListener(
  flags: UpFlags,
  edges: number | undefined,
): UpSettings['sandboxFusion'] {
  const listen = flags.sandboxfusionListen;
  const project = flags.sandboxfusionProject;
  if (listen === undefined && project === undefined) return undefined;
  if (edges !== undefined)
    throw new DsecError(
      'invalid_argument',
      '--sandboxfusion-listen is served by a single-node `dsec up` (without --edges)',
      { field: 'sandboxfusion-listen' },
    );
  if (listen === undefined || project === undefined)
    throw new DsecError(
      'invalid_argument',
      '--sandboxfusion-listen and --sandboxfusion-project go together: the keyless listener runs every call in that one project',
      { field: listen === undefined ? 'sandboxfusion-listen' : 'sandboxfusion-project' },
    );
  return { ...listen, projectId: project };
}

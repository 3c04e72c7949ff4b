import { isDsecError, toDsecError } from '@dsec/core';
import type { DsecError } from '@dsec/core';
import type { CliContext } from './context.js';

/** API body fields → the CLI flag that sets them, so a 400 can name the flag to fix. */
const FIELD_FLAGS: Record<string, string> = {
  image: '--image',
  workspace: '--workspace',
  toolkits: '--toolkit',
  memoryLimitMb: '--memory-mb',
  cpuCoresLimit: '--cpus',
  pidsLimit: '--pids',
  diskLimitMb: '--disk-mb',
  qosClass: '--qos',
  ttlSeconds: '--ttl-seconds',
  env: '--env',
  labels: '--label',
  requestId: '--request-id',
  initUser: '--init-user',
  projectId: '--project',
  timeoutMs: '--timeout-ms',
  cwd: '--cwd',
  user: '--user',
  parentId: '--parent',
  'quota.sandboxes': '--max-sandboxes',
  'quota.memoryMb': '--max-memory-mb',
  'quota.cpuCores': '--max-cpus',
  'quota.fncallsPerSecond': '--max-fncalls-per-second',
  role: '--role',
  name: '--name',
  scrub: '--scrub',
  count: '--count',
  seconds: '--seconds',
};

/** `dsec image import --from-registry` failures, by `details.reason` (the code alone would point at the cluster). */
const REGISTRY_HINTS: Record<string, string> = {
  registry_unreachable:
    "check the registry host and port; a registry without TLS needs --insecure, or its host:port in DSEC_INSECURE_REGISTRIES or the config file's registries.insecure",
  too_many_layers:
    'the image is deeper than an import takes; flatten it (or raise maxLayers in code)',
  image_too_large: 'the image is larger than an import takes (64 GiB by default)',
  image_unpacks_too_large:
    'the image unpacks to more than an import takes (64 GiB by default): a decompression bomb, or an image to slim down',
  registry_timeout:
    'the registry is too slow or stalled; check it, or use a mirror (registries.mirrors)',
  registry_auth:
    'pass --authfile, or set DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD (or REGISTRY_AUTH_FILE)',
  unknown_tag: 'check the repository and tag (`skopeo list-tags docker://HOST/REPO`)',
  unsupported_media_type:
    'only container images (OCI or Docker v2 layers: tar, tar+gzip, tar+zstd) can be imported',
};

/** One line on what to do next, by code; undefined when there is nothing useful to say. */
export function hintFor(error: DsecError, ctx: CliContext): string | undefined {
  const { url, stateDir } = ctx.options;
  const registryHint = REGISTRY_HINTS[String(error.details?.reason)];
  if (registryHint) return registryHint;
  switch (error.code) {
    case 'unavailable':
      return `start a cluster with \`dsec up\`, or point --url / DSEC_URL (now ${url}) at a running one`;
    case 'unauthenticated':
      return `pass --api-key or set DSEC_API_KEY (the admin key is in ${stateDir}/admin.key; set --state-dir or DSEC_STATE_DIR if it lives elsewhere)`;
    case 'permission_denied':
      return 'use a key of the owning project, or an admin key (`dsec key create --role admin`)';
    case 'sandbox_not_found':
      return 'list your sandboxes with `dsec sandbox ls`';
    case 'image_not_found':
      return 'list the images with `dsec image ls`, or build one with `dsec image build`';
    case 'sandbox_not_running':
      return 'check its state with `dsec sandbox get ID`; a stopped sandbox cannot be restarted, create a new one';
    case 'invalid_argument': {
      if (!error.field) return 'see `dsec <command> --help` for the accepted values';
      const root = error.field.replace(/\.\d+$/, '');
      const flag = FIELD_FLAGS[error.field] ?? FIELD_FLAGS[root];
      return flag ? `fix ${flag} (field ${error.field})` : `fix the field ${error.field}`;
    }
    case 'quota_exceeded':
      return 'stop sandboxes you no longer need (`dsec sandbox rm`), or raise the project quota';
    case 'capacity_exhausted':
      return 'the cluster is full right now; retry shortly or stop idle sandboxes';
    case 'rate_limited':
      return 'too many failed authentications from this address, or too many streams open with this key; wait and retry';
    case 'resource_exhausted':
      // The sandbox's own limit, not a flag to fix: say which and what helps.
      return error.details?.limit === 'disk'
        ? 'the sandbox’s disk is full; remove files in it, or create a sandbox with a larger --disk-mb'
        : error.details?.limit === 'pids'
          ? 'the sandbox’s processes fill its --pids limit; end some (`dsec sandbox exec ID -- kill …`) or create a sandbox with a larger --pids'
          : 'the sandbox hit one of its own limits; see the message';
    case 'deadline_exceeded':
      return 'the server is slow or the command ran long; retry, or raise --timeout-ms';
    case 'payload_too_large':
      return 'requests are limited to 1 MiB; send less stdin or fewer env entries';
    case 'conflict':
      return 'it exists already or changed meanwhile; re-read it and retry';
    case 'internal':
      return 'this is a bug or a host fault; the apiserver log has the details';
    default:
      return undefined;
  }
}

/** Prints `error: <message> [<code>]` and a hint line; returns the exit code to use. */
export function reportError(err: unknown, ctx: CliContext): number {
  const error = isDsecError(err) ? err : toDsecError(err);
  ctx.err(`error: ${error.message} [${error.code}]`);
  const hint = hintFor(error, ctx);
  if (hint) ctx.err(`hint: ${hint}`);
  return error.code === 'aborted' ? 130 : 1;
}

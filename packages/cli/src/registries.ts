import { loadClusterConfig, nodeRegistrySettings } from '@dsec/cluster';
import type { RegistrySettings } from '@dsec/images';
import type { CliContext } from './context.js';

/**
 * The registry settings a CLI command uses (imports, builds, evaluations):
 * the `registries` section of the cluster config file named by `configFile`
 * (a command's `--config`), else by `DSEC_CONFIG`, plus the environment
 * (`DSEC_INSECURE_REGISTRIES`, `DSEC_REGISTRY_MIRRORS`, `REGISTRY_AUTH_FILE`).
 * The same section `dsec up` and `dsec serve edge` read, so one file sets
 * them for the node and its operators alike. `invalid_argument` naming the
 * file and the entry for a malformed one.
 */
export async function cliRegistrySettings(
  ctx: CliContext,
  configFile?: string  ,
): Promise<RegistrySettings> {
  const file = configFile ?? (ctx.io.env.DSEC_CONFIG || undefined);
  const config = file !== undefined ? await loadClusterConfig(file) : undefined;
  return nodeRegistrySettings(config, ctx.io.env);
}

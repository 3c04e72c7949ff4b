/**
 * `node --conditions=dsec-source --import tsx scripts/debian-registry.ts DIR [ENV_FILE]`:
 * starts a `docker-registry` on loopback (a free port) with DIR as its
 * storage, pushes a Debian bookworm image built with DSec's images tooling
 * (`debian:bookworm`, cached under /var/cache/dsec/debian-image), writes
 * `DEBIAN_IMAGE=HOST/debian:bookworm` and `DSEC_INSECURE_REGISTRIES=…` to
 * ENV_FILE (default DIR/env) and prints `ready HOST`, then serves until
 * SIGTERM or SIGINT, when it stops the registry. The demo runs it in the
 * background beside the cluster.
 */
import { join, resolve } from 'node:path';
import { startDebianRegistry, writeEnvFile } from '../packages/eval/src/testing/debian-registry.js';

async function main(): Promise<void> {
  const [dirArg, envArg] = process.argv.slice(2);
  if (!dirArg) {
    process.stderr.write('usage: debian-registry.ts DIR [ENV_FILE]\n');
    process.exit(2);
  }
  const dir = resolve(dirArg);
  const registry = await startDebianRegistry({
    dir,
    onProgress: (line) => process.stderr.write(`debian-registry: ${line}\n`),
  });
  await writeEnvFile(resolve(envArg ?? join(dir, 'env')), {
    DEBIAN_IMAGE: registry.image,
    ...registry.env,
  });
  process.stdout.write(`ready ${registry.host}\n`);
  const stop = () => {
    void registry.close().then(() => process.exit(0));
  };
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
  // Keep the process alive until a signal arrives.
  setInterval(() => undefined, 1 << 30);
}

main().catch((err: unknown) => {
  process.stderr.write(`debian-registry: ${(err as Error).stack ?? String(err)}\n`);
  process.exit(1);
});

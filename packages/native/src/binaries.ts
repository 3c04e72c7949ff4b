import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

/**
 * Where `make` put the binaries: beside this module's source (`../build`), or,
 * when this module is bundled into the CLI (`packages/cli/dist`), in the
 * native package next door. `DSEC_NATIVE_DIR` overrides both.
 */
function builtFile(name: string): string {
  const candidates = [
    ...(process.env.DSEC_NATIVE_DIR ? [`${process.env.DSEC_NATIVE_DIR}/${name}`] : []),
    fileURLToPath(new URL(`../build/${name}`, import.meta.url)),
    fileURLToPath(new URL(`../../native/build/${name}`, import.meta.url)),
  ];
  const path = candidates.find((p) => existsSync(p));
  if (!path)
    throw new Error(
      'native helpers not built: run `npm install` (it runs `make -C packages/native`)',
    );
  return path;
}

/** Absolute path of the `dsec-helper` binary; throws if it was not built. */
export function helperPath(): string {
  return builtFile('dsec-helper');
}

/**
 * Absolute path of the static `dsec-xattr` binary (E2B file metadata, run
 * inside sandboxes); throws if it was not built.
 */
export function xattrToolPath(): string {
  return builtFile('dsec-xattr');
}

/** Absolute path of the static `dsec-init` binary (PID 1 of sandboxes); throws if it was not built. */
export function initPath(): string {
  return builtFile('dsec-init');
}

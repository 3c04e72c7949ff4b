import { statSync } from 'node:fs';
import { runConfinedOk, sandboxViewTreeCommand } from '@dsec/native';
import type { OciLinuxDevice } from './oci-fragment.js';

/**
 * Gives a started sandbox's GPU device nodes the mode its OCI config asked
 * for. A runtime that creates them with mknod (crun, in a user namespace: in
 * a tmpfs of its own, then bound in) applies its umask, so the `0666` of
 * `fileMode` becomes `0644` under the edge's usual 022, and calls (an
 * unprivileged uid) could not open `/dev/nvidia*` read-write: CUDA would
 * fail. Found by the stand-in test (test/integration/fncall-gpu.test.ts).
 * A node that is the host's own (runc binds the host node) is left alone:
 * changing it would change the host's.
 *
 * The path is the sandbox's, so it is resolved in the sandbox's own mount
 * namespace and root (`dsec-helper confine --ns`), one component at a time
 * with no symlink followed, and only a character device there is changed
 * (`fchmodat2(AT_SYMLINK_NOFOLLOW)`): a `/dev` the sandbox's image made a
 * symlink never leads the host to one of its own files (SECURITY.md A9).
 * Runs before the sandbox's first command. Returns the paths it changed.
 */
export async function applyGpuDeviceModes(
  initPid: number,
  devices: readonly OciLinuxDevice[],
): Promise<string[]> {
  const changed: string[] = [];
  for (const d of devices) {
    const host = statSync(d.path, { throwIfNoEntry: false, bigint: true });
    const skip = host ? ['--skip', `${host.dev}:${host.ino}`] : [];
    const r = await runConfinedOk(
      sandboxViewTreeCommand({ initPid }, ['chmod-node', d.path, d.fileMode.toString(8), ...skip]),
      `setting the mode of ${d.path}`,
      { timeoutMs: 10_000 },
    );
    if (r.stdout.trim() === 'changed') changed.push(d.path);
  }
  return changed;
}

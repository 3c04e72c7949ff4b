import { chmodSync, statSync } from 'node:fs';
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
 * Runs as the edge (host root), through `/proc/<init>/root`, before the
 * sandbox's first command. Returns the paths it changed.
 */
export function applyGpuDeviceModes(initPid: number, devices: readonly OciLinuxDevice[]): string[] {
  const changed: string[] = [];
  for (const d of devices) {
    const inSandbox = `/proc/${initPid}/root${d.path}`;
    const st = statSync(inSandbox);
    const host = statSync(d.path, { throwIfNoEntry: false });
    if (host && host.dev === st.dev && host.ino === st.ino) continue;
    if ((st.mode & 0o7777) === d.fileMode) continue;
    chmodSync(inSandbox, d.fileMode);
    changed.push(d.path);
  }
  return changed;
}

import { execFile } from 'node:child_process';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import { helperPath } from './binaries.js';

/** What one reclaim took back (`pids_limit` events carry it). */
export interface ReclaimedProcesses {
  processes: number;
  groups: number;
}

/**
 * Takes back the leftovers of a container sandbox's finished commands from
 * the host (`dsec-helper pids-reclaim`, src/reclaim.c): the sessions they
 * left behind, biggest first until half of the leftover processes are gone,
 * each stopped and then killed. The same first step chronus takes on a fork
 * refused at the pids limit, done outside the sandbox's CPU share, where a
 * fork bomb does not slow it down. `cgroupDir` is the sandbox's pids cgroup;
 * `initPid` and `daemonPid` are host pids of its init and its command daemon
 * (whose children are the reapers of running commands, never touched here).
 * Meanwhile nothing in the sandbox can fork (its pids.max is 0); the limit is
 * `pidsLimit` again when this resolves or rejects.
 */
export async function reclaimLeftovers(
  cgroupDir: string,
  initPid: number,
  daemonPid: number,
  pidsLimit: number,
): Promise<ReclaimedProcesses> {
  try {
    return await runReclaim(cgroupDir, initPid, daemonPid, pidsLimit);
  } finally {
    // The helper writes it back itself; this covers a helper that died first.
    await writeFile(join(cgroupDir, 'pids.max'), String(pidsLimit)).catch(() => undefined);
  }
}

function runReclaim(
  cgroupDir: string,
  initPid: number,
  daemonPid: number,
  pidsLimit: number,
): Promise<ReclaimedProcesses> {
  return new Promise((resolve, reject) => {
    execFile(
      helperPath(),
      ['pids-reclaim', cgroupDir, String(initPid), String(daemonPid), String(pidsLimit)],
      { timeout: 30_000 },
      (err, stdout, stderr) => {
        const m = /^killed (\d+) groups (\d+)$/.exec(stdout.trim());
        if (err || !m) {
          const why = stderr.trim() || (err ? err.message : `unexpected output ${stdout.trim()}`);
          reject(new DsecError('internal', `dsec-helper pids-reclaim: ${why}`, { cause: err }));
          return;
        }
        resolve({ processes: Number(m[1]), groups: Number(m[2]) });
      },
    );
  });
}

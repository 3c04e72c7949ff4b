import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Command } from 'commander';
import { PROCESSES_FILE } from '@dsec/cluster';
import { contextOf } from '../context.js';
import { formatTable } from '../format.js';

/** One edge as `dsec cluster status` shows it. */
export interface EdgeRow {
  id: string;
  url: string;
  healthy: boolean;
  sandboxes: number;
  /** The edge process's pid when it runs on this machine under `dsec up --edges`. */
  pid?: number | undefined;
  labels: Record<string, string>;
  backends: string[];
}

/** `dsec cluster status`: the edges the apiserver places on (needs an admin key of the root project). */
export function register(program: Command): void {
  const cluster = program.command('cluster').description('the cluster behind the apiserver');
  cluster
    .command('status')
    .description('list the edges with their health, load and (when local) process IDs')
    .action(async (_opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      const edges = await ctx.client().listEdges({ signal: ctx.signal });
      const local = await localPids(ctx.options.stateDir);
      const rows: EdgeRow[] = edges
        .map((e) => ({
          id: e.edgeId,
          url: e.url,
          healthy: e.healthy,
          sandboxes: e.used.sandboxes,
          ...(local.has(e.edgeId) ? { pid: local.get(e.edgeId) } : {}),
          labels: e.labels,
          backends: e.backends,
        }))
        .sort((a, b) => a.id.localeCompare(b.id));
      if (ctx.json) {
        ctx.printJson({ url: ctx.options.url, edges: rows });
        return;
      }
      ctx.out(
        formatTable(
          ['EDGE', 'HEALTHY', 'SANDBOXES', 'PID', 'URL', 'LABELS'],
          rows.map((r) => [
            r.id,
            r.healthy ? 'yes' : 'NO',
            String(r.sandboxes),
            r.pid === undefined ? '-' : String(r.pid),
            r.url,
            Object.entries(r.labels)
              .map(([k, v]) => `${k}=${v}`)
              .join(',') || '-',
          ]),
        ),
      );
    });
}

/** Edge pids from a local `dsec up --edges` under this state dir, if one runs. */
async function localPids(stateDir: string): Promise<Map<string, number>> {
  const text = await readFile(join(stateDir, PROCESSES_FILE), 'utf8').catch(() => '');
  if (!text) return new Map();
  try {
    const parsed = JSON.parse(text) as { edges?: { id: string; pid?: number }[] };
    const out = new Map<string, number>();
    for (const e of parsed.edges ?? []) {
      // A pid is shown only while that process lives.
      if (typeof e.pid === 'number' && isAlive(e.pid)) out.set(e.id, e.pid);
    }
    return out;
  } catch {
    return new Map();
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

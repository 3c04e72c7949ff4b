/**
 * What an operator does to a registered edge from the control database:
 * list, cordon, drain, leave (`dsec edge ls|cordon|uncordon|drain|leave`).
 *
 * Cordoning is the registry's: every apiserver reads it with the edge set
 * and stops placing new sandboxes and function calls there, while what
 * already runs keeps running and stays reachable. Draining is cordoning,
 * then waiting until the watcher's last probe of the edge counts no user
 * sandboxes; it stops nothing itself (sandboxes end by their TTL, or by
 * their owners). Leaving removes the edge, which makes its sandboxes
 * unreachable, so it refuses while the edge still reports some.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError } from '@dsec/core';
import type { EdgeStatus } from '@dsec/core';
import { FNCALL_PROJECT } from '@dsec/edge';
import { openControlDb, type ControlDb, type EdgeRecord } from '@dsec/iam';
import { requireSection, type ClusterConfig } from './config.js';

/** An edge as `dsec edge ls` shows it: never its secret. */
export interface EdgeSummary {
  id: string;
  url: string;
  healthy: boolean;
  cordoned: boolean;
  /** Users' sandboxes in the last recorded status (function-call workers are the edge's own). */
  sandboxes: number | undefined;
  /** When the watcher last probed it (ISO-8601); undefined before the first probe. */
  lastProbeAt: string | undefined;
  labels: Record<string, string>;
  backends: string[];
}

export async function listEdges(config: ClusterConfig): Promise<EdgeSummary[]> {
  return withDb(config, '`dsec edge ls`', async (db) => (await db.edges.list()).map(summary));
}

/** Cordons or uncordons an edge; `not_found` for an ID that is not registered. */
export async function cordonEdge(
  config: ClusterConfig,
  edgeId: string,
  cordoned: boolean,
): Promise<EdgeSummary> {
  return withDb(config, '`dsec edge cordon`', async (db) => {
    if (!(await db.edges.setCordoned(edgeId, cordoned))) throw unknownEdge(edgeId);
    return summary(await known(db, edgeId));
  });
}

export interface DrainOptions {
  /** Give up (`deadline_exceeded`, the edge stays cordoned) after this long. */
  timeoutMs: number;
  /** How often the registry is read again. Default 2000 (the watcher probes about that often). */
  pollMs?: number;
  /** Called after each read with the edge as recorded. */
  onProgress?: (edge: EdgeSummary) => void;
  signal?: AbortSignal;
}

/** Cordons the edge, then waits until its recorded status counts no users' sandboxes. */
export async function drainEdge(
  config: ClusterConfig,
  edgeId: string,
  options: DrainOptions,
): Promise<EdgeSummary> {
  return withDb(config, '`dsec edge drain`', async (db) => {
    if (!(await db.edges.setCordoned(edgeId, true))) throw unknownEdge(edgeId);
    const deadline = Date.now() + options.timeoutMs;
    for (;;) {
      const edge = summary(await known(db, edgeId));
      options.onProgress?.(edge);
      if (edge.sandboxes === 0) return edge;
      if (Date.now() >= deadline) {
        throw new DsecError(
          'deadline_exceeded',
          `edge ${edgeId} still holds ${edge.sandboxes ?? 'an unknown number of'} sandboxes after ${options.timeoutMs} ms; it stays cordoned (is a watcher running? \`dsec serve watcher\` records what edges hold)`,
          { details: { edgeId, sandboxes: edge.sandboxes } },
        );
      }
      await sleep(
        Math.min(options.pollMs ?? 2000, Math.max(0, deadline - Date.now())),
        undefined,
        options.signal ? { signal: options.signal } : undefined,
      );
    }
  });
}

/**
 * Removes an edge from the registry; returns whether it was registered.
 * Refuses (`conflict`) while its recorded status counts users' sandboxes,
 * which would become unreachable, unless `force`.
 */
export async function leaveEdge(
  config: ClusterConfig,
  edgeId: string,
  options: { force?: boolean } = {},
): Promise<boolean> {
  return withDb(config, '`dsec edge leave`', async (db) => {
    const record = await db.edges.get(edgeId);
    if (!record) return false;
    const sandboxes = summary(record).sandboxes;
    if (!options.force && sandboxes !== undefined && sandboxes > 0) {
      throw new DsecError(
        'conflict',
        `edge ${edgeId} still holds ${sandboxes} sandboxes, which would become unreachable: drain it first (\`dsec edge drain ${edgeId}\`) or pass --force`,
        { details: { edgeId, sandboxes } },
      );
    }
    await db.edges.remove(edgeId);
    return true;
  });
}

async function withDb<T>(
  config: ClusterConfig,
  role: string,
  fn: (db: ControlDb) => Promise<T>,
): Promise<T> {
  const db = await openControlDb(requireSection(config, 'database', role));
  try {
    return await fn(db);
  } finally {
    await db.close();
  }
}

async function known(db: ControlDb, edgeId: string): Promise<EdgeRecord> {
  const record = await db.edges.get(edgeId);
  if (!record) throw unknownEdge(edgeId);
  return record;
}

function unknownEdge(edgeId: string): DsecError {
  return new DsecError(
    'not_found',
    `no edge ${edgeId} is registered (\`dsec edge ls --config FILE\` lists them)`,
    { details: { edgeId } },
  );
}

function summary(r: EdgeRecord): EdgeSummary {
  const status = r.status as Partial<EdgeStatus> | undefined;
  const byProject = status?.sandboxesByProject;
  return {
    id: r.edgeId,
    url: r.url,
    healthy: r.healthy,
    cordoned: r.cordoned,
    sandboxes:
      byProject === undefined
        ? undefined
        : Object.entries(byProject)
            .filter(([project]) => project !== FNCALL_PROJECT)
            .reduce((n, [, count]) => n + count, 0),
    lastProbeAt: r.lastProbeAt === undefined ? undefined : new Date(r.lastProbeAt).toISOString(),
    labels: r.labels,
    backends: r.backends,
  };
}

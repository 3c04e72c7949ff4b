import { DsecError } from '@dsec/core';
import type { SqlDb } from './db/sql.js';

/** What `register` takes: an edge that joins (or re-joins) the cluster. */
export interface EdgeRegistration {
  /** The edge's ID, as encoded in its sandboxes' IDs: 1–64 of `[A-Za-z0-9._-]`. */
  edgeId: string;
  /** Where the edge serves its API: an `http:` or `https:` URL. */
  url: string;
  /** The per-edge credential apiservers sign their calls to this edge with. */
  secret: string;
  /** Placement labels (pool, hardware, ...). */
  labels: Record<string, string>;
  /** Backends the edge runs (`container`, ...). */
  backends: string[];
  /**
   * The SHA-256 fingerprints (`AB:CD:…`, upper case) of the TLS certificates
   * apiservers accept from this edge, whose `url` is then `https:`; absent
   * for an edge without TLS. Not secret: a pin names a public certificate.
   */
  tlsPins?: string[] | undefined;
}

/** One probe's outcome, as the watcher saw it. */
export interface EdgeProbe {
  healthy: boolean;
  /** When the probe finished, ms since the epoch. */
  at: number;
  /** The edge's `EdgeStatus`, as JSON; kept from the last probe that had one when absent. */
  status?: unknown;
  /** Why the probe failed. */
  error?: string | undefined;
}

/**
 * A registered edge and what the watcher last saw of it. Contains `secret`:
 * whatever shows records to users must leave it out.
 */
export interface EdgeRecord extends EdgeRegistration {
  /** False until a probe finds the edge healthy, and after one that does not. */
  healthy: boolean;
  /** The last recorded probe, ms since the epoch; undefined before the first. */
  lastProbeAt: number | undefined;
  /** The last probe's error; undefined after a healthy probe. */
  lastError: string | undefined;
  /** The last `EdgeStatus` a probe recorded, as JSON; undefined before the first. */
  status: unknown;
  /** When the edge first registered (ISO-8601); kept across re-registrations. */
  registeredAt: string;
  /**
   * Placement sends the edge no new sandboxes or function calls; what runs
   * there keeps running and stays reachable. Kept across re-registrations.
   */
  cordoned: boolean;
}

interface EdgeRow {
  edge_id: string;
  url: string;
  secret: string;
  labels: string;
  backends: string;
  healthy: number;
  last_probe_at: number | null;
  last_error: string | null;
  status: string | null;
  registered_at: string;
  cordoned: number;
  tls_pins: string | null;
}

/** The edge protocol refuses shorter secrets too (`@dsec/edge-http`'s `MIN_SECRET_LENGTH`). */
const MIN_EDGE_SECRET_LENGTH = 32;

export const EDGE_ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

/** A pin in the form `X509Certificate.fingerprint256` gives (`@dsec/edge-http`'s `normalizeFingerprint`). */
const TLS_PIN = /^[0-9A-F]{2}(?::[0-9A-F]{2}){31}$/;

const COLUMNS =
  'edge_id, url, secret, labels, backends, healthy, last_probe_at, last_error, status, registered_at, cordoned, tls_pins';

/**
 * The cluster's edges, in the control database beside IAM: edges join
 * (`register`) and leave (`remove`); a watcher records each probe
 * (`recordProbe`); every apiserver reads the set (`list`) to route and place.
 *
 * Semantics:
 * - `register` is an upsert by `edgeId`. A re-registration at the same URL
 *   keeps the edge's health; at a new URL the health is reset (unprobed,
 *   not healthy), so no apiserver routes to an address nobody has checked.
 * - `recordProbe` ignores a probe older than the one already recorded (two
 *   watchers, or a slow write overtaken by a newer one), and returns whether
 *   it recorded anything; an edge that left meanwhile is not re-created.
 * - `setCordoned` survives re-registration: an edge that restarts stays cordoned.
 * - Registrations, removals and cordons are audited (without the secret); probes,
 *   which come every few seconds per edge, are not.
 */
export class EdgeRegistry {
  readonly #db: SqlDb;
  readonly #now: () => number;

  /** @internal Use `openControlDb`. */
  constructor(db: SqlDb, options: { now?: () => number } = {}) {
    this.#db = db;
    this.#now = options.now ?? Date.now;
  }

  /** Adds or updates an edge; returns its record. Throws `invalid_argument` naming the field. */
  async register(input: EdgeRegistration): Promise<EdgeRecord> {
    checkRegistration(input);
    const at = new Date(this.#now()).toISOString();
    const labels = JSON.stringify(sortedObject(input.labels));
    const backends = JSON.stringify([...new Set(input.backends)].sort());
    const pins = input.tlsPins ? JSON.stringify([...new Set(input.tlsPins)].sort()) : null;
    return this.#db.transaction(async (q) => {
      await q.run(
        `INSERT INTO edges (edge_id, url, secret, labels, backends, healthy, registered_at, tls_pins)
           VALUES (?, ?, ?, ?, ?, 0, ?, ?)
         ON CONFLICT (edge_id) DO UPDATE SET
           healthy = CASE WHEN edges.url = excluded.url THEN edges.healthy ELSE 0 END,
           last_probe_at = CASE WHEN edges.url = excluded.url THEN edges.last_probe_at ELSE NULL END,
           last_error = CASE WHEN edges.url = excluded.url THEN edges.last_error ELSE NULL END,
           status = CASE WHEN edges.url = excluded.url THEN edges.status ELSE NULL END,
           url = excluded.url, secret = excluded.secret, labels = excluded.labels,
           backends = excluded.backends, tls_pins = excluded.tls_pins`,
        [input.edgeId, input.url, input.secret, labels, backends, at, pins],
      );
      await q.run(
        'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, NULL, ?, ?, ?, ?)',
        [
          at,
          'edge.register',
          input.edgeId,
          'ok',
          JSON.stringify({
            url: input.url,
            labels: input.labels,
            ...(input.tlsPins ? { tlsPins: input.tlsPins } : {}),
          }),
        ],
      );
      const row = await q.get<EdgeRow>(`SELECT ${COLUMNS} FROM edges WHERE edge_id = ?`, [
        input.edgeId,
      ]);
      if (!row) throw new DsecError('internal', `edge ${input.edgeId} vanished while registering`);
      return toRecord(row);
    });
  }

  /** Removes an edge; returns whether it was registered. */
  async remove(edgeId: string): Promise<boolean> {
    return this.#db.transaction(async (q) => {
      const r = await q.run('DELETE FROM edges WHERE edge_id = ?', [edgeId]);
      if (r.changes > 0) {
        await q.run(
          'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, NULL, ?, ?, ?, NULL)',
          [new Date(this.#now()).toISOString(), 'edge.remove', edgeId.slice(0, 200), 'ok'],
        );
      }
      return r.changes > 0;
    });
  }

  /**
   * Cordons (`true`) or uncordons an edge; returns false for an unknown edge.
   * Audited like registrations, with the new state in the details.
   */
  async setCordoned(edgeId: string, cordoned: boolean): Promise<boolean> {
    return this.#db.transaction(async (q) => {
      const r = await q.run('UPDATE edges SET cordoned = ? WHERE edge_id = ?', [
        cordoned ? 1 : 0,
        edgeId,
      ]);
      if (r.changes > 0) {
        await q.run(
          'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, NULL, ?, ?, ?, NULL)',
          [
            new Date(this.#now()).toISOString(),
            cordoned ? 'edge.cordon' : 'edge.uncordon',
            edgeId.slice(0, 200),
            'ok',
          ],
        );
      }
      return r.changes > 0;
    });
  }

  async get(edgeId: string): Promise<EdgeRecord | undefined> {
    const row = await this.#db.get<EdgeRow>(`SELECT ${COLUMNS} FROM edges WHERE edge_id = ?`, [
      edgeId,
    ]);
    return row && toRecord(row);
  }

  /** Every registered edge, by `edgeId`. */
  async list(): Promise<EdgeRecord[]> {
    const rows = await this.#db.all<EdgeRow>(`SELECT ${COLUMNS} FROM edges ORDER BY edge_id`);
    return rows.map(toRecord);
  }

  /**
   * Records a probe of a registered edge. Returns false (recording nothing)
   * for an unknown edge or a probe older than the last one recorded.
   */
  async recordProbe(edgeId: string, probe: EdgeProbe): Promise<boolean> {
    if (!Number.isFinite(probe.at))
      throw new DsecError('invalid_argument', 'probe.at must be a time in ms', { field: 'at' });
    const status = probe.status === undefined ? null : JSON.stringify(probe.status);
    const r = await this.#db.run(
      `UPDATE edges SET healthy = ?, last_probe_at = ?, last_error = ?, status = COALESCE(?, status)
         WHERE edge_id = ? AND (last_probe_at IS NULL OR last_probe_at <= ?)`,
      [
        probe.healthy ? 1 : 0,
        probe.at,
        probe.healthy ? null : (probe.error ?? null),
        status,
        edgeId,
        probe.at,
      ],
    );
    return r.changes > 0;
  }
}

function checkRegistration(input: EdgeRegistration): void {
  const bad = (field: string, message: string) =>
    new DsecError('invalid_argument', message, { field });
  if (typeof input.edgeId !== 'string' || !EDGE_ID_PATTERN.test(input.edgeId))
    throw bad('edgeId', 'edgeId must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}');
  let url: URL | undefined;
  try {
    url = new URL(input.url);
  } catch {
    url = undefined;
  }
  if (!url || (url.protocol !== 'http:' && url.protocol !== 'https:'))
    throw bad('url', 'url must be an http: or https: URL');
  if (typeof input.secret !== 'string' || input.secret.length < MIN_EDGE_SECRET_LENGTH)
    throw bad('secret', `secret must be at least ${MIN_EDGE_SECRET_LENGTH} characters`);
  const labels: unknown = input.labels;
  if (typeof labels !== 'object' || labels === null || Array.isArray(labels))
    throw bad('labels', 'labels must be an object of strings');
  for (const [k, v] of Object.entries(labels)) {
    if (typeof v !== 'string') throw bad(`labels.${k}`, 'label values must be strings');
  }
  if (!Array.isArray(input.backends) || input.backends.some((b) => typeof b !== 'string' || !b))
    throw bad('backends', 'backends must be a list of backend names');
  const pins: unknown = input.tlsPins;
  if (pins !== undefined) {
    if (
      !Array.isArray(pins) ||
      pins.length === 0 ||
      pins.some((p) => typeof p !== 'string' || !TLS_PIN.test(p))
    )
      throw bad('tlsPins', 'tlsPins must list SHA-256 fingerprints in the form AB:CD:…');
    if (url.protocol !== 'https:') throw bad('url', 'an edge with TLS pins needs an https: url');
  }
}

function sortedObject(o: Record<string, string>): Record<string, string> {
  return Object.fromEntries(Object.entries(o).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
}

function toRecord(r: EdgeRow): EdgeRecord {
  return {
    edgeId: r.edge_id,
    url: r.url,
    secret: r.secret,
    labels: JSON.parse(r.labels) as Record<string, string>,
    backends: JSON.parse(r.backends) as string[],
    healthy: r.healthy === 1,
    lastProbeAt: r.last_probe_at ?? undefined,
    lastError: r.last_error ?? undefined,
    status: r.status === null ? undefined : (JSON.parse(r.status) as unknown),
    registeredAt: r.registered_at,
    cordoned: r.cordoned === 1,
    tlsPins: r.tls_pins === null ? undefined : (JSON.parse(r.tls_pins) as string[]),
  };
}

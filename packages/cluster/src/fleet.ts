import type { EdgeApi, EdgeStatus } from '@dsec/core';
import { RemoteEdge } from '@dsec/edge-http';
import type { EdgeRecord, EdgeRegistry } from '@dsec/iam';
import { viewFromRecords, Watcher, type FleetView } from '@dsec/watcher';
import type { WatcherConfig } from './config.js';

export interface RegistryFleetOptions {
  registry: EdgeRegistry;
  /** How often the registry is read. */
  refreshMs: number;
  /** Take the watcher role: probe every edge and record the results in the registry. */
  watch?: WatcherConfig | undefined;
  /** Warnings, and edges going down or up (the level is the third argument). */
  onWarning?: (
    message: string,
    context: Record<string, unknown>,
    level?: 'info' | 'warn' | 'error',
  ) => void;
}

/**
 * The edges of a cluster as one apiserver or watcher process sees them: the
 * registry (edges join and leave there) turned into authenticated
 * `RemoteEdge` clients, and a fleet view for placement.
 *
 * Without `watch`, the view is built from the health and status a watcher
 * recorded in the registry, so any number of stateless apiservers place from
 * the same facts. With `watch`, this process probes the edges itself, records
 * each result, and places from its own fresher view.
 */
export class RegistryFleet {
  readonly #options: RegistryFleetOptions;
  /** Each edge's client, and what it was made from (`pins` joined), to see a change. */
  readonly #clients = new Map<
    string,
    { client: RemoteEdge; url: string; secret: string; pins: string }
  >();
  readonly #watcher: Watcher | undefined;
  #records: EdgeRecord[] = [];
  #view: FleetView = viewFromRecords([]);
  /** Cordoned edge IDs as last read; a new set whenever it changes. */
  #cordoned: ReadonlySet<string> = new Set();
  #cordonedView: { from: FleetView; set: ReadonlySet<string>; view: FleetView } | undefined;
  #timer: NodeJS.Timeout | undefined;
  #refreshing: Promise<void> | undefined;
  #closed = false;

  constructor(options: RegistryFleetOptions) {
    this.#options = options;
    const { watch, registry } = options;
    if (watch) {
      this.#watcher = new Watcher({
        edges: () => [...this.#clients.values()].map((c) => c.client),
        intervalMs: watch.intervalMs,
        probeTimeoutMs: watch.probeTimeoutMs,
        failuresBeforeDown: watch.failuresBeforeDown,
        log: options.onWarning,
        onProbe: (edgeId, result) => {
          registry
            .recordProbe(edgeId, result)
            .catch((err: unknown) =>
              this.#options.onWarning?.('recording a probe failed', { edgeId, err: String(err) }),
            );
        },
      });
    }
  }

  /** Reads the registry once (and probes once when watching), then keeps both fresh. */
  async start(): Promise<void> {
    await this.refresh();
    if (this.#watcher) {
      await this.#watcher.refresh();
      this.#watcher.start();
    }
    const tick = () => {
      this.refresh()
        .catch((err: unknown) =>
          this.#options.onWarning?.('reading the edge registry failed', { err: String(err) }),
        )
        .finally(() => {
          if (!this.#closed) this.#timer = setTimeout(tick, this.#options.refreshMs);
        });
    };
    this.#timer = setTimeout(tick, this.#options.refreshMs);
  }

  /** Reads the registry now: new edges get a client, removed ones lose theirs. */
  refresh(): Promise<void> {
    this.#refreshing ??= this.#readRegistry().finally(() => {
      this.#refreshing = undefined;
    });
    return this.#refreshing;
  }

  async #readRegistry(): Promise<void> {
    const records = await this.#options.registry.list();
    const seen = new Set<string>();
    for (const r of records) {
      seen.add(r.edgeId);
      const known = this.#clients.get(r.edgeId);
      const pins = r.tlsPins?.join(',') ?? '';
      if (known && known.url === r.url && known.secret === r.secret && known.pins === pins)
        continue;
      let client: RemoteEdge;
      try {
        client = new RemoteEdge({
          edgeId: r.edgeId,
          url: r.url,
          secret: r.secret,
          ...(r.tlsPins ? { tls: { pinSha256: r.tlsPins } } : {}),
        });
      } catch (err) {
        // A record this release cannot dial (the registry checks what it stores, so only
        // a hand-edited row): no client, so calls answer as for an unknown edge.
        this.#options.onWarning?.('an edge registration cannot be used', {
          edgeId: r.edgeId,
          err: String(err),
        });
        known?.client.close();
        this.#clients.delete(r.edgeId);
        continue;
      }
      // Only the pins changed (a certificate rotation): calls in flight on a certificate
      // still pinned finish (closing would cut them, killing their commands).
      if (known && r.tlsPins && known.pins && known.url === r.url && known.secret === r.secret)
        known.client.retire(r.tlsPins);
      else known?.client.close();
      this.#clients.set(r.edgeId, { client, url: r.url, secret: r.secret, pins });
    }
    for (const [id, known] of this.#clients) {
      if (seen.has(id)) continue;
      known.client.close();
      this.#clients.delete(id);
    }
    this.#records = records;
    const cordoned = records.filter((r) => r.cordoned).map((r) => r.edgeId);
    if (cordoned.length !== this.#cordoned.size || cordoned.some((id) => !this.#cordoned.has(id)))
      this.#cordoned = new Set(cordoned);
    this.#view = viewFromRecords(
      records.map((r) => ({
        edgeId: r.edgeId,
        healthy: r.healthy,
        lastProbeAt: r.lastProbeAt ?? 0,
        status: r.status as EdgeStatus | undefined,
        ...(r.lastError ? { lastError: r.lastError } : {}),
      })),
    );
  }

  /** The client of an edge in the registry. */
  edge(edgeId: string): EdgeApi | undefined {
    return this.#clients.get(edgeId)?.client;
  }

  /** Registered edges as last read. */
  records(): readonly EdgeRecord[] {
    return this.#records;
  }

  view(): FleetView {
    const view = this.#watcher ? this.#watcher.view() : this.#view;
    const cordoned = this.#cordoned;
    if (cordoned.size === 0) return view;
    // A new view object only when the set or the underlying view changed:
    // placers index a view once per `edges` array.
    if (this.#cordonedView?.from !== view || this.#cordonedView.set !== cordoned) {
      const edges = view.edges.map((e) => (cordoned.has(e.edgeId) ? { ...e, cordoned: true } : e));
      this.#cordonedView = { from: view, set: cordoned, view: { ...view, edges } };
    }
    return this.#cordonedView.view;
  }

  close(): void {
    this.#closed = true;
    if (this.#timer) clearTimeout(this.#timer);
    this.#watcher?.stop();
    for (const { client } of this.#clients.values()) client.close();
    this.#clients.clear();
  }
}

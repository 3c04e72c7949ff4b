import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import { isIPv4, isIPv6 } from 'node:net';
import type { Socket } from 'node:net';
import type { Duplex } from 'node:stream';

/**
 * Connection caps for an HTTP server (SECURITY J38: idle connections must not
 * lock other callers out). Shared by every DSec listener: the apiserver (and
 * the E2B API on it) and the edge protocol server. It holds no I/O of its
 * own: it counts the sockets a server hands it and closes some of them.
 *
 * Vocabulary:
 * - a connection is *busy* while a request on it is being answered (or it
 *   was upgraded: a terminal, a port stream, unless its handler says it is
 *   `waiting` for its client), *idle* otherwise: a keep-alive
 *   connection between requests, or one that has not sent a whole request
 *   header yet (a slow or silent client);
 * - an *address* is a client IPv4 address, or the /64 of an IPv6 one (one
 *   host usually has a whole /64; `addressKey`).
 *
 * Rules:
 * - at `maxConnections` open connections, a new one closes the idle
 *   connection that has been idle longest; only when every connection is
 *   busy is the new one refused, with a 503 `unavailable` answer;
 * - the same per address at `maxConnectionsPerAddress`, among that
 *   address's connections (so one address's busy connections cannot push
 *   out another's idle ones);
 * - above half of either cap the server is *under pressure* (for that
 *   address only, for the per-address cap), and keep-alive shrinks to
 *   `pressureKeepAliveMs`: connections idle longer are closed.
 *
 * So a client can hold at most `maxConnectionsPerAddress` connections per
 * address, and idle ones only for as long as nobody needs the room; a busy
 * connection lasts as long as its request, which the server's own timeouts
 * and the per-key caps bound.
 */
export interface ConnectionLimits {
  /** Open connections at most. Default 10 000. */
  maxConnections: number;
  /** Open connections from one address at most. Default 4096. */
  maxConnectionsPerAddress: number;
  /** Keep-alive idle time while under pressure. Default 1000. */
  pressureKeepAliveMs: number;
}

export const CONNECTION_LIMIT_DEFAULTS: ConnectionLimits = {
  maxConnections: 10_000,
  maxConnectionsPerAddress: 4096,
  pressureKeepAliveMs: 1000,
};

/** Why a connection was refused or closed, as the metrics count it. */
export type ConnectionEvent =
  'refused_total' | 'refused_per_address' | 'evicted_idle' | 'closed_idle_pressure';

/** Pressure starts at this share of a cap. */
const PRESSURE_RATIO = 0.5;
/** A refused connection is closed after its answer, or after this long at the latest. */
const REFUSED_LINGER_MS = 2000;

interface Conn {
  socket: Duplex;
  address: string;
  /** Requests being answered on it; upgraded connections count one for ever. */
  busy: number;
  idleSinceMs: number;
}

/**
 * The connection limits of one server; `attach` it to the server once,
 * after every `connection` and `request` listener of its own is installed.
 */
export class ConnectionGuard {
  readonly limits: ConnectionLimits;
  readonly #onEvent: ((event: ConnectionEvent) => void) | undefined;
  readonly #now: () => number;
  readonly #conns = new Map<Duplex, Conn>();
  /** A TLS socket (what `request` names) → its connection. */
  readonly #tlsConns = new WeakMap<Duplex, Conn>();
  readonly #byAddress = new Map<string, Set<Conn>>();
  /** Idle connections, longest idle first (Set order: re-added when they go idle). */
  readonly #idle = new Set<Conn>();
  readonly #idleByAddress = new Map<string, Set<Conn>>();
  #sweeper: NodeJS.Timeout | undefined;

  constructor(
    limits: Partial<ConnectionLimits> = {},
    options: { onEvent?: (event: ConnectionEvent) => void; now?: () => number } = {},
  ) {
    this.limits = { ...CONNECTION_LIMIT_DEFAULTS, ...definedOnly(limits) };
    this.#onEvent = options.onEvent;
    this.#now = options.now ?? Date.now;
  }

  /** Open connections now. */
  get open(): number {
    return this.#conns.size;
  }

  /** Idle connections now. */
  get idle(): number {
    return this.#idle.size;
  }

  /**
   * Takes over the server's connections. Its `connection` listeners are
   * wrapped, so a refused connection never reaches the HTTP parser (it is
   * answered and closed without a request being read). Also sets Node's own
   * `maxConnections` off: it would drop a new connection before an idle one
   * could make room.
   */
  attach(server: Server): void {
    server.maxConnections = Number.POSITIVE_INFINITY;
    type Listener = (socket: Socket) => void;
    const listeners = server.listeners('connection') as Listener[];
    server.removeAllListeners('connection');
    server.on('connection', (socket: Socket) => {
      if (!this.#admit(socket)) return;
      for (const l of listeners) l.call(server, socket);
    });
    server.on('secureConnection', (tls: Duplex & { remotePort?: number }) => {
      const conn = this.#byEndpoint(tls as Socket);
      if (conn) this.#tlsConns.set(tls, conn);
    });
    server.on('request', (req: IncomingMessage, res: ServerResponse) => {
      const conn = this.#connOf(req.socket);
      if (!conn) return;
      this.#setBusy(conn, +1);
      res.once('close', () => this.#setBusy(conn, -1));
    });
    // First, so an upgrade handler that calls `waiting` finds its connection busy already.
    server.prependListener('upgrade', (req: IncomingMessage, socket: Duplex) => {
      const conn = this.#connOf(socket);
      if (conn) this.#setBusy(conn, +1);
      // Without another listener Node would have destroyed it; so do we.
      if (server.listenerCount('upgrade') === 1) socket.destroy();
    });
    server.once('close', () => this.#stopSweeper());
  }

  /**
   * An upgraded connection that waits for its client before it does any
   * work (a WebSocket whose key comes in its first message) counts as idle
   * until the returned function is called: a handshake that never
   * authenticates holds no room another client needs. Call it once the
   * client has authenticated.
   */
  waiting(socket: Duplex): () => void {
    const conn = this.#connOf(socket);
    if (!conn || conn.busy === 0) return () => undefined;
    this.#setBusy(conn, -1);
    let done = false;
    return () => {
      if (done) return;
      done = true;
      this.#setBusy(conn, +1);
    };
  }

  #admit(socket: Socket): boolean {
    const address = addressKey(socket.remoteAddress);
    if (this.#conns.size >= this.limits.maxConnections && !this.#evictIdle(this.#idle)) {
      this.#refuse(socket, 'refused_total', 'the server has too many open connections');
      return false;
    }
    const mine = this.#byAddress.get(address);
    if (
      (mine?.size ?? 0) >= this.limits.maxConnectionsPerAddress &&
      !this.#evictIdle(this.#idleByAddress.get(address))
    ) {
      this.#refuse(
        socket,
        'refused_per_address',
        'too many open connections from this address; close idle ones or wait',
      );
      return false;
    }
    const conn: Conn = { socket, address, busy: 0, idleSinceMs: this.#now() };
    this.#conns.set(socket, conn);
    setOf(this.#byAddress, address).add(conn);
    this.#markIdle(conn);
    socket.once('close', () => this.#forget(conn));
    if (this.#underPressure(address)) this.#startSweeper();
    return true;
  }

  /** Closes the longest-idle connection of `idle`; false when there is none. */
  #evictIdle(idle: Set<Conn> | undefined): boolean {
    const oldest = idle?.values().next();
    if (!oldest || oldest.done) return false;
    this.#forget(oldest.value);
    oldest.value.socket.destroy();
    this.#onEvent?.('evicted_idle');
    return true;
  }

  #refuse(socket: Socket, event: ConnectionEvent, message: string): void {
    this.#onEvent?.(event);
    const body = JSON.stringify({ error: { code: 'unavailable', message } });
    // What the client sent is read and dropped: closing with unread data would reset the
    // connection before it reads the answer.
    socket.on('error', () => undefined);
    socket.resume();
    socket.end(
      'HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n' +
        `Content-Type: application/json; charset=utf-8\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
    );
    setTimeout(() => socket.destroy(), REFUSED_LINGER_MS).unref();
  }

  #connOf(socket: Duplex): Conn | undefined {
    return this.#conns.get(socket) ?? this.#tlsConns.get(socket);
  }

  #byEndpoint(socket: Socket): Conn | undefined {
    for (const conn of this.#byAddress.get(addressKey(socket.remoteAddress)) ?? []) {
      const s = conn.socket as Socket;
      if (s.remotePort === socket.remotePort && s.remoteAddress === socket.remoteAddress)
        return conn;
    }
    return undefined;
  }

  #setBusy(conn: Conn, delta: number): void {
    if (!this.#conns.has(conn.socket)) return;
    conn.busy = Math.max(0, conn.busy + delta);
    if (conn.busy > 0) {
      this.#idle.delete(conn);
      this.#idleByAddress.get(conn.address)?.delete(conn);
    } else {
      conn.idleSinceMs = this.#now();
      this.#markIdle(conn);
    }
  }

  #markIdle(conn: Conn): void {
    // Delete first, so the Set order stays "longest idle first".
    this.#idle.delete(conn);
    this.#idle.add(conn);
    const mine = setOf(this.#idleByAddress, conn.address);
    mine.delete(conn);
    mine.add(conn);
  }

  #forget(conn: Conn): void {
    if (!this.#conns.delete(conn.socket)) return;
    this.#idle.delete(conn);
    dropFrom(this.#byAddress, conn.address, conn);
    dropFrom(this.#idleByAddress, conn.address, conn);
  }

  #globalPressure(): boolean {
    return this.#conns.size >= this.limits.maxConnections * PRESSURE_RATIO;
  }

  #addressPressure(address: string): boolean {
    return (
      (this.#byAddress.get(address)?.size ?? 0) >=
      this.limits.maxConnectionsPerAddress * PRESSURE_RATIO
    );
  }

  #underPressure(address: string): boolean {
    return this.#globalPressure() || this.#addressPressure(address);
  }

  #startSweeper(): void {
    if (this.#sweeper) return;
    const everyMs = Math.max(20, Math.min(1000, Math.floor(this.limits.pressureKeepAliveMs / 4)));
    this.#sweeper = setInterval(() => this.#sweep(), everyMs);
    this.#sweeper.unref();
  }

  #stopSweeper(): void {
    clearInterval(this.#sweeper);
    this.#sweeper = undefined;
  }

  /**
   * Under pressure: closes connections idle past `pressureKeepAliveMs`,
   * longest idle first (of all, or of the pressed address), until the
   * pressure is gone; stops once nothing is under pressure.
   */
  #sweep(): void {
    const cutoff = this.#now() - this.limits.pressureKeepAliveMs;
    const close = (conn: Conn) => {
      this.#forget(conn);
      conn.socket.destroy();
      this.#onEvent?.('closed_idle_pressure');
    };
    for (const conn of [...this.#idle]) {
      if (!this.#globalPressure() || conn.idleSinceMs > cutoff) break;
      close(conn);
    }
    let pressed = this.#globalPressure();
    for (const [address, idle] of [...this.#idleByAddress]) {
      for (const conn of [...idle]) {
        if (!this.#addressPressure(address)) break;
        pressed = true;
        if (conn.idleSinceMs > cutoff) break;
        close(conn);
      }
    }
    if (!pressed) this.#stopSweeper();
  }
}

/**
 * The unit a client address is counted in: an IPv4 address as it is (an
 * IPv4-mapped IPv6 address as its IPv4 form), an IPv6 address as its /64
 * (`2001:db8:0:1::/64`), anything else as it came (`unknown` for none).
 */
export function addressKey(address: string | undefined): string {
  if (!address) return 'unknown';
  const v4 = address.startsWith('::ffff:') ? address.slice(7) : address;
  if (isIPv4(v4)) return v4;
  const groups = ipv6Groups(address);
  if (!groups) return address;
  return `${groups.slice(0, 4).join(':')}::/64`;
}

/** The 8 groups of an IPv6 address, as lower-case hex without leading zeros; undefined if it is none. */
export function ipv6Groups(address: string): string[] | undefined {
  const bare = address.split('%')[0] ?? '';
  if (!isIPv6(bare)) return undefined;
  const halves = bare.split('::');
  const part = (s: string | undefined): string[] => {
    if (!s) return [];
    const out: string[] = [];
    for (const g of s.split(':')) {
      if (g.includes('.')) {
        const [a = 0, b = 0, c = 0, d = 0] = g.split('.').map(Number);
        out.push(((a << 8) | b).toString(16), ((c << 8) | d).toString(16));
      } else out.push(parseInt(g, 16).toString(16));
    }
    return out;
  };
  const head = part(halves[0]);
  const tail = part(halves[1]);
  const fill = halves.length === 2 ? Array<string>(8 - head.length - tail.length).fill('0') : [];
  const groups = [...head, ...fill, ...tail];
  return groups.length === 8 ? groups : undefined;
}

function setOf<K, V>(map: Map<K, Set<V>>, key: K): Set<V> {
  let set = map.get(key);
  if (!set) {
    set = new Set();
    map.set(key, set);
  }
  return set;
}

function dropFrom<K, V>(map: Map<K, Set<V>>, key: K, value: V): void {
  const set = map.get(key);
  if (!set) return;
  set.delete(value);
  if (set.size === 0) map.delete(key);
}

function definedOnly<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}

import { createSocket, type Socket } from 'node:dgram';
import { randomInt } from 'node:crypto';
import { isIP } from 'node:net';
import {
  errorResponse,
  parseAnswers,
  parseQuery,
  DnsFormatError,
  RCODE_FORMERR,
  RCODE_NXDOMAIN,
  RCODE_REFUSED,
  RCODE_SERVFAIL,
  type DnsAddressRecord,
} from './dns-message.js';

export interface UpstreamServer {
  address: string;
  port: number;
}

/** What the resolver needs to know about one sandbox. */
export interface ResolverClient {
  /** The host end of the sandbox's veth, where its resolver socket listens. */
  listenAddress: string;
  /** Addresses the sandbox's queries may come from (anything else is ignored). */
  sourceAddresses: string[];
  /** Whether a name may be resolved (and on which ports its addresses are allowed). */
  decide(name: string): { allowed: false } | { allowed: true; ports: number[] };
  /** Called with an allowed answer's addresses before the answer is released to the sandbox. */
  allowAddresses(name: string, ports: number[], records: DnsAddressRecord[]): Promise<void>;
  /** Called when a name is refused (rate-limiting is the caller's business). */
  blocked(name: string, qtype: number): void;
}

export interface PlatformResolverOptions {
  upstream: UpstreamServer[];
  /** Per upstream try; the sandbox gets SERVFAIL after every server was tried. */
  upstreamTimeoutMs?: number;
  /** Queries in flight per sandbox beyond which new ones are refused. */
  maxPendingPerSandbox?: number;
  log?: (msg: string, fields?: Record<string, unknown>) => void;
}

interface Pending {
  resolve: (msg: Buffer | undefined) => void;
  timer: NodeJS.Timeout;
  server: UpstreamServer;
}

/**
 * The platform DNS resolver (issue 5): the only resolver a sandbox can reach
 * (nftables lets UDP 53 through to the host and nothing else). One UDP socket
 * per sandbox, bound to the host end of its veth, so the socket a query
 * arrives on says whose policy applies. A name the policy allows is forwarded
 * to the node's upstream resolver and its A/AAAA answers are added to the
 * sandbox's allow set (for their TTL) before the answer is released; any
 * other name gets NXDOMAIN. No caching: upstream does that, and a policy
 * change must apply to the very next query.
 */
export class PlatformResolver {
  readonly #options: Required<Omit<PlatformResolverOptions, 'log'>> &
    Pick<PlatformResolverOptions, 'log'>;
  readonly #sockets = new Map<
    string,
    { socket: Socket; client: ResolverClient; pending: number }
  >();
  readonly #upstream = new Map<4 | 6, Socket>();
  readonly #pending = new Map<string, Pending>();

  constructor(options: PlatformResolverOptions) {
    this.#options = {
      upstreamTimeoutMs: 2000,
      maxPendingPerSandbox: 64,
      ...options,
    };
  }

  /** Starts answering a sandbox's queries; replaces an earlier attachment with the same key. */
  async attach(key: string, client: ResolverClient): Promise<void> {
    this.detach(key);
    const family = isIP(client.listenAddress) === 6 ? 'udp6' : 'udp4';
    const socket = createSocket({ type: family, reuseAddr: false });
    const entry = { socket, client, pending: 0 };
    socket.on('message', (msg, rinfo) => void this.#onQuery(entry, msg, rinfo.address, rinfo.port));
    socket.on('error', (err) =>
      this.#options.log?.('resolver socket error', { key, err: String(err) }),
    );
    await new Promise<void>((resolve, reject) => {
      socket.once('error', reject);
      socket.bind({ address: client.listenAddress, port: 53, exclusive: true }, () => {
        socket.off('error', reject);
        resolve();
      });
    });
    this.#sockets.set(key, entry);
  }

  detach(key: string): void {
    const entry = this.#sockets.get(key);
    if (!entry) return;
    this.#sockets.delete(key);
    entry.socket.close();
  }

  close(): void {
    for (const key of [...this.#sockets.keys()]) this.detach(key);
    for (const p of this.#pending.values()) {
      clearTimeout(p.timer);
      p.resolve(undefined);
    }
    this.#pending.clear();
    for (const s of this.#upstream.values()) s.close();
    this.#upstream.clear();
  }

  async #onQuery(
    entry: { socket: Socket; client: ResolverClient; pending: number },
    msg: Buffer,
    from: string,
    port: number,
  ): Promise<void> {
    const { socket, client } = entry;
    if (!client.sourceAddresses.includes(from)) return;
    const reply = (buf: Buffer) => {
      try {
        socket.send(buf, port, from);
      } catch {
        // socket closed while we were resolving (sandbox stopped)
      }
    };
    let q;
    try {
      q = parseQuery(msg);
    } catch (err) {
      if (err instanceof DnsFormatError && msg.length >= 12)
        reply(errorResponse(msg, RCODE_FORMERR));
      return;
    }
    if (q.class !== 1) return reply(errorResponse(msg, RCODE_REFUSED));
    const decision = client.decide(q.name);
    if (!decision.allowed) {
      client.blocked(q.name, q.type);
      return reply(errorResponse(msg, RCODE_NXDOMAIN));
    }
    if (entry.pending >= this.#options.maxPendingPerSandbox)
      return reply(errorResponse(msg, RCODE_SERVFAIL));
    entry.pending++;
    try {
      const answer = await this.#forward(msg, q.name, q.type);
      if (!answer) return reply(errorResponse(msg, RCODE_SERVFAIL));
      await client.allowAddresses(q.name, decision.ports, answer.records);
      const out = Buffer.from(answer.raw);
      out.writeUInt16BE(q.id, 0);
      reply(out);
    } catch (err) {
      this.#options.log?.('resolving failed', { name: q.name, err: String(err) });
      reply(errorResponse(msg, RCODE_SERVFAIL));
    } finally {
      entry.pending--;
    }
  }

  /** Sends the query upstream under a fresh ID, trying each server in turn. */
  async #forward(
    query: Buffer,
    name: string,
    type: number,
  ): Promise<{ raw: Buffer; records: DnsAddressRecord[] } | undefined> {
    for (const server of this.#options.upstream) {
      const family = isIP(server.address) === 6 ? 6 : 4;
      const sock = this.#upstreamSocket(family);
      let id = randomInt(0, 0x10000);
      for (let i = 0; i < 8 && this.#pending.has(`${family}:${id}`); i++)
        id = randomInt(0, 0x10000);
      const key = `${family}:${id}`;
      if (this.#pending.has(key)) continue;
      const out = Buffer.from(query);
      out.writeUInt16BE(id, 0);
      const raw = await new Promise<Buffer | undefined>((resolve) => {
        const timer = setTimeout(() => {
          this.#pending.delete(key);
          resolve(undefined);
        }, this.#options.upstreamTimeoutMs);
        this.#pending.set(key, { resolve, timer, server });
        sock.send(out, server.port, server.address, (err) => {
          if (err) {
            clearTimeout(timer);
            this.#pending.delete(key);
            resolve(undefined);
          }
        });
      });
      if (!raw) continue;
      try {
        const parsed = parseAnswers(raw);
        if (parsed.question.name !== name || parsed.question.type !== type) continue;
        return { raw, records: parsed.rcode === 0 ? parsed.records : [] };
      } catch {
        continue;
      }
    }
    return undefined;
  }

  #upstreamSocket(family: 4 | 6): Socket {
    let sock = this.#upstream.get(family);
    if (sock) return sock;
    sock = createSocket(family === 6 ? 'udp6' : 'udp4');
    sock.on('message', (msg, rinfo) => {
      if (msg.length < 2) return;
      const key = `${family}:${msg.readUInt16BE(0)}`;
      const p = this.#pending.get(key);
      // Only the server we asked may answer (no spoofing from elsewhere).
      if (!p || p.server.address !== rinfo.address || p.server.port !== rinfo.port) return;
      this.#pending.delete(key);
      clearTimeout(p.timer);
      p.resolve(msg);
    });
    sock.on('error', (err) => this.#options.log?.('upstream socket error', { err: String(err) }));
    sock.unref();
    this.#upstream.set(family, sock);
    return sock;
  }
}

/** Nameservers of /etc/resolv.conf-style text, as upstream servers on port 53. */
export function parseResolvConf(text: string): UpstreamServer[] {
  const out: UpstreamServer[] = [];
  for (const line of text.split('\n')) {
    const m = /^\s*nameserver\s+(\S+)/.exec(line);
    const addr = m?.[1]?.replace(/%.*$/, '');
    if (addr && isIP(addr)) out.push({ address: addr, port: 53 });
  }
  return out;
}

/** `1.2.3.4`, `1.2.3.4:5353`, `[::1]:53`, `::1` → an upstream server. */
export function parseUpstream(s: string): UpstreamServer {
  const bracket = /^\[([^\]]+)\](?::(\d+))?$/.exec(s);
  if (bracket?.[1]) return { address: bracket[1], port: Number(bracket[2] ?? 53) };
  if (isIP(s)) return { address: s, port: 53 };
  const m = /^([^:]+):(\d+)$/.exec(s);
  if (m?.[1] && isIP(m[1])) return { address: m[1], port: Number(m[2]) };
  throw new Error(`not an upstream DNS server: ${s}`);
}

import { createSocket, type Socket } from 'node:dgram';
import { randomInt } from 'node:crypto';
import { isIP } from 'node:net';
import {
  CLASS_IN,
  CLASSIC_UDP_BYTES,
  clampUdp,
  encodeForwardQuery,
  encodeMessage,
  errorResponse,
  MAX_UDP_BYTES,
  nameKey,
  nameText,
  parseMessage,
  parseQuery,
  recordAddress,
  svcbHints,
  DnsFormatError,
  RCODE_FORMERR,
  RCODE_NXDOMAIN,
  RCODE_REFUSED,
  RCODE_SERVFAIL,
  TYPE_CNAME,
  TYPE_OPT,
  type DnsAddressRecord,
  type DnsMessage,
  type DnsName,
  type DnsQuestion,
  type DnsRecord,
  UNVETTED_ADDRESS_TYPES,
} from './dns-message.js';
import type { AddressVerdict } from './special-ranges.js';

export interface UpstreamServer {
  address: string;
  port: number;
}

/** A record the screen took out of an answer (reported as a sandbox event). */
export interface DroppedRecord {
  /** Owner name, as the policy reads names. */
  name: string;
  type: number;
  address?: string | undefined;
  range?: string | undefined;
  why: string;
}

/** What the resolver needs to know about one sandbox. */
export interface ResolverClient {
  /** The host end of the sandbox's veth, where its resolver socket listens. */
  listenAddress: string;
  /** Addresses the sandbox's queries may come from (anything else is ignored). */
  sourceAddresses: string[];
  /** Whether a name may be resolved (and on which ports its addresses are allowed). */
  decide(name: string): { allowed: false } | { allowed: true; ports: number[] };
  /** What an address in an allowed name's answer may become (see {@link AddressVerdict}). */
  screen(address: string): AddressVerdict;
  /**
   * Called with an answer's opened addresses before the answer is released to
   * the sandbox. False: the sandbox is at its bound of open addresses, nothing
   * was opened, and the answer is refused (SERVFAIL; reporting is the caller's).
   */
  allowAddresses(name: string, ports: number[], records: DnsAddressRecord[]): Promise<boolean>;
  /** Called when a name is refused (rate-limiting is the caller's business). */
  blocked(name: string, qtype: number): void;
  /** Called when records were taken out of an allowed name's answer. */
  filtered(name: string, qtype: number, dropped: DroppedRecord[]): void;
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
 * Screens an upstream answer to a sandbox's question (SECURITY.md L40):
 * every address a client could use, in any section, is put to `screen`, and
 * the records carrying one it drops are left out, as are the records no
 * client should be handed:
 * - A and AAAA: kept only if their address is kept; in the answer section,
 *   only on the question's CNAME chain (musl uses every A/AAAA of the answer
 *   section whatever its owner), and only those of the answer section are
 *   opened (`open`, for the sandbox's allow sets);
 * - SVCB/HTTPS: dropped if any `ipv4hint`/`ipv6hint` address is dropped
 *   (clients may connect to hints before they resolve A/AAAA);
 * - the {@link UNVETTED_ADDRESS_TYPES} (A6, WKS, APL, IPSECKEY…: addresses the
 *   screen does not vet; no stub connects by them)
 *   and every record of a class other than IN (the question is IN; musl
 *   reads an A record whatever its class) except the one OPT.
 * Malformed address records throw `DnsFormatError`: the whole answer is refused.
 */
export function screenAnswer(
  answer: DnsMessage,
  question: DnsName,
  screen: (address: string) => AddressVerdict,
): { message: DnsMessage; open: DnsAddressRecord[]; dropped: DroppedRecord[] } {
  // The question's chain of aliases (CNAME; a DNAME's answer carries its synthesized CNAME).
  const targets = new Map<string, DnsName[]>();
  for (const r of answer.answers) {
    const target = r.data[0];
    if (r.type !== TYPE_CNAME || r.class !== CLASS_IN || !target || Buffer.isBuffer(target))
      continue;
    const k = nameKey(r.name);
    targets.set(k, [...(targets.get(k) ?? []), target.name]);
  }
  const chain = new Set([nameKey(question)]);
  const todo = [nameKey(question)];
  while (todo.length > 0) {
    for (const t of targets.get(todo.pop()!) ?? []) {
      const k = nameKey(t);
      if (!chain.has(k)) {
        chain.add(k);
        todo.push(k);
      }
    }
  }
  const open: DnsAddressRecord[] = [];
  const dropped: DroppedRecord[] = [];
  let opt = false;
  const keep = (r: DnsRecord, section: 'answer' | 'authority' | 'additional'): boolean => {
    const drop = (why: string, address?: string, range?: string) => {
      dropped.push({ name: nameText(r.name), type: r.type, why, address, range });
      return false;
    };
    if (r.type === TYPE_OPT) {
      if (opt || section !== 'additional') return drop('OPT out of place');
      opt = true;
      return true;
    }
    if (r.class !== CLASS_IN) return drop(`class ${r.class} in an IN answer`);
    if (UNVETTED_ADDRESS_TYPES.has(r.type))
      return drop('an address type the resolver does not vet');
    const a = recordAddress(r);
    if (a) {
      if (section === 'answer' && !chain.has(nameKey(r.name)))
        return drop("not on the question's CNAME chain", a.address);
      const v = screen(a.address);
      if (v.verdict === 'drop') return drop(v.why, a.address, v.range);
      if (v.verdict === 'open' && section === 'answer')
        open.push({
          name: nameText(r.name),
          family: a.family,
          address: a.address,
          ttlSeconds: r.ttl,
        });
      return true;
    }
    for (const h of svcbHints(r)) {
      const v = screen(h.address);
      if (v.verdict === 'drop') return drop(`address hint: ${v.why}`, h.address, v.range);
    }
    return true;
  };
  const message: DnsMessage = {
    ...answer,
    answers: answer.answers.filter((r) => keep(r, 'answer')),
    authority: answer.authority.filter((r) => keep(r, 'authority')),
    additional: answer.additional.filter((r) => keep(r, 'additional')),
  };
  return { message, open, dropped };
}

/**
 * The platform DNS resolver (issue 5): the only resolver a sandbox can reach
 * (nftables lets DNS through to this socket's address on the sandbox's own
 * veth, and nothing else on the host). One UDP socket per sandbox, bound to
 * the host end of its veth, so the socket a query arrives on says whose
 * policy applies. A name the policy allows is forwarded to the node's
 * upstream resolver as a query written afresh; the answer is parsed whole,
 * screened ({@link screenAnswer}: no private or special-use address reaches
 * the sandbox unless a CIDR rule of its policy covers it), its public A/AAAA
 * addresses are added to the sandbox's allow set (for their TTL), and the
 * answer written anew from what was kept is released; any other name gets
 * NXDOMAIN. No caching: upstream does that, and a policy change must apply
 * to the very next query.
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
    let q: DnsQuestion;
    try {
      q = parseQuery(msg);
    } catch (err) {
      if (err instanceof DnsFormatError && msg.length >= 12)
        reply(errorResponse(msg, RCODE_FORMERR));
      return;
    }
    if (q.class !== CLASS_IN) return reply(errorResponse(msg, RCODE_REFUSED));
    // A dot inside a label would read as two labels to the policy and as one to
    // upstream ("x" under a TLD "allowed.com"): such a name is never allowed.
    const decision = q.labels.some((l) => l.includes('.'))
      ? ({ allowed: false } as const)
      : client.decide(q.name);
    if (!decision.allowed) {
      client.blocked(q.name, q.type);
      return reply(errorResponse(msg, RCODE_NXDOMAIN));
    }
    if (entry.pending >= this.#options.maxPendingPerSandbox)
      return reply(errorResponse(msg, RCODE_SERVFAIL));
    entry.pending++;
    try {
      const answer = await this.#forward(q);
      if (!answer) return reply(errorResponse(msg, RCODE_SERVFAIL));
      // The policy may have changed while upstream had the question (a zone can
      // answer as late as the timeout): the answer opens only what the policy
      // allows now, decided in the same tick as the opening, so a live update
      // either comes first (and refuses it) or finds the name's addresses to close.
      const now = client.decide(q.name);
      if (!now.allowed) {
        client.blocked(q.name, q.type);
        return reply(errorResponse(msg, RCODE_NXDOMAIN));
      }
      const screened = screenAnswer(answer, q.labels, (a) => client.screen(a));
      if (!(await client.allowAddresses(q.name, now.ports, screened.open)))
        return reply(errorResponse(msg, RCODE_SERVFAIL));
      if (screened.dropped.length > 0) client.filtered(q.name, q.type, screened.dropped);
      reply(encodeAnswer(q, screened.message));
    } catch (err) {
      this.#options.log?.('resolving failed', { name: q.name, err: String(err) });
      reply(errorResponse(msg, RCODE_SERVFAIL));
    } finally {
      entry.pending--;
    }
  }

  /** Sends the query upstream under a fresh ID, trying each server in turn. */
  async #forward(q: DnsQuestion): Promise<DnsMessage | undefined> {
    for (const server of this.#options.upstream) {
      const family = isIP(server.address) === 6 ? 6 : 4;
      const sock = this.#upstreamSocket(family);
      let id = randomInt(0, 0x10000);
      for (let i = 0; i < 8 && this.#pending.has(`${family}:${id}`); i++)
        id = randomInt(0, 0x10000);
      const key = `${family}:${id}`;
      if (this.#pending.has(key)) continue;
      const out = encodeForwardQuery(id, q);
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
        const parsed = parseMessage(raw);
        const pq = parsed.question;
        if (nameKey(pq.labels) !== nameKey(q.labels) || pq.type !== q.type || pq.class !== q.class)
          continue;
        return parsed;
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

/**
 * The sandbox's answer, written from a screened upstream answer: the
 * sandbox's own ID and question (its letter case, for clients that check
 * it), upstream's flags, the kept records within the payload size the
 * sandbox offered (TC past it), and EDNS only if the sandbox used it, as
 * this resolver's own OPT (its payload size, upstream's extended RCODE and
 * DO bit, no options: upstream's cookies and padding stay upstream).
 */
export function encodeAnswer(q: DnsQuestion, m: DnsMessage): Buffer {
  const upstreamOpt = m.additional.find((r) => r.type === TYPE_OPT);
  const additional = m.additional.filter((r) => r.type !== TYPE_OPT);
  if (q.edns) {
    additional.push({
      name: [],
      type: TYPE_OPT,
      class: MAX_UDP_BYTES,
      ttl: (upstreamOpt?.ttl ?? 0) & 0xff008000,
      data: [],
    });
  }
  return encodeMessage(
    {
      ...m,
      id: q.id,
      question: { labels: q.labels, type: q.type, class: q.class },
      additional,
    },
    q.edns ? clampUdp(q.edns.udpBytes) : CLASSIC_UDP_BYTES,
  );
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

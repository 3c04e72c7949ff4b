/**
 * The DNS wire format (RFC 1035) as far as the platform resolver needs it:
 * read a query's one question and EDNS options, read a whole response into
 * records (names decompressed, also inside the RDATA of the types whose
 * RDATA holds names), and write messages back. The resolver never relays
 * upstream's bytes: what a sandbox gets is written here from what was parsed
 * and screened, so the sandbox's own parser (glibc, musl, Go…) cannot read
 * anything the screen did not see.
 *
 * Everything is bounds-checked and bounded, since both sides are hostile (the
 * sandbox's queries; the answers of a zone the sandbox's owner may control):
 * - anything malformed throws `DnsFormatError`, and nothing else;
 * - compression pointers point strictly backwards and a name takes at most
 *   {@link MAX_POINTER_JUMPS} of them, so no input loops;
 * - a name is at most 255 bytes on the wire (RFC 1035 2.3.4), a record at
 *   least 11 bytes of input, so a message of N bytes yields at most N / 11
 *   records and at most 2 names of 255 bytes per record (SOA, MINFO, RP, PX
 *   have two names; the rest one or none): the parse allocates O(N).
 */

export const TYPE_A = 1;
export const TYPE_NS = 2;
export const TYPE_CNAME = 5;
export const TYPE_SOA = 6;
export const TYPE_WKS = 11;
export const TYPE_MX = 15;
export const TYPE_AAAA = 28;
export const TYPE_SRV = 33;
export const TYPE_A6 = 38;
export const TYPE_DNAME = 39;
export const TYPE_OPT = 41;
export const TYPE_APL = 42;
export const TYPE_IPSECKEY = 45;
export const TYPE_L32 = 105;
export const TYPE_AMTRELAY = 260;
export const TYPE_SVCB = 64;
export const TYPE_HTTPS = 65;
export const CLASS_IN = 1;
export const RCODE_FORMERR = 1;
export const RCODE_SERVFAIL = 2;
export const RCODE_NXDOMAIN = 3;
export const RCODE_REFUSED = 5;

/**
 * Types whose RDATA carries IPv4 or IPv6 addresses other than A, AAAA and
 * SVCB/HTTPS hints: WKS (RFC 1035), A6 (RFC 2874, historic), APL (RFC 3123),
 * IPSECKEY gateways (RFC 4025), L32 locators (RFC 6742), AMTRELAY relays
 * (RFC 8777). No stub connects by them; the resolver does not vet them.
 */
export const UNVETTED_ADDRESS_TYPES: ReadonlySet<number> = new Set([
  TYPE_WKS,
  TYPE_A6,
  TYPE_APL,
  TYPE_IPSECKEY,
  TYPE_L32,
  TYPE_AMTRELAY,
]);

/** Flag bits of the header's second word. */
export const FLAG_QR = 0x8000;
export const FLAG_TC = 0x0200;
export const FLAG_RD = 0x0100;
export const FLAG_RA = 0x0080;
export const FLAG_AD = 0x0020;
export const FLAG_CD = 0x0010;

/** Compression pointers one name may follow (a sane encoder uses one). */
export const MAX_POINTER_JUMPS = 32;
/** A response over UDP without EDNS (RFC 1035 4.2.1). */
export const CLASSIC_UDP_BYTES = 512;
/** The largest UDP payload the resolver offers or accepts (RFC 6891; DNS flag day 2020 uses 1232). */
export const MAX_UDP_BYTES = 4096;

export class DnsFormatError extends Error {}

/** A domain name as its labels, each a latin1 string of the label's bytes (case as sent). */
export type DnsName = string[];

export interface DnsQuestion {
  id: number;
  flags: number;
  /** ASCII lower case, labels joined by dots, no trailing dot (what the policy matches). */
  name: string;
  labels: DnsName;
  type: number;
  class: number;
  /** Byte offset just past the question (where the answer section would start). */
  end: number;
  /** The query's EDNS (RFC 6891) options, if it had an OPT record. */
  edns?: { udpBytes: number; dnssecOk: boolean } | undefined;
}

/**
 * RDATA as parts: plain bytes and names. Only the types of
 * {@link RDATA_LAYOUTS} have names split out; other RDATA is one buffer
 * (RFC 3597: names in RDATA of other types are never compressed).
 */
export type RdataPart = Buffer | { name: DnsName };

export interface DnsRecord {
  name: DnsName;
  type: number;
  class: number;
  ttl: number;
  data: RdataPart[];
}

export interface DnsMessage {
  id: number;
  flags: number;
  question: { labels: DnsName; type: number; class: number };
  answers: DnsRecord[];
  authority: DnsRecord[];
  additional: DnsRecord[];
}

export interface DnsAddressRecord {
  name: string;
  family: 4 | 6;
  address: string;
  ttlSeconds: number;
}

/**
 * Where names sit in the RDATA of the types that hold them: a number is that
 * many fixed bytes, `name` a domain name, `string` a character-string (a
 * length byte and that many bytes), `rest` everything after. Types whose
 * names may be compressed when sent are in {@link COMPRESSIBLE}; a receiver
 * must decompress all of these (RFC 3597 section 4).
 */
type Field = number | 'name' | 'string' | 'rest';
const RDATA_LAYOUTS: Readonly<Record<number, readonly Field[]>> = {
  2: ['name'], // NS
  3: ['name'], // MD
  4: ['name'], // MF
  5: ['name'], // CNAME
  6: ['name', 'name', 20], // SOA
  7: ['name'], // MB
  8: ['name'], // MG
  9: ['name'], // MR
  12: ['name'], // PTR
  14: ['name', 'name'], // MINFO
  15: [2, 'name'], // MX
  17: ['name', 'name'], // RP
  18: [2, 'name'], // AFSDB
  21: [2, 'name'], // RT
  26: [2, 'name', 'name'], // PX
  33: [6, 'name'], // SRV
  35: [4, 'string', 'string', 'string', 'name'], // NAPTR
  36: [2, 'name'], // KX
  39: ['name'], // DNAME
  64: [2, 'name', 'rest'], // SVCB
  65: [2, 'name', 'rest'], // HTTPS
};
/** The RFC 1035 types, whose RDATA names may be compressed on the way out. */
const COMPRESSIBLE = new Set([2, 3, 4, 5, 6, 7, 8, 9, 12, 14, 15]);

/** ASCII lower case (DNS names compare case-insensitively in ASCII only, RFC 4343). */
function asciiLower(s: string): string {
  // Below 0x80 toLowerCase is exactly ASCII's; above, latin1 letters (À…) must stay as they are.
  let ascii = true;
  for (let i = 0; i < s.length && ascii; i++) ascii = s.charCodeAt(i) < 0x80;
  if (ascii) return s.toLowerCase();
  let out = '';
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    out += c >= 0x41 && c <= 0x5a ? String.fromCharCode(c + 0x20) : s[i];
  }
  return out;
}

/** The name as the policy reads it: ASCII lower case, dot-joined, no trailing dot. */
export function nameText(name: DnsName): string {
  return name.map(asciiLower).join('.');
}

/**
 * A key that compares names as DNS does (case-insensitively in ASCII) and
 * never confuses a dot inside a label with a label boundary.
 */
export function nameKey(name: DnsName): string {
  return name.map(keyLabel).join('.');
}

function keyLabel(label: string): string {
  const l = asciiLower(label);
  if (!l.includes('.') && !l.includes('\\')) return l;
  return l.replaceAll('\\', '\\\\').replaceAll('.', '\\.');
}

/** Reads a name at `start`; `end` is the offset just past it where it started. */
export function readName(msg: Buffer, start: number): { labels: DnsName; end: number } {
  const labels: DnsName = [];
  let off = start;
  let end = -1;
  let jumps = 0;
  let wire = 1; // the root label's byte
  for (;;) {
    if (off >= msg.length) throw new DnsFormatError('name runs past the message');
    const len = msg[off]!;
    if (len === 0) {
      if (end < 0) end = off + 1;
      break;
    }
    if ((len & 0xc0) === 0xc0) {
      if (off + 1 >= msg.length) throw new DnsFormatError('bad pointer');
      if (++jumps > MAX_POINTER_JUMPS) throw new DnsFormatError('pointer loop');
      const target = ((len & 0x3f) << 8) | msg[off + 1]!;
      // Only to an earlier place (RFC 1035 4.1.4: "a prior occurrence"): no loops.
      if (target >= off) throw new DnsFormatError('pointer does not point backwards');
      if (end < 0) end = off + 2;
      off = target;
      continue;
    }
    if (len & 0xc0) throw new DnsFormatError('bad label type');
    if (off + 1 + len > msg.length) throw new DnsFormatError('label runs past the message');
    wire += len + 1;
    if (wire > 255) throw new DnsFormatError('name too long');
    labels.push(msg.toString('latin1', off + 1, off + 1 + len));
    off += 1 + len;
  }
  return { labels, end };
}

/** Reads the header and the one question of a query, and its EDNS OPT record if any. */
export function parseQuery(msg: Buffer): DnsQuestion {
  if (msg.length < 12) throw new DnsFormatError('short header');
  const flags = msg.readUInt16BE(2);
  if (flags & FLAG_QR) throw new DnsFormatError('not a query');
  if ((flags >> 11) & 0xf) throw new DnsFormatError('not a standard query');
  if (msg.readUInt16BE(4) !== 1) throw new DnsFormatError('exactly one question expected');
  const { labels, end } = readName(msg, 12);
  if (end + 4 > msg.length) throw new DnsFormatError('truncated question');
  const q: DnsQuestion = {
    id: msg.readUInt16BE(0),
    flags,
    name: nameText(labels),
    labels,
    type: msg.readUInt16BE(end),
    class: msg.readUInt16BE(end + 2),
    end: end + 4,
  };
  // EDNS: the one OPT record of an otherwise empty query (anything else is ignored).
  if (msg.readUInt16BE(6) === 0 && msg.readUInt16BE(8) === 0 && msg.readUInt16BE(10) === 1) {
    const opt = readRecord(msg, q.end);
    if (opt.record.type === TYPE_OPT && opt.record.name.length === 0) {
      q.edns = {
        udpBytes: opt.record.class,
        dnssecOk: (opt.record.ttl & 0x8000) !== 0,
      };
    }
  }
  return q;
}

function readRecord(msg: Buffer, start: number): { record: DnsRecord; end: number } {
  const { labels, end } = readName(msg, start);
  if (end + 10 > msg.length) throw new DnsFormatError('truncated record');
  const type = msg.readUInt16BE(end);
  const cls = msg.readUInt16BE(end + 2);
  const ttl = msg.readUInt32BE(end + 4);
  const rdlen = msg.readUInt16BE(end + 8);
  const rdata = end + 10;
  const rdataEnd = rdata + rdlen;
  if (rdataEnd > msg.length) throw new DnsFormatError('truncated rdata');
  const layout = cls === CLASS_IN ? RDATA_LAYOUTS[type] : undefined;
  const data: RdataPart[] = [];
  if (!layout) {
    data.push(Buffer.from(msg.subarray(rdata, rdataEnd)));
  } else {
    let off = rdata;
    for (const field of layout) {
      if (field === 'name') {
        const n = readName(msg, off);
        if (n.end > rdataEnd) throw new DnsFormatError('name runs past the rdata');
        data.push({ name: n.labels });
        off = n.end;
        continue;
      }
      const size =
        field === 'rest' ? rdataEnd - off : field === 'string' ? 1 + (msg[off] ?? 0) : field;
      if (off + size > rdataEnd) throw new DnsFormatError('rdata too short for its type');
      data.push(Buffer.from(msg.subarray(off, off + size)));
      off += size;
    }
    if (off !== rdataEnd) throw new DnsFormatError('rdata longer than its type');
  }
  return { record: { name: labels, type, class: cls, ttl, data }, end: rdataEnd };
}

/** Reads a whole response; throws `DnsFormatError` on anything malformed. */
export function parseMessage(msg: Buffer): DnsMessage {
  if (msg.length < 12) throw new DnsFormatError('short header');
  const flags = msg.readUInt16BE(2);
  if (!(flags & FLAG_QR)) throw new DnsFormatError('not a response');
  if (msg.readUInt16BE(4) !== 1) throw new DnsFormatError('exactly one question expected');
  const q = readName(msg, 12);
  if (q.end + 4 > msg.length) throw new DnsFormatError('truncated question');
  let off = q.end + 4;
  const sections: DnsRecord[][] = [[], [], []];
  for (let s = 0; s < 3; s++) {
    const count = msg.readUInt16BE(6 + 2 * s);
    for (let i = 0; i < count; i++) {
      // Each record takes at least 11 bytes, so a huge count fails here at once.
      const r = readRecord(msg, off);
      sections[s]!.push(r.record);
      off = r.end;
    }
  }
  return {
    id: msg.readUInt16BE(0),
    flags,
    question: {
      labels: q.labels,
      type: msg.readUInt16BE(q.end),
      class: msg.readUInt16BE(q.end + 2),
    },
    answers: sections[0]!,
    authority: sections[1]!,
    additional: sections[2]!,
  };
}

/**
 * The address an A or AAAA record of class IN carries (undefined for other
 * records; `DnsFormatError` for one of the wrong length, which no client
 * must ever be handed).
 */
export function recordAddress(r: DnsRecord): { family: 4 | 6; address: string } | undefined {
  if (r.class !== CLASS_IN || (r.type !== TYPE_A && r.type !== TYPE_AAAA)) return undefined;
  const data = r.data[0];
  const size = r.type === TYPE_A ? 4 : 16;
  if (r.data.length !== 1 || !Buffer.isBuffer(data) || data.length !== size)
    throw new DnsFormatError(
      `${r.type === TYPE_A ? 'A' : 'AAAA'} record of ${size} bytes expected`,
    );
  return r.type === TYPE_A
    ? { family: 4, address: formatAddress(data) }
    : { family: 6, address: formatAddress(data) };
}

/**
 * The addresses of an SVCB or HTTPS record's `ipv4hint` and `ipv6hint`
 * parameters (RFC 9460 7.3), which clients may connect to before (or
 * instead of) resolving A and AAAA.
 */
export function svcbHints(r: DnsRecord): { family: 4 | 6; address: string }[] {
  if (r.class !== CLASS_IN || (r.type !== TYPE_SVCB && r.type !== TYPE_HTTPS)) return [];
  const params = r.data[2];
  if (!Buffer.isBuffer(params)) throw new DnsFormatError('SVCB record without parameters');
  const out: { family: 4 | 6; address: string }[] = [];
  let off = 0;
  while (off < params.length) {
    if (off + 4 > params.length) throw new DnsFormatError('truncated SVCB parameter');
    const key = params.readUInt16BE(off);
    const len = params.readUInt16BE(off + 2);
    const value = off + 4;
    if (value + len > params.length) throw new DnsFormatError('SVCB parameter runs past the rdata');
    const size = key === 4 ? 4 : key === 6 ? 16 : 0;
    if (size > 0) {
      if (len === 0 || len % size !== 0) throw new DnsFormatError('bad SVCB address hint');
      for (let a = value; a < value + len; a += size)
        out.push({
          family: size === 4 ? 4 : 6,
          address: formatAddress(params.subarray(a, a + size)),
        });
    }
    off = value + len;
  }
  return out;
}

/** An IPv4 (4 bytes) or IPv6 (16 bytes) address in its canonical text form (RFC 5952). */
export function formatAddress(b: Buffer): string {
  if (b.length === 4) return `${b[0]}.${b[1]}.${b[2]}.${b[3]}`;
  const groups: number[] = [];
  for (let i = 0; i < 16; i += 2) groups.push(b.readUInt16BE(i));
  let best = -1;
  let bestLen = 1;
  for (let i = 0; i < 8;) {
    let j = i;
    while (j < 8 && groups[j] === 0) j++;
    if (j - i > bestLen) {
      best = i;
      bestLen = j - i;
    }
    i = j === i ? i + 1 : j;
  }
  const hex = (g: number[]) => g.map((x) => x.toString(16)).join(':');
  if (best < 0) return hex(groups);
  return `${hex(groups.slice(0, best))}::${hex(groups.slice(best + bestLen))}`;
}

/**
 * A growable buffer with a name-compression table. A written suffix is keyed
 * by its first label (ASCII lower case) and the offset of the rest of it
 * (`-1` for the root), so finding the longest known suffix of a name costs
 * one map lookup per label, whatever the name's length.
 */
class Writer {
  buf = Buffer.alloc(512);
  length = 0;
  readonly #names = new Map<string, number>();

  #room(n: number): void {
    if (this.length + n <= this.buf.length) return;
    const next = Buffer.alloc(Math.max(this.buf.length * 2, this.length + n));
    this.buf.copy(next, 0, 0, this.length);
    this.buf = next;
  }

  bytes(b: Buffer): void {
    this.#room(b.length);
    b.copy(this.buf, this.length);
    this.length += b.length;
  }

  u16(v: number): void {
    this.#room(2);
    this.buf.writeUInt16BE(v, this.length);
    this.length += 2;
  }

  u32(v: number): void {
    this.#room(4);
    this.buf.writeUInt32BE(v >>> 0, this.length);
    this.length += 4;
  }

  /** Writes a name; with `compress`, its longest suffix written before becomes a pointer. */
  name(labels: DnsName, compress: boolean): void {
    const lower = compress ? labels.map(asciiLower) : [];
    let known = labels.length;
    let rest = -1;
    while (compress && known > 0) {
      const at = this.#names.get(`${rest}:${lower[known - 1]}`);
      if (at === undefined) break;
      rest = at;
      known--;
    }
    const starts: number[] = [];
    for (let i = 0; i < known; i++) {
      starts.push(this.length);
      const label = labels[i]!;
      this.#room(1 + label.length);
      this.buf[this.length++] = label.length;
      this.length += this.buf.write(label, this.length, 'latin1');
    }
    if (known < labels.length) this.u16(0xc000 | rest);
    else {
      this.#room(1);
      this.buf[this.length++] = 0;
    }
    if (!compress) return;
    for (let i = known - 1; i >= 0; i--) {
      const next = i + 1 < known ? starts[i + 1]! : rest;
      if (starts[i]! < 0x4000) this.#names.set(`${next}:${lower[i]}`, starts[i]!);
    }
  }

  /** Cuts the message back to `offset` and forgets the compression targets past it. */
  truncate(offset: number): void {
    this.length = offset;
    for (const [k, v] of this.#names) if (v >= offset) this.#names.delete(k);
  }
}

function writeRecord(w: Writer, r: DnsRecord): void {
  w.name(r.name, true);
  w.u16(r.type);
  w.u16(r.class);
  w.u32(r.ttl);
  const lengthAt = w.length;
  w.u16(0);
  const compress = COMPRESSIBLE.has(r.type) && r.class === CLASS_IN;
  for (const part of r.data) {
    if (Buffer.isBuffer(part)) w.bytes(part);
    else w.name(part.name, compress);
  }
  const rdlen = w.length - lengthAt - 2;
  if (rdlen > 0xffff) throw new DnsFormatError('rdata too long');
  w.buf.writeUInt16BE(rdlen, lengthAt);
}

/**
 * Writes a message. Past `maxBytes`, the records that do not fit are left
 * out and TC is set (the client retries over TCP, RFC 1035 4.2.1); an OPT
 * record in the additional section is always kept (RFC 6891 7).
 */
export function encodeMessage(m: DnsMessage, maxBytes = 0xffff): Buffer {
  const w = new Writer();
  w.u16(m.id);
  w.u16(m.flags);
  w.u16(1);
  w.u16(0);
  w.u16(0);
  w.u16(0);
  w.name(m.question.labels, true);
  w.u16(m.question.type);
  w.u16(m.question.class);
  const opt = m.additional.filter((r) => r.type === TYPE_OPT).slice(0, 1);
  const optBytes = opt.reduce((n, r) => n + 11 + r.data.reduce((s, p) => s + dataLength(p), 0), 0);
  const limit = Math.max(maxBytes - optBytes, w.length);
  const counts = [0, 0, 0];
  let truncated = false;
  const sections = [m.answers, m.authority, m.additional.filter((r) => r.type !== TYPE_OPT)];
  for (let s = 0; s < 3 && !truncated; s++) {
    for (const r of sections[s]!) {
      const at = w.length;
      writeRecord(w, r);
      if (w.length > limit) {
        w.truncate(at);
        truncated = true;
        break;
      }
      counts[s]!++;
    }
  }
  for (const r of opt) writeRecord(w, r);
  counts[2]! += opt.length;
  const out = w.buf.subarray(0, w.length);
  if (truncated) out.writeUInt16BE(m.flags | FLAG_TC, 2);
  for (let s = 0; s < 3; s++) out.writeUInt16BE(counts[s]!, 6 + 2 * s);
  return Buffer.from(out);
}

function dataLength(p: RdataPart): number {
  return Buffer.isBuffer(p) ? p.length : p.name.reduce((n, l) => n + l.length + 1, 1);
}

/**
 * The query the resolver sends upstream for a sandbox's `q`: written afresh
 * (no bytes of the sandbox's message but its question's labels), with the
 * sandbox's RD/CD bits and, if it used EDNS, an OPT record with its payload
 * size (clamped to 512–{@link MAX_UDP_BYTES}) and DO bit and no options.
 */
export function encodeForwardQuery(id: number, q: DnsQuestion): Buffer {
  const additional: DnsRecord[] = q.edns
    ? [
        {
          name: [],
          type: TYPE_OPT,
          class: clampUdp(q.edns.udpBytes),
          ttl: q.edns.dnssecOk ? 0x8000 : 0,
          data: [],
        },
      ]
    : [];
  const out = encodeMessage({
    id,
    flags: q.flags & (FLAG_RD | FLAG_CD | FLAG_AD),
    question: { labels: q.labels, type: q.type, class: q.class },
    answers: [],
    authority: [],
    additional,
  });
  // encodeMessage writes a response's layout; a query has QR clear already (flags above).
  return out;
}

/** The payload size a client advertised, as the resolver honours it. */
export function clampUdp(udpBytes: number): number {
  return Math.min(MAX_UDP_BYTES, Math.max(CLASSIC_UDP_BYTES, udpBytes));
}

/** A response to `query` with no answers and `rcode` (NXDOMAIN, REFUSED, SERVFAIL…). */
export function errorResponse(query: Buffer, rcode: number): Buffer {
  let q: DnsQuestion | undefined;
  try {
    q = parseQuery(query);
  } catch {
    q = undefined;
  }
  const head = Buffer.alloc(12);
  head.writeUInt16BE(query.length >= 2 ? query.readUInt16BE(0) : 0, 0);
  const rd = query.length >= 4 ? query.readUInt16BE(2) & FLAG_RD : 0;
  head.writeUInt16BE(FLAG_QR | FLAG_RA | rd | (rcode & 0xf), 2);
  head.writeUInt16BE(q ? 1 : 0, 4);
  return q ? Buffer.concat([head, query.subarray(12, q.end)]) : head;
}

/** Encodes a query (used by tests and the fake internet). */
export function encodeQuery(id: number, name: string, type: number): Buffer {
  const head = Buffer.alloc(12);
  head.writeUInt16BE(id, 0);
  head.writeUInt16BE(FLAG_RD, 2);
  head.writeUInt16BE(1, 4);
  const tail = Buffer.alloc(4);
  tail.writeUInt16BE(type, 0);
  tail.writeUInt16BE(CLASS_IN, 2);
  return Buffer.concat([head, encodeName(name), tail]);
}

export function encodeName(name: string): Buffer {
  const parts = name.replace(/\.$/, '').split('.').filter(Boolean);
  return Buffer.concat([
    ...parts.map((p) => Buffer.concat([Buffer.from([p.length]), Buffer.from(p, 'latin1')])),
    Buffer.from([0]),
  ]);
}

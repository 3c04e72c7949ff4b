/**
 * The little of RFC 1035 the platform resolver needs: read a query's single
 * question, read A/AAAA answers (and their TTLs) out of an upstream response,
 * and write refusals. Everything is bounds-checked: the input comes from the
 * sandbox.
 */

export const TYPE_A = 1;
export const TYPE_AAAA = 28;
export const RCODE_FORMERR = 1;
export const RCODE_SERVFAIL = 2;
export const RCODE_NXDOMAIN = 3;
export const RCODE_REFUSED = 5;

export interface DnsQuestion {
  id: number;
  flags: number;
  /** Lower-case, no trailing dot. */
  name: string;
  type: number;
  class: number;
  /** Byte offset just past the question (where the answer section would start). */
  end: number;
}

export interface DnsAddressRecord {
  name: string;
  family: 4 | 6;
  address: string;
  ttlSeconds: number;
}

export class DnsFormatError extends Error {}

/** Reads the header and the one question of a query; throws `DnsFormatError` on anything else. */
export function parseQuery(msg: Buffer): DnsQuestion {
  if (msg.length < 12) throw new DnsFormatError('short header');
  const flags = msg.readUInt16BE(2);
  if (flags & 0x8000) throw new DnsFormatError('not a query');
  if ((flags >> 11) & 0xf) throw new DnsFormatError('not a standard query');
  if (msg.readUInt16BE(4) !== 1) throw new DnsFormatError('exactly one question expected');
  const { name, end } = readName(msg, 12);
  if (end + 4 > msg.length) throw new DnsFormatError('truncated question');
  return {
    id: msg.readUInt16BE(0),
    flags,
    name,
    type: msg.readUInt16BE(end),
    class: msg.readUInt16BE(end + 2),
    end: end + 4,
  };
}

/** The A and AAAA records of a response's answer section. */
export function parseAnswers(msg: Buffer): {
  rcode: number;
  question: DnsQuestion;
  records: DnsAddressRecord[];
} {
  if (msg.length < 12) throw new DnsFormatError('short header');
  const flags = msg.readUInt16BE(2);
  if (!(flags & 0x8000)) throw new DnsFormatError('not a response');
  if (msg.readUInt16BE(4) !== 1) throw new DnsFormatError('exactly one question expected');
  const q = readName(msg, 12);
  if (q.end + 4 > msg.length) throw new DnsFormatError('truncated question');
  const question: DnsQuestion = {
    id: msg.readUInt16BE(0),
    flags,
    name: q.name,
    type: msg.readUInt16BE(q.end),
    class: msg.readUInt16BE(q.end + 2),
    end: q.end + 4,
  };
  const ancount = msg.readUInt16BE(6);
  const records: DnsAddressRecord[] = [];
  let off = question.end;
  for (let i = 0; i < ancount; i++) {
    const { name, end } = readName(msg, off);
    if (end + 10 > msg.length) throw new DnsFormatError('truncated record');
    const type = msg.readUInt16BE(end);
    const cls = msg.readUInt16BE(end + 2);
    const ttl = msg.readUInt32BE(end + 4);
    const rdlen = msg.readUInt16BE(end + 8);
    const rdata = end + 10;
    if (rdata + rdlen > msg.length) throw new DnsFormatError('truncated rdata');
    if (cls === 1 && type === TYPE_A && rdlen === 4) {
      records.push({
        name,
        family: 4,
        address: [...msg.subarray(rdata, rdata + 4)].join('.'),
        ttlSeconds: ttl,
      });
    } else if (cls === 1 && type === TYPE_AAAA && rdlen === 16) {
      const groups: string[] = [];
      for (let g = 0; g < 8; g++) groups.push(msg.readUInt16BE(rdata + 2 * g).toString(16));
      records.push({ name, family: 6, address: groups.join(':'), ttlSeconds: ttl });
    }
    off = rdata + rdlen;
  }
  return { rcode: flags & 0xf, question, records };
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
  const rd = query.length >= 4 ? query.readUInt16BE(2) & 0x0100 : 0;
  head.writeUInt16BE(0x8000 | 0x0080 | rd | (rcode & 0xf), 2);
  head.writeUInt16BE(q ? 1 : 0, 4);
  return q ? Buffer.concat([head, query.subarray(12, q.end)]) : head;
}

function readName(msg: Buffer, start: number): { name: string; end: number } {
  const labels: string[] = [];
  let off = start;
  let end = -1;
  let jumps = 0;
  let length = 0;
  for (;;) {
    if (off >= msg.length) throw new DnsFormatError('name runs past the message');
    const len = msg[off]!;
    if (len === 0) {
      if (end < 0) end = off + 1;
      break;
    }
    if ((len & 0xc0) === 0xc0) {
      if (off + 1 >= msg.length) throw new DnsFormatError('bad pointer');
      if (++jumps > 32) throw new DnsFormatError('pointer loop');
      if (end < 0) end = off + 2;
      off = ((len & 0x3f) << 8) | msg[off + 1]!;
      continue;
    }
    if (len & 0xc0) throw new DnsFormatError('bad label type');
    if (off + 1 + len > msg.length) throw new DnsFormatError('label runs past the message');
    length += len + 1;
    if (length > 255) throw new DnsFormatError('name too long');
    labels.push(
      msg
        .subarray(off + 1, off + 1 + len)
        .toString('latin1')
        .toLowerCase(),
    );
    off += 1 + len;
  }
  return { name: labels.join('.'), end };
}

/** Encodes a query (used by tests and the fake internet). */
export function encodeQuery(id: number, name: string, type: number): Buffer {
  const head = Buffer.alloc(12);
  head.writeUInt16BE(id, 0);
  head.writeUInt16BE(0x0100, 2);
  head.writeUInt16BE(1, 4);
  const tail = Buffer.alloc(4);
  tail.writeUInt16BE(type, 0);
  tail.writeUInt16BE(1, 2);
  return Buffer.concat([head, encodeName(name), tail]);
}

export function encodeName(name: string): Buffer {
  const parts = name.replace(/\.$/, '').split('.').filter(Boolean);
  return Buffer.concat([
    ...parts.map((p) => Buffer.concat([Buffer.from([p.length]), Buffer.from(p, 'latin1')])),
    Buffer.from([0]),
  ]);
}

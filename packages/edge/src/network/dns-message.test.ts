import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import fc from 'fast-check';
import {
  CLASS_IN,
  DnsFormatError,
  encodeMessage,
  encodeForwardQuery,
  encodeQuery,
  errorResponse,
  FLAG_QR,
  FLAG_RD,
  FLAG_TC,
  MAX_POINTER_JUMPS,
  nameKey,
  parseMessage,
  parseQuery,
  RCODE_NXDOMAIN,
  readName,
  TYPE_A,
  TYPE_AAAA,
  TYPE_CNAME,
  TYPE_OPT,
  type DnsMessage,
  type DnsName,
  type DnsRecord,
  type RdataPart,
} from './dns-message.js';

/** Throws whatever `f` throws unless it is a DnsFormatError; returns what it returned, or undefined. */
function onlyFormatErrors<T>(f: () => T): T | undefined {
  try {
    return f();
  } catch (err) {
    if (err instanceof DnsFormatError) return undefined;
    throw err;
  }
}

/**
 * What a parse holds on to: every decoded name and RDATA byte. A record takes
 * at least 11 bytes of input and decodes to at most a 255-byte owner, 10
 * bytes of fixed fields, its RDATA bytes and two more 255-byte names (SOA,
 * MINFO, RP, PX): at most 72 bytes per input byte.
 */
function decodedBytes(m: DnsMessage): number {
  const name = (n: DnsName) => n.reduce((s, l) => s + l.length + 1, 1);
  const part = (p: RdataPart) => (Buffer.isBuffer(p) ? p.length : name(p.name));
  const record = (r: DnsRecord) => name(r.name) + 10 + r.data.reduce((s, p) => s + part(p), 0);
  return (
    name(m.question.labels) +
    [...m.answers, ...m.authority, ...m.additional].reduce((s, r) => s + record(r), 0)
  );
}
const DECODED_BYTES_PER_INPUT_BYTE = 72;

const label = fc
  .uint8Array({ minLength: 1, maxLength: 63 })
  .map((b) => Buffer.from(b).toString('latin1'));
const hostLabel = fc.stringMatching(/^[a-zA-Z0-9-]{1,12}$/);
// Names from a small pool of labels, so suffixes repeat and compression is exercised.
const name = fc
  .array(fc.oneof(hostLabel, label, fc.constantFrom('Test', 'test', 'TEST', 'example')), {
    maxLength: 6,
  })
  .filter((n) => n.reduce((s, l) => s + l.length + 1, 1) <= 255);

const rdataFor = (type: number): fc.Arbitrary<RdataPart[]> => {
  switch (type) {
    case TYPE_A:
      return fc.uint8Array({ minLength: 4, maxLength: 4 }).map((b) => [Buffer.from(b)]);
    case TYPE_AAAA:
      return fc.uint8Array({ minLength: 16, maxLength: 16 }).map((b) => [Buffer.from(b)]);
    case TYPE_CNAME:
    case 2:
    case 12:
      return name.map((n) => [{ name: n }]);
    case 15:
      return fc
        .tuple(fc.uint8Array({ minLength: 2, maxLength: 2 }), name)
        .map(([p, n]) => [Buffer.from(p), { name: n }]);
    case 6:
      return fc
        .tuple(name, name, fc.uint8Array({ minLength: 20, maxLength: 20 }))
        .map(([a, b, t]) => [{ name: a }, { name: b }, Buffer.from(t)]);
    case 33:
      return fc
        .tuple(fc.uint8Array({ minLength: 6, maxLength: 6 }), name)
        .map(([p, n]) => [Buffer.from(p), { name: n }]);
    case 65:
      return fc
        .tuple(
          fc.uint8Array({ minLength: 2, maxLength: 2 }),
          name,
          fc.uint8Array({ maxLength: 40 }),
        )
        .map(([p, n, rest]) => [Buffer.from(p), { name: n }, Buffer.from(rest)]);
    default:
      return fc.uint8Array({ maxLength: 40 }).map((b) => [Buffer.from(b)]);
  }
};
const record: fc.Arbitrary<DnsRecord> = fc
  .constantFrom(TYPE_A, TYPE_AAAA, TYPE_CNAME, 2, 6, 12, 15, 16, 33, 65, 99)
  .chain((type) =>
    fc.record({
      name,
      type: fc.constant(type),
      class: fc.constant(CLASS_IN),
      ttl: fc.nat(),
      data: rdataFor(type),
    }),
  );
const message: fc.Arbitrary<DnsMessage> = fc.record({
  id: fc.integer({ min: 0, max: 0xffff }),
  flags: fc.integer({ min: 0, max: 0xffff }).map((f) => (f | FLAG_QR) & ~FLAG_TC),
  question: fc.record({
    labels: name,
    type: fc.integer({ min: 0, max: 0xffff }),
    class: fc.constant(CLASS_IN),
  }),
  answers: fc.array(record, { maxLength: 6 }),
  authority: fc.array(record, { maxLength: 3 }),
  additional: fc.array(record, { maxLength: 3 }),
});

/** The same message with names compared as DNS compares them (the encoder may reuse another case). */
function canonical(m: DnsMessage): unknown {
  const rec = (r: DnsRecord) => ({
    ...r,
    name: nameKey(r.name),
    data: r.data.map((p) => (Buffer.isBuffer(p) ? p.toString('hex') : nameKey(p.name))),
  });
  return {
    ...m,
    question: { ...m.question, labels: nameKey(m.question.labels) },
    answers: m.answers.map(rec),
    authority: m.authority.map(rec),
    additional: m.additional.map(rec),
  };
}

describe('dns messages', () => {
  it('parses a query and answers NXDOMAIN with the question echoed', () => {
    const q = encodeQuery(0x1234, 'Pypi.org', TYPE_A);
    const parsed = parseQuery(q);
    assert.equal(parsed.name, 'pypi.org');
    assert.deepEqual(parsed.labels, ['Pypi', 'org']);
    const r = errorResponse(q, RCODE_NXDOMAIN);
    assert.equal(r.readUInt16BE(0), 0x1234);
    assert.equal(r.readUInt16BE(2) & 0xf, RCODE_NXDOMAIN);
    assert.deepEqual(parseMessage(r).question.labels, ['Pypi', 'org']);
  });

  it('refuses malformed input without throwing anything but DnsFormatError', () => {
    for (const bad of [
      Buffer.alloc(3),
      Buffer.from('000001000001000000000000c00c', 'hex'),
      Buffer.alloc(12, 0xff),
    ]) {
      assert.throws(() => parseQuery(bad), DnsFormatError);
    }
  });

  it('lower-cases ASCII only: other bytes of a label are kept as they are', () => {
    const q = parseQuery(encodeQuery(1, '\u00c0B.Test', TYPE_A));
    assert.equal(q.name, '\u00c0b.test');
    assert.deepEqual(q.labels, ['\u00c0B', 'Test']);
    // A dot inside a label is not a label boundary for the comparison key.
    assert.notEqual(nameKey(['a.b', 'c']), nameKey(['a', 'b', 'c']));
    assert.equal(nameKey(['A', 'b']), nameKey(['a', 'B']));
  });

  it('refuses compression pointers that point forwards or at themselves, and pointer chains', () => {
    // A name at 12 that is a pointer to itself, then one to a later offset.
    for (const target of [12, 14, 0x3fff]) {
      const msg = Buffer.alloc(20);
      msg.writeUInt16BE(0xc000 | target, 12);
      assert.throws(() => readName(msg, 12), DnsFormatError);
    }
    // A backwards chain longer than MAX_POINTER_JUMPS: each pointer points to the one before.
    const chain = Buffer.alloc(2 + 2 * (MAX_POINTER_JUMPS + 2));
    chain[0] = 0;
    for (let i = 1; i <= MAX_POINTER_JUMPS + 1; i++)
      chain.writeUInt16BE(0xc000 | (i === 1 ? 0 : 2 * (i - 1)), 2 * i);
    assert.throws(() => readName(chain, 2 * (MAX_POINTER_JUMPS + 1)), DnsFormatError);
    assert.deepEqual(readName(chain, 2 * MAX_POINTER_JUMPS).labels, []);
  });

  it('refuses names over 255 bytes, however they are assembled', () => {
    const long = Buffer.concat([
      ...Array.from({ length: 5 }, () =>
        Buffer.concat([Buffer.from([63]), Buffer.alloc(63, 0x61)]),
      ),
      Buffer.from([0]),
    ]);
    assert.throws(() => readName(long, 0), DnsFormatError);
  });

  it('writes messages that read back the same, within the payload size, OPT kept when truncating', () => {
    fc.assert(
      fc.property(message, (m) => {
        const wire = encodeMessage(m);
        const back = parseMessage(wire);
        assert.deepEqual(canonical(back), canonical(m));
      }),
      { numRuns: 400 },
    );
    const opt: DnsRecord = { name: [], type: TYPE_OPT, class: 1232, ttl: 0, data: [] };
    fc.assert(
      fc.property(message, fc.integer({ min: 12, max: 700 }), (m, maxBytes) => {
        const wire = encodeMessage({ ...m, additional: [...m.additional, opt] }, maxBytes);
        const back = parseMessage(wire);
        const minimal = encodeMessage({ ...m, answers: [], authority: [], additional: [opt] });
        assert.ok(
          wire.length <= Math.max(maxBytes, minimal.length),
          `${wire.length} > ${maxBytes}`,
        );
        assert.equal(back.additional.at(-1)?.type, TYPE_OPT);
        const all = m.answers.length + m.authority.length + m.additional.length + 1;
        const kept = back.answers.length + back.authority.length + back.additional.length;
        assert.equal((back.flags & FLAG_TC) !== 0, kept < all);
      }),
      { numRuns: 300 },
    );
  });

  it('parses arbitrary bytes and mutated messages with DnsFormatError at worst, within a memory bound', () => {
    const check = (bytes: Buffer) => {
      const m = onlyFormatErrors(() => parseMessage(bytes));
      if (m) assert.ok(decodedBytes(m) <= DECODED_BYTES_PER_INPUT_BYTE * bytes.length);
      onlyFormatErrors(() => parseQuery(bytes));
      onlyFormatErrors(() => errorResponse(bytes, RCODE_NXDOMAIN));
    };
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 600 }), (b) => check(Buffer.from(b))),
      { numRuns: 2000 },
    );
    // Valid messages, then broken: bytes changed, cut short, counts made huge,
    // compression pointers written anywhere (at themselves, forwards, past the end).
    const mutation = fc.oneof(
      fc.record({ kind: fc.constant('byte' as const), at: fc.nat(), value: fc.nat(255) }),
      fc.record({ kind: fc.constant('cut' as const), at: fc.nat() }),
      fc.record({
        kind: fc.constant('count' as const),
        section: fc.nat(3),
        value: fc.constantFrom(0, 1, 0x7fff, 0xffff),
      }),
      fc.record({ kind: fc.constant('pointer' as const), at: fc.nat(), target: fc.nat(0x3fff) }),
    );
    fc.assert(
      fc.property(message, fc.array(mutation, { minLength: 1, maxLength: 6 }), (m, mutations) => {
        let b = Buffer.from(encodeMessage(m));
        for (const mu of mutations) {
          if (b.length === 0) break;
          const at = 'at' in mu ? mu.at % b.length : 0;
          if (mu.kind === 'byte') b[at] = mu.value;
          else if (mu.kind === 'cut') b = b.subarray(0, at);
          else if (mu.kind === 'count' && b.length >= 12)
            b.writeUInt16BE(mu.value, 4 + 2 * mu.section);
          else if (mu.kind === 'pointer' && at + 1 < b.length)
            b.writeUInt16BE(0xc000 | mu.target, at);
        }
        check(b);
      }),
      { numRuns: 2000 },
    );
  });

  it('keeps a worst-case message (every name a pointer to a 255-byte name) within the bound', () => {
    // A maximal name at the question, then as many A records as fit, each owner a pointer to it.
    const labels = [...Array.from({ length: 3 }, () => 'a'.repeat(63)), 'b'.repeat(61)];
    const head = Buffer.alloc(12);
    head.writeUInt16BE(FLAG_QR, 2);
    head.writeUInt16BE(1, 4);
    const question = Buffer.concat([
      ...labels.map((l) => Buffer.concat([Buffer.from([l.length]), Buffer.from(l)])),
      Buffer.from([0, 0, 1, 0, 1]),
    ]);
    const rr = Buffer.from('c00c000100010000003c00040a000001', 'hex');
    const count = Math.floor((0xffff - 12 - question.length) / rr.length);
    head.writeUInt16BE(count, 6);
    const msg = Buffer.concat([head, question, ...Array.from({ length: count }, () => rr)]);
    const m = parseMessage(msg);
    assert.equal(m.answers.length, count);
    assert.ok(decodedBytes(m) <= DECODED_BYTES_PER_INPUT_BYTE * msg.length);
    // Written back with compression, it is no bigger than it came.
    assert.ok(encodeMessage(m).length <= msg.length);
  });

  it('rejects records whose RDATA does not fit their type', () => {
    const base = parseQuery(encodeQuery(7, 'x.test', TYPE_A));
    const answer = (type: number, data: Buffer) =>
      encodeMessage({
        id: 7,
        flags: FLAG_QR,
        question: { labels: base.labels, type: TYPE_A, class: CLASS_IN },
        answers: [{ name: base.labels, type, class: CLASS_IN, ttl: 60, data: [data] }],
        authority: [],
        additional: [],
      });
    // A CNAME whose name runs past its RDATA, an MX with one byte, an SOA short of its 20 bytes.
    assert.throws(
      () => parseMessage(answer(TYPE_CNAME, Buffer.from([3, 0x61, 0x62]))),
      DnsFormatError,
    );
    assert.throws(() => parseMessage(answer(15, Buffer.from([0]))), DnsFormatError);
    assert.throws(() => parseMessage(answer(6, Buffer.from([0, 0, 1, 2]))), DnsFormatError);
    // A CNAME with bytes after its name.
    assert.throws(() => parseMessage(answer(TYPE_CNAME, Buffer.from([0, 9]))), DnsFormatError);
  });

  it('forwards a query written afresh: its question, RD/CD, EDNS size and DO bit only', () => {
    // A query with an OPT record (payload 65000, DO, an option) and trailing junk.
    const q = encodeQuery(0x4242, 'Files.PythonHosted.org', TYPE_AAAA);
    q.writeUInt16BE(1, 10);
    const opt = Buffer.from('000029fde8000080000006000a0002abcd', 'hex');
    const query = Buffer.concat([q, opt, Buffer.from('exfiltrated bytes')]);
    const parsed = parseQuery(query);
    assert.deepEqual(parsed.edns, { udpBytes: 65000, dnssecOk: true });
    const out = encodeForwardQuery(0x1111, parsed);
    assert.equal(out.readUInt16BE(0), 0x1111);
    assert.equal(out.readUInt16BE(2), FLAG_RD);
    assert.ok(!out.includes(Buffer.from('exfiltrated')));
    const back = parseMessage(Buffer.concat([Buffer.from([0, 0, 0x80, 0]), out.subarray(4)]));
    assert.deepEqual(back.question.labels, ['Files', 'PythonHosted', 'org']);
    assert.deepEqual(back.additional, [
      { name: [], type: TYPE_OPT, class: 4096, ttl: 0x8000, data: [Buffer.alloc(0)] },
    ]);
  });
});

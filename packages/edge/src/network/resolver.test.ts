import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import fc from 'fast-check';
import {
  CLASS_IN,
  DnsFormatError,
  encodeMessage,
  encodeQuery,
  FLAG_QR,
  FLAG_TC,
  formatAddress,
  nameKey,
  parseMessage,
  parseQuery,
  svcbHints,
  TYPE_A,
  TYPE_A6,
  TYPE_AAAA,
  TYPE_CNAME,
  TYPE_HTTPS,
  TYPE_OPT,
  TYPE_SVCB,
  TYPE_WKS,
  type DnsMessage,
  type DnsName,
  type DnsRecord,
} from './dns-message.js';
import { ipToBigInt, compilePolicy } from './policy.js';
import { encodeAnswer, screenAnswer } from './resolver.js';
import { classifyAddress, screenAddress } from './special-ranges.js';

const noRules = compilePolicy({ networkRules: {} }, {});
const screen = (a: string) => screenAddress(noRules, a);

function bytesOf(address: string): Buffer {
  const n = ipToBigInt(address);
  const v6 = address.includes(':');
  const b = Buffer.alloc(v6 ? 16 : 4);
  for (let i = 0; i < b.length; i++) b[b.length - 1 - i] = Number((n >> BigInt(8 * i)) & 0xffn);
  return b;
}
const rr = (name: DnsName, type: number, data: DnsRecord['data'], cls = CLASS_IN): DnsRecord => ({
  name,
  type,
  class: cls,
  ttl: 60,
  data,
});
const a = (name: DnsName, address: string, cls = CLASS_IN) =>
  rr(name, address.includes(':') ? TYPE_AAAA : TYPE_A, [bytesOf(address)], cls);
const cname = (name: DnsName, target: DnsName) => rr(name, TYPE_CNAME, [{ name: target }]);
/** An SVCB/HTTPS record with `alpn` and the given address hints. */
function https(name: DnsName, hints: string[]): DnsRecord {
  const params: Buffer[] = [Buffer.from('000100030268' + '32', 'hex')];
  for (const [key, size] of [
    [4, 4],
    [6, 16],
  ] as const) {
    const of = hints.filter((h) => bytesOf(h).length === size).map(bytesOf);
    if (of.length === 0) continue;
    const head = Buffer.alloc(4);
    head.writeUInt16BE(key, 0);
    head.writeUInt16BE(of.length * size, 2);
    params.push(head, ...of);
  }
  return rr(name, TYPE_HTTPS, [Buffer.from([0, 1]), { name: [] }, Buffer.concat(params)]);
}
const response = (
  q: DnsName,
  answers: DnsRecord[],
  extra: Partial<DnsMessage> = {},
): DnsMessage => ({
  id: 1,
  flags: FLAG_QR,
  question: { labels: q, type: TYPE_A, class: CLASS_IN },
  answers,
  authority: [],
  additional: [],
  ...extra,
});

/**
 * Every address a client could take from these bytes, read as the most
 * trusting stub does (musl: any A/AAAA-sized record of type A/AAAA in any
 * section, whatever its class or owner), plus SVCB/HTTPS hints.
 */
function addressesAClientCouldUse(wire: Buffer): string[] {
  const m = parseMessage(wire);
  const out: string[] = [];
  for (const r of [...m.answers, ...m.authority, ...m.additional]) {
    const d = r.data.length === 1 ? r.data[0] : undefined;
    if (
      Buffer.isBuffer(d) &&
      ((r.type === TYPE_A && d.length === 4) || (r.type === TYPE_AAAA && d.length === 16))
    )
      out.push(formatAddress(d));
    if (r.type === TYPE_HTTPS || r.type === TYPE_SVCB)
      out.push(...svcbHints(r).map((h) => h.address));
  }
  return out;
}

describe('screening answers (SECURITY.md L40)', () => {
  const q = ['Www', 'Allowed', 'TEST'];

  it('follows CNAME chains case-insensitively and drops private addresses at their end', () => {
    const m = response(q, [
      cname(['www', 'allowed', 'test'], ['CDN', 'Example', 'net']),
      cname(['cdn', 'EXAMPLE', 'net'], ['edge', 'example', 'net']),
      a(['EDGE', 'example', 'NET'], '93.184.216.34'),
      a(['edge', 'example', 'net'], '10.0.0.7'),
      a(['edge', 'example', 'net'], 'fd00::7'),
    ]);
    const s = screenAnswer(m, q, screen);
    assert.deepEqual(
      s.open.map((r) => [r.name, r.address]),
      [['edge.example.net', '93.184.216.34']],
    );
    assert.deepEqual(
      s.dropped.map((d) => [d.address, d.range]),
      [
        ['10.0.0.7', '10.0.0.0/8'],
        ['fd00::7', 'fc00::/7'],
      ],
    );
    assert.equal(s.message.answers.length, 3);
  });

  it('drops addresses off the chain, in other classes, in hints and of unvetted types', () => {
    const m = response(
      q,
      [
        a(q, '93.184.216.34'),
        // Owned by a name the question never led to (musl would use it).
        a(['metadata', 'internal'], '1.2.3.4'),
        // Class CHAOS, A-sized (musl reads it as an address).
        a(q, '10.0.0.1', 3),
        https(q, ['93.184.216.34', '192.168.1.1']),
        https(q, ['93.184.216.35', '2606:4700::1']),
        rr(q, TYPE_A6, [Buffer.alloc(17)]),
        rr(q, TYPE_WKS, [Buffer.alloc(5)]),
      ],
      {
        authority: [a(['ns', 'allowed', 'test'], '169.254.169.254')],
        additional: [
          a(['ns', 'allowed', 'test'], '8.8.4.4'),
          rr([], TYPE_OPT, [Buffer.alloc(0)], 1232),
          rr([], TYPE_OPT, [Buffer.alloc(0)], 1232),
        ],
      },
    );
    const s = screenAnswer(m, q, screen);
    assert.deepEqual(
      s.open.map((r) => r.address),
      ['93.184.216.34'],
    );
    assert.deepEqual(
      s.message.answers.map((r) => r.type),
      [TYPE_A, TYPE_HTTPS],
    );
    assert.deepEqual(s.message.authority, []);
    // Glue of a public address stays (not opened); one OPT stays.
    assert.deepEqual(
      s.message.additional.map((r) => r.type),
      [TYPE_A, TYPE_OPT],
    );
    assert.deepEqual(
      s.dropped.map((d) => d.why.split(':')[0]!.split(',')[0]),
      [
        "not on the question's CNAME chain",
        'class 3 in an IN answer',
        'address hint',
        'an address type the resolver does not vet',
        'an address type the resolver does not vet',
        'link-local (cloud metadata) (RFC 3927)',
        'OPT out of place',
      ],
    );
  });

  it('survives CNAME loops and refuses malformed address records', () => {
    const loop = response(q, [cname(q, ['b']), cname(['b'], q), a(['b'], '93.184.216.34')]);
    assert.equal(screenAnswer(loop, q, screen).open.length, 1);
    assert.throws(
      () => screenAnswer(response(q, [rr(q, TYPE_A, [Buffer.alloc(5)])]), q, screen),
      DnsFormatError,
    );
    const badHint = rr(q, TYPE_HTTPS, [
      Buffer.from([0, 1]),
      { name: [] },
      Buffer.from('00040003010203', 'hex'),
    ]);
    assert.throws(() => screenAnswer(response(q, [badHint]), q, screen), DnsFormatError);
  });

  it("writes the sandbox's answer with its ID and question, EDNS of its own, within its size", () => {
    const query = parseQuery(encodeQuery(0xbeef, 'wWw.AlLoWeD.test', TYPE_A));
    const many = Array.from({ length: 60 }, (_, i) => a(query.labels, `93.184.${i}.1`));
    const upstream = response(['www', 'allowed', 'test'], many, {
      additional: [rr([], TYPE_OPT, [Buffer.from('000a0008aaaaaaaaaaaaaaaa', 'hex')], 4096)],
    });
    upstream.additional[0]!.ttl = 0x01008000; // extended RCODE 1, version 0, DO
    // Without EDNS: at most 512 bytes, TC, no OPT.
    const classic = encodeAnswer(query, upstream);
    assert.ok(classic.length <= 512);
    const back = parseMessage(classic);
    assert.equal(back.id, 0xbeef);
    assert.ok(back.flags & FLAG_TC);
    assert.deepEqual(back.question.labels, ['wWw', 'AlLoWeD', 'test']);
    assert.deepEqual(back.additional, []);
    // With EDNS: its size, and an OPT of ours (no upstream options; its extended RCODE and DO).
    const edns = encodeAnswer({ ...query, edns: { udpBytes: 1232, dnssecOk: true } }, upstream);
    const e = parseMessage(edns);
    assert.equal(e.answers.length, 60);
    assert.deepEqual(
      e.additional,
      [rr([], TYPE_OPT, [Buffer.alloc(0)], 4096)].map((r) => ({ ...r, ttl: 0x01008000 })),
    );
  });

  it('lets no special-use address reach a client, whatever the answer holds', () => {
    const names: DnsName[] = [
      ['www', 'allowed', 'test'],
      ['WWW', 'Allowed', 'test'],
      ['cdn', 'example', 'net'],
      ['edge', 'example', 'net'],
      ['metadata', 'google', 'internal'],
      ['www.allowed', 'test'],
      [],
    ];
    const addresses = [
      '93.184.216.34',
      '2606:4700::1111',
      '10.1.2.3',
      '172.16.0.1',
      '192.168.1.1',
      '100.64.0.1',
      '198.18.0.1',
      '192.0.0.1',
      '0.0.0.0',
      '127.0.0.1',
      '169.254.169.254',
      '224.0.0.1',
      '255.255.255.255',
      '192.0.2.1',
      'fd00::1',
      'fe80::1',
      '::',
      '::1',
      '::ffff:10.0.0.1',
      '::ffff:93.184.216.34',
      '64:ff9b::a00:1',
      '64:ff9b:1::1',
      '2002:a00:1::1',
      '2002:5db8:d822::1',
      '2001:db8::1',
      'ff02::1',
    ];
    const name = fc.constantFrom(...names);
    const address = fc.constantFrom(...addresses);
    const record: fc.Arbitrary<DnsRecord> = fc.oneof(
      fc
        .tuple(name, address, fc.constantFrom(CLASS_IN, CLASS_IN, 3, 255))
        .map(([n, ad, c]) => a(n, ad, c)),
      fc.tuple(name, name).map(([n, t]) => cname(n, t)),
      fc.tuple(name, fc.array(address, { maxLength: 3 })).map(([n, h]) => https(n, h)),
      name.map((n) => rr(n, TYPE_A6, [Buffer.alloc(17)])),
    );
    const sectioned = fc.record({
      answers: fc.array(record, { maxLength: 10 }),
      authority: fc.array(record, { maxLength: 3 }),
      additional: fc.array(record, { maxLength: 3 }),
    });
    fc.assert(
      fc.property(name, sectioned, fc.boolean(), (qn, sections, edns) => {
        const question = parseQuery(encodeQuery(9, qn.join('.') || 'x', TYPE_A));
        const m = response(question.labels, sections.answers, sections);
        const s = screenAnswer(m, question.labels, screen);
        const wire = encodeAnswer(
          edns ? { ...question, edns: { udpBytes: 4096, dnssecOk: false } } : question,
          s.message,
        );
        for (const used of addressesAClientCouldUse(wire))
          assert.equal(classifyAddress(used), undefined, `${used} reached the client`);
        const back = parseMessage(wire);
        for (const r of [...back.answers, ...back.authority, ...back.additional])
          assert.ok(r.class === CLASS_IN || r.type === TYPE_OPT, `class ${r.class}`);
        for (const o of s.open) assert.equal(classifyAddress(o.address), undefined);
        // Nothing public on the chain is lost: each such answer is opened.
        const chain = new Set([nameKey(question.labels)]);
        for (let grew = true; grew;) {
          grew = false;
          for (const r of m.answers) {
            const t = r.data[0];
            if (
              r.type === TYPE_CNAME &&
              r.class === CLASS_IN &&
              t &&
              !Buffer.isBuffer(t) &&
              chain.has(nameKey(r.name)) &&
              !chain.has(nameKey(t.name))
            ) {
              chain.add(nameKey(t.name));
              grew = true;
            }
          }
        }
        const expected = m.answers.filter((r) => {
          const d = r.data[0];
          return (
            (r.type === TYPE_A || r.type === TYPE_AAAA) &&
            r.class === CLASS_IN &&
            Buffer.isBuffer(d) &&
            chain.has(nameKey(r.name)) &&
            classifyAddress(formatAddress(d)) === undefined
          );
        });
        assert.equal(s.open.length, expected.length);
      }),
      { numRuns: 1500 },
    );
  });

  it('encodes what it kept so the sandbox reads exactly that', () => {
    const m = response(q, [
      cname(q, ['cdn', 'example', 'net']),
      a(['cdn', 'example', 'net'], '93.184.216.34'),
    ]);
    const wire = encodeMessage(m);
    assert.deepEqual(
      screenAnswer(parseMessage(wire), q, screen).open.map((r) => r.address),
      ['93.184.216.34'],
    );
  });
});

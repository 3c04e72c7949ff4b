/**
 * The platform resolver through its real sockets (SECURITY.md L40, issue 24
 * point 10(b)): a hostile upstream (the zone of an allowed name) and a
 * hostile client (the sandbox), both on loopback addresses this test picks.
 * Needs root: the resolver listens on port 53.
 */
import assert from 'node:assert/strict';
import { createSocket, type Socket } from 'node:dgram';
import { after, before, describe, it } from 'node:test';
import {
  CLASS_IN,
  encodeMessage,
  encodeQuery,
  FLAG_QR,
  FLAG_TC,
  formatAddress,
  parseMessage,
  parseQuery,
  RCODE_FORMERR,
  RCODE_NXDOMAIN,
  RCODE_SERVFAIL,
  TYPE_A,
  TYPE_AAAA,
  TYPE_CNAME,
  type DnsRecord,
} from '../../src/network/dns-message.js';
import { compilePolicy, matchDomain } from '../../src/network/policy.js';
import { PlatformResolver, type DroppedRecord } from '../../src/network/resolver.js';
import { classifyAddress, screenAddress } from '../../src/network/special-ranges.js';
import type { DnsAddressRecord } from '../../src/network/dns-message.js';

const root = process.getuid?.() === 0;

/** Loopback addresses of this process: 127.53.X.1 for the resolver, .2 for the "sandbox". */
const x = (process.pid % 250) + 1;
const listen = `127.53.${x}.1`;
const client = `127.53.${x}.2`;

describe(
  'platform resolver: hostile upstream and client (L40)',
  { skip: !root && 'needs root' },
  () => {
    let upstream: Socket;
    let upstreamPort = 0;
    /** What the hostile zone answers, by the question's first label. */
    const zone = new Map<
      string,
      (
        q: ReturnType<typeof parseQuery>,
        from: { address: string; port: number },
      ) => Buffer | undefined
    >();
    let resolver: PlatformResolver;
    let sock: Socket;
    const opened: DnsAddressRecord[] = [];
    const openedPorts: number[][] = [];
    const filtered: DroppedRecord[][] = [];
    const blocked: string[] = [];
    const basePolicy = compilePolicy(
      {
        networkRules: {},
        networkAllow: [{ domain: '*.allowed.test' }, { cidr: '10.77.0.0/16', ports: [5432] }],
      },
      {},
    );
    /** The sandbox's policy now (a live update replaces it, as `LinuxNetwork.update` does). */
    let policy = basePolicy;

    before(async () => {
      upstream = createSocket('udp4');
      upstream.on('message', (msg, rinfo) => {
        const q = parseQuery(msg);
        const answer = zone.get(q.labels[0]!.toLowerCase())?.(q, rinfo);
        if (answer) upstream.send(answer, rinfo.port, rinfo.address);
      });
      await new Promise<void>((r) => upstream.bind(0, '127.0.0.1', r));
      upstreamPort = upstream.address().port;
      resolver = new PlatformResolver({
        upstream: [{ address: '127.0.0.1', port: upstreamPort }],
        upstreamTimeoutMs: 500,
      });
      await resolver.attach('t', {
        listenAddress: listen,
        sourceAddresses: [client],
        decide: (name) => matchDomain(policy, name),
        screen: (a) => screenAddress(policy, a),
        allowAddresses: async (_name, ports, records) => {
          opened.push(...records);
          if (records.length > 0) openedPorts.push(ports);
          return true;
        },
        blocked: (name) => void blocked.push(name),
        filtered: (_name, _qtype, dropped) => void filtered.push(dropped),
      });
      sock = createSocket('udp4');
      await new Promise<void>((r) => sock.bind(0, client, r));
    });

    after(() => {
      resolver?.close();
      sock?.close();
      upstream?.close();
    });

    function ask(query: Buffer, timeoutMs = 2000): Promise<Buffer | undefined> {
      return new Promise((resolve) => {
        const timer = setTimeout(() => {
          sock.off('message', on);
          resolve(undefined);
        }, timeoutMs);
        const on = (msg: Buffer) => {
          clearTimeout(timer);
          sock.off('message', on);
          resolve(msg);
        };
        sock.on('message', on);
        sock.send(query, 53, listen);
      });
    }

    const rr = (name: string[], type: number, data: DnsRecord['data'], cls = CLASS_IN) =>
      ({ name, type, class: cls, ttl: 300, data }) satisfies DnsRecord;
    const v4 = (a: string) => Buffer.from(a.split('.').map(Number));
    const reply = (
      q: ReturnType<typeof parseQuery>,
      answers: DnsRecord[],
      extra: DnsRecord[] = [],
    ) =>
      encodeMessage({
        id: q.id,
        flags: FLAG_QR | 0x0180,
        question: { labels: q.labels, type: q.type, class: q.class },
        answers,
        authority: [],
        additional: extra,
      });

    it('hands the client only the public addresses of the chain, whatever upstream smuggles', async () => {
      zone.set('www', (q) =>
        reply(
          q,
          [
            rr(q.labels, TYPE_CNAME, [{ name: ['Edge', 'CDN', 'example'] }]),
            rr(['edge', 'cdn', 'EXAMPLE'], TYPE_A, [v4('93.184.216.34')]),
            rr(['edge', 'cdn', 'example'], TYPE_A, [v4('10.0.0.5')]),
            rr(['edge', 'cdn', 'example'], TYPE_A, [v4('169.254.169.254')]),
            rr(['metadata'], TYPE_A, [v4('93.184.216.35')]),
            rr(q.labels, TYPE_A, [v4('192.168.0.1')], 3),
            rr(['edge', 'cdn', 'example'], TYPE_A, [v4('10.77.1.2')]),
            rr(['edge', 'cdn', 'example'], TYPE_AAAA, [
              Buffer.from('fd000000000000000000000000000001', 'hex'),
            ]),
          ],
          [rr(['ns'], TYPE_A, [v4('127.0.0.1')])],
        ),
      );
      opened.length = 0;
      filtered.length = 0;
      const query = encodeQuery(0x7777, 'WwW.Allowed.TEST', TYPE_A);
      const got = await ask(query);
      assert.ok(got);
      const m = parseMessage(got);
      assert.equal(m.id, 0x7777);
      assert.deepEqual(m.question.labels, ['WwW', 'Allowed', 'TEST']);
      const seen = [...m.answers, ...m.authority, ...m.additional]
        .filter((r) => r.type === TYPE_A || r.type === TYPE_AAAA)
        .map((r) => formatAddress(r.data[0] as Buffer));
      // The public one, and the private one a CIDR rule covers (released, not opened).
      assert.deepEqual(seen, ['93.184.216.34', '10.77.1.2']);
      assert.ok(seen.every((a) => !classifyAddress(a) || a.startsWith('10.77.')));
      assert.deepEqual(
        opened.map((r) => r.address),
        ['93.184.216.34'],
      );
      assert.equal(filtered.length, 1);
      assert.deepEqual(
        filtered[0]!.map((d) => d.address),
        ['10.0.0.5', '169.254.169.254', '93.184.216.35', undefined, 'fd00::1', '127.0.0.1'],
      );
    });

    it('refuses what it cannot parse, and names that read two ways', async () => {
      // Upstream sends a malformed A record, a compression loop, a truncated message.
      zone.set('bad', (q) => reply(q, [rr(q.labels, TYPE_A, [Buffer.alloc(5)])]));
      zone.set('loop', (q) => {
        const r = reply(q, [rr(q.labels, TYPE_A, [v4('93.184.216.34')])]);
        // The answer's owner (a pointer to the question) made a pointer to itself.
        r.writeUInt16BE(0xc000 | q.end, q.end);
        return r;
      });
      zone.set('cut', (q) =>
        reply(q, [rr(q.labels, TYPE_A, [v4('93.184.216.34')])]).subarray(0, q.end + 5),
      );
      for (const name of ['bad.allowed.test', 'loop.allowed.test', 'cut.allowed.test']) {
        const got = await ask(encodeQuery(1, name, TYPE_A));
        assert.ok(got, name);
        assert.equal(got.readUInt16BE(2) & 0xf, RCODE_SERVFAIL, name);
      }
      // A label with a dot in it: "x" under a TLD "allowed.test" to upstream, x.allowed.test to the policy.
      blocked.length = 0;
      const dotted = Buffer.concat([
        encodeQuery(2, 'x', TYPE_A).subarray(0, 12),
        Buffer.from([1, 0x78, 12]),
        Buffer.from('allowed.test'),
        Buffer.from([0, 0, 1, 0, 1]),
      ]);
      const got = await ask(dotted);
      assert.ok(got);
      assert.equal(got.readUInt16BE(2) & 0xf, RCODE_NXDOMAIN);
      assert.deepEqual(blocked, ['x.allowed.test']);
      // Garbage from the client: FORMERR, and the resolver still serves.
      const junk = await ask(Buffer.from('this is not a dns query at all'));
      assert.ok(junk);
      assert.equal(junk.readUInt16BE(2) & 0xf, RCODE_FORMERR);
      zone.set('ok', (q) => reply(q, [rr(q.labels, TYPE_A, [v4('93.184.216.34')])]));
      const ok = await ask(encodeQuery(3, 'ok.allowed.test', TYPE_A));
      assert.equal(ok && parseMessage(ok).answers.length, 1);
    });

    it('opens nothing for a name whose rule was removed while its query was in flight', async () => {
      // The zone holds its answer until the test lets it go (an authoritative
      // server the sandbox's owner controls answers as late as it likes).
      const hold = () => {
        let release!: () => void;
        const asked = new Promise<void>((resolve) => {
          zone.set('held', (q, to) => {
            release = () =>
              upstream.send(
                reply(q, [rr(q.labels, TYPE_A, [v4('93.184.216.40')])]),
                to.port,
                to.address,
              );
            resolve();
            return undefined;
          });
        });
        return { asked, release: () => release() };
      };
      opened.length = 0;
      openedPorts.length = 0;
      blocked.length = 0;
      try {
        let h = hold();
        let answer = ask(encodeQuery(5, 'held.allowed.test', TYPE_A), 3000);
        await h.asked;
        // The rule goes while upstream still has the question.
        policy = compilePolicy({ networkRules: {}, networkAllow: [] }, {});
        h.release();
        let got = await answer;
        assert.ok(got);
        assert.equal(got.readUInt16BE(2) & 0xf, RCODE_NXDOMAIN);
        assert.deepEqual(parseMessage(got).answers, []);
        assert.equal(opened.length, 0);
        assert.deepEqual(blocked, ['held.allowed.test']);
        // A rule whose ports change meanwhile: the answer opens the ports of the rule it meets.
        policy = compilePolicy(
          { networkRules: {}, networkAllow: [{ domain: 'held.allowed.test', ports: [443] }] },
          {},
        );
        h = hold();
        answer = ask(encodeQuery(6, 'held.allowed.test', TYPE_A), 3000);
        await h.asked;
        policy = compilePolicy(
          { networkRules: {}, networkAllow: [{ domain: 'held.allowed.test', ports: [8443] }] },
          {},
        );
        h.release();
        got = await answer;
        assert.ok(got);
        assert.deepEqual(
          opened.map((r) => r.address),
          ['93.184.216.40'],
        );
        assert.deepEqual(openedPorts, [[8443]]);
      } finally {
        policy = basePolicy;
        zone.delete('held');
      }
    });

    it('keeps to the payload size the client offered', async () => {
      zone.set('big', (q) =>
        reply(
          q,
          Array.from({ length: 200 }, (_, i) => rr(q.labels, TYPE_A, [v4(`93.184.${i}.1`)])),
        ),
      );
      const got = await ask(encodeQuery(4, 'big.allowed.test', TYPE_A));
      assert.ok(got && got.length <= 512);
      assert.ok(got.readUInt16BE(2) & FLAG_TC);
    });
  },
);

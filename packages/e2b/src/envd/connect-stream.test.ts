import { test } from 'node:test';
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import net from 'node:net';
import { create, toBinary } from '@bufbuild/protobuf';
import {
  Code,
  ConnectError,
  createClient,
  createContextKey,
  createContextValues,
} from '@connectrpc/connect';
import type { HandlerContext, ServiceImpl } from '@connectrpc/connect';
import { connectNodeAdapter, createConnectTransport } from '@connectrpc/connect-node';
import { Process, StartRequestSchema } from '../gen/process/process_pb.js';
import { ConnectStreamServer, envelope, EnvelopeWriter, singleMessage } from './connect-stream.js';

/**
 * The lean server-streaming path must answer every request it takes with
 * what Connect's own adapter answers: each case below goes to both, and the
 * status, content type, headers and decoded envelopes must be equal.
 */

const valueKey = createContextKey<string>('none');
const READ_MAX = 4096;

/** A Process service whose `start` follows the command line's script (`cmd`). */
function scriptedProcess(seen: { ctx?: HandlerContext; finished?: boolean }[] = []) {
  return {
    async *start(req, ctx) {
      const entry: { ctx?: HandlerContext; finished?: boolean } = { ctx };
      seen.push(entry);
      try {
        const script = req.process?.cmd ?? '';
        if (script === 'fail-first') throw new ConnectError('no such sandbox', Code.Unavailable);
        if (script === 'crash-later') {
          yield { event: { event: { case: 'start', value: { pid: 1 } } } };
          throw new Error('secret detail');
        }
        if (script === 'headers') {
          ctx.responseHeader.set('x-envd', 'yes');
          ctx.responseTrailer.set('x-trailer', 'done');
        }
        if (script === 'wait-abort') {
          yield { event: { event: { case: 'start', value: { pid: 2 } } } };
          await new Promise((resolve) => ctx.signal.addEventListener('abort', resolve));
          throw ctx.signal.reason;
        }
        if (script === 'two-turns') {
          yield { event: { event: { case: 'start', value: { pid: 3 } } } };
          await new Promise((resolve) => setImmediate(resolve));
          yield {
            event: { event: { case: 'end', value: { exited: true, status: 'exit status 0' } } },
          };
          return;
        }
        if (script === 'context') {
          yield {
            event: {
              event: {
                case: 'data',
                value: {
                  output: {
                    case: 'stdout',
                    value: Buffer.from(
                      `${ctx.values.get(valueKey)} ${ctx.requestHeader.get('x-test')} ${ctx.timeoutMs() !== undefined}`,
                    ),
                  },
                },
              },
            },
          };
        }
        yield { event: { event: { case: 'start', value: { pid: 7 } } } };
        yield {
          event: {
            event: {
              case: 'data',
              value: { output: { case: 'stdout', value: Buffer.from('hi\n') } },
            },
          },
        };
        yield {
          event: {
            event: {
              case: 'data',
              value: { output: { case: 'stderr', value: Buffer.from([0, 255]) } },
            },
          },
        };
        yield {
          event: {
            event: { case: 'end', value: { exitCode: 3, exited: true, status: 'exit status 3' } },
          },
        };
      } finally {
        entry.finished = true;
      }
    },
  } satisfies Partial<ServiceImpl<typeof Process>>;
}

interface Servers {
  lean: string;
  adapter: string;
  taken: string[];
  seen: { ctx?: HandlerContext; finished?: boolean }[];
}

async function withServers(fn: (s: Servers) => Promise<void>): Promise<void> {
  const seen: Servers['seen'] = [];
  const impl = scriptedProcess(seen);
  const shutdown = new AbortController();
  const streams = new ConnectStreamServer({
    readMaxBytes: READ_MAX,
    shutdownSignal: shutdown.signal,
  }).add(Process, impl);
  const adapter = connectNodeAdapter({
    routes: (router) => router.service(Process, impl),
    readMaxBytes: READ_MAX,
    contextValues: () => createContextValues().set(valueKey, 'v'),
    shutdownSignal: shutdown.signal,
  });
  const taken: string[] = [];
  const lean = http.createServer((req, res) => {
    const path = (req.url ?? '/').split('?')[0]!;
    if (streams.serve(path, req, res, createContextValues().set(valueKey, 'v'))) taken.push(path);
    else adapter(req, res);
  });
  const plain = http.createServer(adapter);
  const listen = async (s: http.Server) => {
    await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
    return `http://127.0.0.1:${(s.address() as AddressInfo).port}`;
  };
  try {
    await fn({ lean: await listen(lean), adapter: await listen(plain), taken, seen });
  } finally {
    shutdown.abort();
    lean.closeAllConnections();
    plain.closeAllConnections();
    await new Promise((r) => lean.close(r));
    await new Promise((r) => plain.close(r));
  }
}

interface Answer {
  status: number;
  contentType: string | undefined;
  envd: string | undefined;
  envelopes: { flags: number; data: string }[];
}

async function post(
  base: string,
  body: Buffer,
  headers: Record<string, string> = {},
  path = '/process.Process/Start',
): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = http.request(`${base}${path}`, {
      method: 'POST',
      agent: false,
      headers: { 'content-type': 'application/connect+json', ...headers },
    });
    req.on('error', reject);
    req.on('response', (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('end', () => {
        const all = Buffer.concat(chunks);
        const envelopes: Answer['envelopes'] = [];
        for (let o = 0; o < all.length;) {
          const n = all.readUInt32BE(o + 1);
          envelopes.push({
            flags: all[o]!,
            data: all.subarray(o + 5, o + 5 + n).toString('base64'),
          });
          o += 5 + n;
        }
        resolve({
          status: res.statusCode ?? 0,
          contentType: res.headers['content-type'],
          envd: res.headers['x-envd'] as string | undefined,
          envelopes,
        });
      });
    });
    req.end(body);
  });
}

const json = (o: unknown) => envelope(0, Buffer.from(JSON.stringify(o)));
const startJson = (cmd: string) => json({ process: { cmd, args: ['-c', 'x'] }, stdin: false });

test('the lean path answers exactly as Connect’s adapter, for results, errors and protocol faults', async () => {
  await withServers(async ({ lean, adapter, taken }) => {
    const binary = Buffer.from(
      toBinary(
        StartRequestSchema,
        create(StartRequestSchema, { process: { cmd: 'run', args: ['a'] } }),
      ),
    );
    const cases: [string, Buffer, Record<string, string>?][] = [
      ['a stream of events', startJson('run')],
      ['a stream over two turns of the event loop', startJson('two-turns')],
      ['binary messages', envelope(0, binary), { 'content-type': 'application/connect+proto' }],
      ['an error before the first message', startJson('fail-first')],
      ['a non-Connect error after a message', startJson('crash-later')],
      ['headers and trailers the implementation sets', startJson('headers')],
      [
        'the context: values, request headers, deadline',
        startJson('context'),
        { 'x-test': 't', 'connect-timeout-ms': '60000' },
      ],
      ['no message', Buffer.alloc(0)],
      ['two messages', Buffer.concat([startJson('run'), startJson('run')])],
      [
        'an end-of-stream envelope after the message (skipped)',
        Buffer.concat([startJson('run'), envelope(2, Buffer.from('{}'))]),
      ],
      ['a truncated envelope', startJson('run').subarray(0, 20)],
      ['a compressed envelope without an encoding', envelope(1, Buffer.from('x'))],
      ['a message that is not JSON', envelope(0, Buffer.from('{nope'))],
      ['an unknown field (ignored, as there)', json({ process: { cmd: 'run' }, bogus: 1 })],
      ['a message over readMaxBytes', envelope(0, Buffer.alloc(READ_MAX + 1, 32))],
      ['a deadline that passes', startJson('wait-abort'), { 'connect-timeout-ms': '30' }],
    ];
    for (const [name, body, headers] of cases) {
      const want = await post(adapter, body, headers);
      const got = await post(lean, body, headers);
      assert.deepEqual(got, want, name);
    }
    assert.equal(taken.length, cases.length, 'every case above took the lean path');
  });
});

test('requests the lean path does not take go to the adapter untouched', async () => {
  await withServers(async ({ lean, adapter, taken }) => {
    const cases: [string, Buffer, Record<string, string>, string?][] = [
      ['gzip accepted', startJson('run'), { 'connect-accept-encoding': 'gzip' }],
      ['a compressed request', startJson('run'), { 'connect-content-encoding': 'gzip' }],
      ['a bad timeout', startJson('run'), { 'connect-timeout-ms': 'soon' }],
      ['a unary content type', startJson('run'), { 'content-type': 'application/json' }],
      ['gRPC', startJson('run'), { 'content-type': 'application/grpc' }],
      [
        'a unary method',
        Buffer.from('{}'),
        { 'content-type': 'application/json' },
        '/process.Process/List',
      ],
    ];
    for (const [name, body, headers, path] of cases) {
      const want = await post(adapter, body, headers, path);
      const got = await post(lean, body, headers, path);
      assert.deepEqual(got, want, name);
    }
    assert.deepEqual(taken, []);
  });
});

test('a Connect client reads the stream; messages ready together leave in one write', async () => {
  await withServers(async ({ lean }) => {
    const client = createClient(
      Process,
      createConnectTransport({ baseUrl: lean, httpVersion: '1.1' }),
    );
    const events = [];
    for await (const r of client.start({ process: { cmd: 'run' } })) events.push(r.event?.event);
    assert.deepEqual(
      events.map((e) => e?.case),
      ['start', 'data', 'data', 'end'],
    );
    await assert.rejects(
      (async () => {
        for await (const _ of client.start({ process: { cmd: 'fail-first' } })) void _;
      })(),
      (e) =>
        e instanceof ConnectError &&
        e.code === Code.Unavailable &&
        e.rawMessage === 'no such sandbox',
    );

    // On the wire: events ready together (all of them here) leave in one write, with a length.
    const once = await rawExchange(lean, startJson('run'));
    assert.match(once.head, /^HTTP\/1\.1 200 OK/);
    assert.match(once.head, /connection: keep-alive/i);
    assert.match(once.head, /content-length: \d+/i);
    assert.equal(countEnvelopes(once.body), 5);
    // A stream that spans turns of the event loop is chunked: the start, then the end with the end of the stream.
    const spread = await rawExchange(lean, startJson('two-turns'));
    assert.match(spread.head, /transfer-encoding: chunked/i);
    assert.deepEqual(spread.chunks.map(countEnvelopes), [1, 2]);
  });
});

function countEnvelopes(b: Buffer): number {
  let n = 0;
  for (let o = 0; o < b.length; o += 5 + b.readUInt32BE(o + 1)) n++;
  return n;
}

test('a client that goes away aborts the call’s signal; the implementation finishes', async () => {
  await withServers(async ({ lean, seen }) => {
    await new Promise<void>((resolve, reject) => {
      const req = http.request(`${lean}/process.Process/Start`, {
        method: 'POST',
        agent: false,
        headers: { 'content-type': 'application/connect+json' },
      });
      req.on('error', () => undefined);
      req.on('response', (res) => {
        res.once('data', () => {
          req.destroy();
          resolve();
        });
      });
      req.on('close', () => reject(new Error('closed before the first message')));
      req.end(startJson('wait-abort'));
    });
    const entry = seen.at(-1)!;
    await until(() => entry.finished === true);
    assert.equal(entry.ctx?.signal.aborted, true);
    assert.equal((entry.ctx?.signal.reason as ConnectError).code, Code.Canceled);
  });
});

test('the writer: one write per turn, the end in the last write, held while the socket is full', async () => {
  const res = new FakeResponse();
  const headers = new Headers({ 'content-type': 'application/connect+json' });
  const w = new EnvelopeWriter(res as unknown as http.ServerResponse, headers);
  assert.equal(w.message(Buffer.from('a')), undefined);
  assert.equal(w.message(Buffer.from('b')), undefined);
  await new Promise((r) => process.nextTick(r));
  assert.deepEqual(res.calls, [
    ['writeHead', 200, { 'content-type': 'application/connect+json' }],
    ['write', 12],
  ]);

  res.full = true;
  assert.equal(w.message(Buffer.from('c')), undefined);
  await new Promise((r) => process.nextTick(r));
  const held = w.message(Buffer.from('d'));
  assert.ok(held instanceof Promise, 'the producer waits for the socket');
  let released = false;
  void held.then(() => (released = true));
  await new Promise((r) => setImmediate(r));
  assert.equal(released, false);
  res.full = false;
  res.emit('drain');
  await held;
  w.end(Buffer.from('{}'));
  await new Promise((r) => process.nextTick(r));
  // c, then d (written, but its producer held until the drain), then the end alone.
  assert.deepEqual(res.calls.slice(2), [
    ['write', 6],
    ['write', 6],
    ['end', 7],
  ]);

  // A connection that closed: nothing more is written and a held producer goes on.
  const gone = new FakeResponse();
  const w2 = new EnvelopeWriter(gone as unknown as http.ServerResponse, headers);
  gone.full = true;
  assert.equal(w2.message(Buffer.from('x')), undefined);
  await new Promise((r) => process.nextTick(r));
  const waiting = w2.message(Buffer.from('y'));
  w2.closed();
  await waiting;
  w2.end(Buffer.from('{}'));
  await new Promise((r) => process.nextTick(r));
  assert.deepEqual(
    gone.calls.map((c) => c[0]),
    ['writeHead', 'write'],
  );
});

test('request envelopes: one message, with Connect’s errors for anything else', () => {
  const m = singleMessage(startJson('x'));
  assert.equal(JSON.parse(Buffer.from(m).toString()).process.cmd, 'x');
  const code = (body: Buffer, max?: number) => {
    try {
      singleMessage(body, max);
      return 'ok';
    } catch (e) {
      return Code[(e as ConnectError).code];
    }
  };
  assert.equal(code(Buffer.alloc(0)), 'Unimplemented');
  assert.equal(code(Buffer.concat([startJson('x'), startJson('y')])), 'Unimplemented');
  assert.equal(code(Buffer.from([0, 0, 0])), 'InvalidArgument');
  assert.equal(code(envelope(1, Buffer.from('x'))), 'Internal');
  assert.equal(code(envelope(0, Buffer.alloc(10)), 9), 'ResourceExhausted');
  assert.equal(code(Buffer.concat([envelope(2, Buffer.from('{}')), startJson('x')])), 'ok');
});

/** The raw HTTP/1.1 exchange of one request: the head, and the body's chunks (or whole body). */
function rawExchange(
  base: string,
  body: Buffer,
): Promise<{ head: string; body: Buffer; chunks: Buffer[] }> {
  const url = new URL(base);
  return new Promise((resolve, reject) => {
    const sock = net.connect(Number(url.port), url.hostname);
    let data = Buffer.alloc(0);
    sock.on('data', (d: Buffer) => {
      data = Buffer.concat([data, d]);
      const split = data.indexOf('\r\n\r\n');
      if (split < 0) return;
      const head = data.subarray(0, split).toString('latin1');
      let rest = data.subarray(split + 4);
      const length = /content-length: (\d+)/i.exec(head);
      if (length) {
        if (rest.length < Number(length[1])) return;
        sock.destroy();
        resolve({ head, body: rest, chunks: [rest] });
        return;
      }
      const chunks: Buffer[] = [];
      for (;;) {
        const eol = rest.indexOf('\r\n');
        if (eol < 0) return;
        const size = parseInt(rest.subarray(0, eol).toString(), 16);
        if (rest.length < eol + 2 + size + 2) return;
        if (size === 0) break;
        chunks.push(rest.subarray(eol + 2, eol + 2 + size));
        rest = rest.subarray(eol + 2 + size + 2);
      }
      sock.destroy();
      resolve({ head, body: Buffer.concat(chunks), chunks });
    });
    sock.on('error', reject);
    sock.write(
      `POST /process.Process/Start HTTP/1.1\r\nhost: x\r\ncontent-type: application/connect+json\r\n` +
        `content-length: ${body.length}\r\n\r\n`,
    );
    sock.write(body);
  });
}

class FakeResponse extends EventEmitter {
  calls: unknown[][] = [];
  headersSent = false;
  full = false;
  writeHead(status: number, headers: Record<string, string>) {
    this.headersSent = true;
    this.calls.push(['writeHead', status, headers]);
  }
  write(b: Buffer) {
    this.calls.push(['write', b.length]);
    return !this.full;
  }
  end(b: Buffer) {
    this.calls.push(['end', b.length]);
  }
}

async function until(cond: () => boolean): Promise<void> {
  while (!cond()) await new Promise((r) => setImmediate(r));
}

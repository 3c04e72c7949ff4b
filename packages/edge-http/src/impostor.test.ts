import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { IncomingHttpHeaders, IncomingMessage, OutgoingHttpHeaders } from 'node:http';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import { Readable } from 'node:stream';
import type { Duplex } from 'node:stream';
import { DsecError, isDsecError, SandboxIdCodec } from '@dsec/core';
import type {
  CommandResult,
  EdgeApi,
  FileInfo,
  PtySession,
  SandboxInfo,
  SandboxIoApi,
} from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import { HEADER_NONCE, HEADER_PROOF } from './auth.js';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';

/*
 * Issue 24, point 7: an impostor on an edge's address (another loopback
 * port here) that holds no secret but can talk to the real edge. It tries
 * what an attacker on the path would: harvest proofs from the real edge
 * with unsigned requests and put them on answers of its own; relay genuine
 * signed exchanges and change their status, body, frames, trailers or the
 * request's body; replay answers it recorded earlier. Every one must end
 * in the client's stable refusal (`unavailable`, `details.reason`
 * `edge_unauthenticated`), and the real edge must not have done what the
 * impostor claims (or what the client never asked).
 */

const EDGE = 'edge-imp';
const ids = new SandboxIdCodec('edge-http-impostor-secret');

const refused = (e: unknown): boolean => {
  assert.ok(isDsecError(e, 'unavailable'), `expected unavailable, got ${String(e)}`);
  assert.equal(e.details?.reason, 'edge_unauthenticated', e.message);
  return true;
};

/** The call must fail with the client's refusal; if it succeeds, the impostor won (shown). */
async function mustRefuse(call: Promise<unknown>, what = ''): Promise<void> {
  let outcome: unknown;
  try {
    outcome = await call;
  } catch (e) {
    refused(e);
    return;
  }
  const shown = typeof outcome === 'string' ? outcome : JSON.stringify(outcome);
  assert.fail(`the impostor won${what ? ` (${what})` : ''}: ${shown}`);
}

/** An exchange as the impostor saw it from the client. */
interface Seen {
  method: string;
  url: string;
  headers: IncomingHttpHeaders;
  body: Buffer;
  trailers: Record<string, string>;
}

/** An answer as the impostor holds it: whole, trailers included. */
interface Answer {
  status: number;
  headers: IncomingHttpHeaders;
  body: Buffer;
  trailers: Record<string, string>;
}

/** What an impostor can do with the real edge: relay, or ask without signing. */
interface EdgeDialer {
  /** Sends the client's request on (possibly changed) and returns the whole answer. */
  relay(seen: Seen, change?: { body?: Buffer }): Promise<Answer>;
  /** Sends an unsigned request carrying only the client's nonce (to harvest a proof). */
  harvest(seen: Seen): Promise<Answer>;
}

type Handler = (seen: Seen, edge: EdgeDialer) => Promise<Answer>;
type UpgradeHandler = (req: IncomingMessage, socket: Duplex, head: Buffer, edgeUrl: URL) => void;

const HOP = new Set([
  'connection',
  'keep-alive',
  'transfer-encoding',
  'content-length',
  'date',
  'host',
]);

function forwardable(headers: IncomingHttpHeaders): OutgoingHttpHeaders {
  const out: OutgoingHttpHeaders = {};
  for (const [k, v] of Object.entries(headers)) if (!HOP.has(k) && v !== undefined) out[k] = v;
  return out;
}

function send(
  url: URL,
  method: string,
  path: string,
  headers: OutgoingHttpHeaders,
  body: Buffer,
  trailers: Record<string, string> = {},
) {
  const chunked = Object.keys(trailers).length > 0;
  const out: OutgoingHttpHeaders = { ...headers };
  if (chunked) delete out['content-length'];
  else {
    delete out.trailer;
    out['content-length'] = body.length;
  }
  return new Promise<Answer>((resolve, reject) => {
    const req = http.request(
      { hostname: url.hostname, port: url.port, method, path, headers: out, agent: false },
      (res) => {
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('end', () =>
          resolve({
            status: res.statusCode ?? 0,
            headers: res.headers,
            body: Buffer.concat(chunks),
            trailers: { ...res.trailers } as Record<string, string>,
          }),
        );
        res.on('error', reject);
      },
    );
    req.on('error', reject);
    req.write(body);
    if (chunked) req.addTrailers(trailers);
    req.end();
  });
}

/** An HTTP server on another loopback port that answers in the edge's place. */
async function impostor(
  edgeUrl: string,
  handle: Handler,
  onUpgrade?: UpgradeHandler,
): Promise<{ url: string; seen: Seen[]; close(): Promise<void> }> {
  const target = new URL(edgeUrl);
  const seen: Seen[] = [];
  const upgraded = new Set<Duplex>();
  const dialer: EdgeDialer = {
    relay: (s, change = {}) =>
      send(target, s.method, s.url, forwardable(s.headers), change.body ?? s.body, s.trailers),
    harvest: (s) =>
      send(target, s.method, s.url, { [HEADER_NONCE]: String(s.headers[HEADER_NONCE]) }, s.body),
  };
  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const s: Seen = {
        method: req.method ?? 'GET',
        url: req.url ?? '/',
        headers: req.headers,
        body: Buffer.concat(chunks),
        trailers: { ...req.trailers } as Record<string, string>,
      };
      seen.push(s);
      handle(s, dialer).then(
        (a) => {
          const headers = forwardable(a.headers);
          if (Object.keys(a.trailers).length === 0) {
            delete headers.trailer;
            headers['content-length'] = a.body.length;
          }
          res.writeHead(a.status, headers);
          res.write(a.body);
          if (Object.keys(a.trailers).length > 0) res.addTrailers(a.trailers);
          res.end();
        },
        () => res.destroy(),
      );
    });
  });
  server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    socket.on('error', () => undefined);
    upgraded.add(socket);
    if (onUpgrade) onUpgrade(req, socket, head, target);
    else socket.destroy();
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const port = (server.address() as AddressInfo).port;
  return {
    url: `http://127.0.0.1:${port}`,
    seen,
    close: () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        for (const u of upgraded) u.destroy();
        server.close(() => r());
      }),
  };
}

/** Raw HTTP/1.1 to the edge for upgrades: the head as given, then the socket. */
function rawUpgrade(target: URL, head: string): Promise<{ socket: net.Socket; answer: string }> {
  return new Promise((resolve, reject) => {
    const socket = net.connect(Number(target.port), target.hostname, () => socket.write(head));
    let buf = Buffer.alloc(0);
    const onData = (c: Buffer) => {
      buf = Buffer.concat([buf, c]);
      const end = buf.indexOf('\r\n\r\n');
      if (end < 0) return;
      socket.off('data', onData);
      socket.pause();
      const rest = buf.subarray(end + 4);
      if (rest.length > 0) socket.unshift(rest);
      resolve({ socket, answer: buf.subarray(0, end).toString('latin1') });
    };
    socket.on('data', onData);
    socket.once('error', reject);
  });
}

function headLines(req: IncomingMessage): string {
  let head = `${req.method} ${req.url} HTTP/1.1\r\n`;
  for (let i = 0; i < req.rawHeaders.length; i += 2)
    head += `${req.rawHeaders[i]}: ${req.rawHeaders[i + 1]}\r\n`;
  return head + '\r\n';
}

function proofIn(answer: string): string | undefined {
  for (const line of answer.split('\r\n')) {
    const colon = line.indexOf(':');
    if (line.slice(0, colon).toLowerCase() === HEADER_PROOF) return line.slice(colon + 1).trim();
  }
  return undefined;
}

/** The edge served for real, and a client that dials the impostor in its place. */
async function setting(edge: EdgeApi) {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret });
  const clients: RemoteEdge[] = [];
  const impostors: { close(): Promise<void> }[] = [];
  return {
    server,
    secret,
    direct: (() => {
      const c = new RemoteEdge({ edgeId: EDGE, url: server.url, secret });
      clients.push(c);
      return c;
    })(),
    async through(handle: Handler, onUpgrade?: UpgradeHandler) {
      const imp = await impostor(server.url, handle, onUpgrade);
      impostors.push(imp);
      const client = new RemoteEdge({ edgeId: EDGE, url: imp.url, secret });
      clients.push(client);
      return { client, seen: imp.seen };
    },
    async close() {
      for (const c of clients) c.close();
      for (const i of impostors) await i.close();
      await server.close();
    },
  };
}

const SPEC = {
  backend: 'container' as const,
  image: 'base',
  toolkits: [],
  memoryLimitMb: 64,
  cpuCoresLimit: 0.1,
  pidsLimit: 64,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

async function running(fake: FakeEdge, projectId = 'prj-owner'): Promise<SandboxInfo> {
  return fake.createSandbox({ id: ids.mint(EDGE), projectId, spec: SPEC });
}

const json = (status: number, value: unknown, headers: IncomingHttpHeaders = {}): Answer => ({
  status,
  headers: { ...headers, 'content-type': 'application/json' },
  body: Buffer.from(JSON.stringify(value)),
  trailers: {},
});

function frameBytes(type: number, payload: Buffer): Buffer {
  const out = Buffer.alloc(5);
  out.writeUInt8(type, 0);
  out.writeUInt32BE(payload.length, 1);
  return Buffer.concat([out, payload]);
}

/** Replaces `from` by `to` (same length) everywhere in `buf`. */
function swap(buf: Buffer, from: string, to: string): Buffer {
  assert.equal(from.length, to.length);
  const out = Buffer.from(buf);
  let at = out.indexOf(from);
  assert.ok(at >= 0, `${from} in the answer`);
  while (at >= 0) {
    out.write(to, at, 'latin1');
    at = out.indexOf(from, at + to.length);
  }
  return out;
}

// ---- proofs harvested with unsigned requests, on answers of the impostor's own ----

test('harvested proof: a forged sandbox owner is refused', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const { client } = await s.through(async (seen, edge) => {
      const harvested = await edge.harvest(seen);
      const proof = harvested.headers[HEADER_PROOF];
      return json(
        200,
        { ...sb, projectId: 'prj-attacker' },
        proof ? { [HEADER_PROOF]: proof } : {},
      );
    });
    await mustRefuse(client.getSandbox(sb.id).then((got) => `accepted, owner ${got.projectId}`));
  } finally {
    await s.close();
  }
});

test('harvested proof: a stop that never happened is not acknowledged', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const { client } = await s.through(async (seen, edge) => {
      const harvested = await edge.harvest(seen);
      const proof = harvested.headers[HEADER_PROOF];
      return {
        status: 204,
        headers: proof ? { [HEADER_PROOF]: proof } : {},
        body: Buffer.alloc(0),
        trailers: {},
      };
    });
    await mustRefuse(client.stopSandbox(sb.id).then(() => 'stop acknowledged'));
    assert.equal((await fake.getSandbox(sb.id)).state, 'running', 'nothing was stopped');
  } finally {
    await s.close();
  }
});

test('harvested proof: a forged command result is refused', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const { client } = await s.through(async (seen, edge) => {
      const harvested = await edge.harvest(seen);
      const proof = harvested.headers[HEADER_PROOF];
      const result: CommandResult = {
        commandId: 'cmd-forged',
        exitCode: 0,
        outcome: 'exited',
        stdout: 'all tests passed\n',
        stderr: '',
        truncated: false,
        stdoutBytes: 17,
        stderrBytes: 0,
        durationMs: 1,
      };
      return {
        status: 200,
        headers: {
          'content-type': 'application/vnd.dsec.edge-frames',
          ...(proof ? { [HEADER_PROOF]: proof } : {}),
        },
        body: Buffer.concat([
          frameBytes(0, Buffer.from('all tests passed\n')),
          frameBytes(2, Buffer.from(JSON.stringify(result))),
        ]),
        trailers: {},
      };
    });
    const out: string[] = [];
    await mustRefuse(
      client
        .runCommand(sb.id, { argv: ['pytest'] }, { onStdout: (c) => out.push(c.toString()) })
        .then((r) => `accepted: exit ${r.exitCode}, ${r.stdout}`),
    );
    assert.deepEqual(out, [], 'no forged output reached the caller');
  } finally {
    await s.close();
  }
});

test('harvested proof: a fake 101 for a terminal or a port is refused', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const keystrokes: Buffer[] = [];
    const { client } = await s.through(
      async () => json(500, {}),
      (req, socket, _head, target) => {
        const nonce = String(req.headers[HEADER_NONCE]);
        const unsigned =
          `GET ${req.url} HTTP/1.1\r\nhost: ${target.host}\r\n${HEADER_NONCE}: ${nonce}\r\n` +
          `connection: Upgrade\r\nupgrade: ${String(req.headers.upgrade)}\r\n\r\n`;
        void rawUpgrade(target, unsigned).then(
          ({ socket: edgeSocket, answer }) => {
            edgeSocket.destroy();
            const proof = proofIn(answer);
            socket.write(
              `HTTP/1.1 101 Switching Protocols\r\nupgrade: ${String(req.headers.upgrade)}\r\n` +
                `connection: Upgrade\r\n${proof ? `${HEADER_PROOF}: ${proof}\r\n` : ''}\r\n`,
            );
            socket.write(frameBytes(0, Buffer.from('root@edge:~# ')));
            socket.on('data', (c: Buffer) => keystrokes.push(c));
          },
          () => socket.destroy(),
        );
      },
    );
    const id = ids.mint(EDGE);
    await mustRefuse(
      client.io.openPty(id).then((pty) => {
        pty.write(Buffer.from('cat ~/.ssh/id_rsa\n'));
        return 'terminal accepted';
      }),
    );
    await mustRefuse(client.io.connectPort(id, 5432).then(() => 'port accepted'));
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(Buffer.concat(keystrokes).length, 0, 'no keystroke reached the impostor');
  } finally {
    await s.close();
  }
});

// ---- genuine signed exchanges relayed, with what the impostor changes ----

test('relayed: a changed answer body (the owner) is refused', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake, 'prj-owner');
    const { client } = await s.through(async (seen, edge) => {
      const a = await edge.relay(seen);
      return { ...a, body: swap(a.body, 'prj-owner', 'prj-attck') };
    });
    await mustRefuse(client.getSandbox(sb.id).then((got) => `accepted, owner ${got.projectId}`));
    // A longer body (content-length follows it) is no better.
    const { client: longer } = await s.through(async (seen, edge) => {
      const a = await edge.relay(seen);
      const info = JSON.parse(a.body.toString()) as SandboxInfo;
      return { ...a, body: Buffer.from(JSON.stringify({ ...info, projectId: 'prj-attacker' })) };
    });
    await mustRefuse(longer.getSandbox(sb.id));
  } finally {
    await s.close();
  }
});

test('relayed: a changed status is refused (an error turned into success)', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const missing = ids.mint(EDGE);
    // The edge answers 404 sandbox_not_found; the impostor says 204, or 200 with the same body.
    for (const change of [
      (a: Answer): Answer => ({ ...a, status: 204, body: Buffer.alloc(0) }),
      (a: Answer): Answer => ({ ...a, status: 200 }),
    ]) {
      const { client } = await s.through(async (seen, edge) => change(await edge.relay(seen)));
      await mustRefuse(client.stopSandbox(missing).then(() => 'stop acknowledged'));
    }
    // And a success turned into an error: a 200 answer's status made 409.
    const sb = await running(fake);
    const { client } = await s.through(async (seen, edge) => ({
      ...(await edge.relay(seen)),
      status: 409,
    }));
    await mustRefuse(client.getSandbox(sb.id));
  } finally {
    await s.close();
  }
});

test('relayed: changed, dropped or repeated command frames are refused', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const changes: [string, (body: Buffer) => Buffer][] = [
      // `false` exits 1; the impostor reports 0.
      ['the exit code', (b) => swap(b, '"exitCode":1', '"exitCode":0')],
      // The first output byte (offset 5: after the first frame's type and length).
      [
        'an output byte',
        (b) => {
          const out = Buffer.from(b);
          out[5] = out[5]! ^ 0x20;
          return out;
        },
      ],
      [
        'the first frame repeated',
        (b) => {
          const first = b.subarray(0, findFrameLength(b));
          return Buffer.concat([first, b]);
        },
      ],
      ['the first frame dropped', (b) => b.subarray(findFrameLength(b))],
    ];
    for (const [what, change] of changes) {
      const { client } = await s.through(async (seen, edge) => {
        const a = await edge.relay(seen);
        return { ...a, body: change(a.body) };
      });
      const out: string[] = [];
      await mustRefuse(
        client
          .runCommand(sb.id, { argv: ['false', 'x'] }, { onStdout: (c) => out.push(c.toString()) })
          .then((r) => `${what}: accepted, exit ${r.exitCode}, output ${JSON.stringify(out)}`),
        what,
      );
    }
  } finally {
    await s.close();
  }
});

/**
 * Bytes of the first frame of a command stream, whatever follows a frame's
 * payload (nothing, or a MAC): the second frame starts where a plausible
 * type byte and length put the end of the body or a third frame.
 */
function findFrameLength(b: Buffer): number {
  const len = b.readUInt32BE(1);
  for (const tail of [0, 32]) {
    const next = 5 + len + tail;
    if (next === b.length) return next;
    if (next + 5 <= b.length && b[next]! <= 3) {
      const nextLen = b.readUInt32BE(next + 1);
      if (next + 5 + nextLen + tail <= b.length) return next;
    }
  }
  throw new Error('no frame boundary found');
}

/** An io with one file, one failing file, a recording upload, and an echo terminal. */
function fileEdge(): {
  edge: EdgeApi;
  uploads: { path: string; bytes: Buffer; error?: unknown }[];
} {
  const fake = new FakeEdge({ edgeId: EDGE });
  const uploads: { path: string; bytes: Buffer; error?: unknown }[] = [];
  const io: Partial<SandboxIoApi> = {
    readFile: async (_id, path) => {
      const stream = new Readable({ read: () => undefined });
      stream.push(Buffer.from('reference answer: 42\n'));
      if (path === '/broken') {
        setImmediate(() => stream.destroy(new DsecError('resource_exhausted', 'read failed')));
      } else stream.push(null);
      return stream;
    },
    writeFile: async (_id, path, body) => {
      const chunks: Buffer[] = [];
      const rec: { path: string; bytes: Buffer; error?: unknown } = {
        path,
        bytes: Buffer.alloc(0),
      };
      uploads.push(rec);
      try {
        for await (const c of body as Readable) chunks.push(c as Buffer);
      } catch (err) {
        rec.error = err;
        throw err;
      } finally {
        rec.bytes = Buffer.concat(chunks);
      }
      const info: FileInfo = {
        name: path.split('/').pop() ?? '',
        path,
        type: 'file',
        size: rec.bytes.length,
        mode: 0o644,
        mtime: new Date(0).toISOString(),
        uid: 0,
        gid: 0,
      };
      return info;
    },
    openPty: async () => {
      const listeners: ((c: Buffer) => void)[] = [];
      let exit!: (v: { exitCode: number }) => void;
      const session: PtySession = {
        onOutput: (cb) => {
          listeners.push(cb);
          cb(Buffer.from('$ '));
        },
        write: (d) => listeners.forEach((l) => l(Buffer.from(`ran:${d.toString()}`))),
        resize: () => undefined,
        end: () => exit({ exitCode: 0 }),
        kill: () => exit({ exitCode: 137 }),
        exited: new Promise((r) => (exit = r)),
      };
      return session;
    },
  };
  const edge: EdgeApi = {
    edgeId: EDGE,
    status: (sig) => fake.status(sig),
    createSandbox: (r, sig) => fake.createSandbox(r, sig),
    getSandbox: (id, sig) => fake.getSandbox(id, sig),
    listSandboxes: (f, sig) => fake.listSandboxes(f, sig),
    stopSandbox: (id, sig) => fake.stopSandbox(id, sig),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
    io: io as SandboxIoApi,
  };
  return { edge, uploads };
}

async function readAll(stream: Readable): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString();
}

test('relayed: a changed download, or one whose error trailer was stripped, is refused', async () => {
  const { edge } = fileEdge();
  const s = await setting(edge);
  try {
    const { client } = await s.through(async (seen, e) => {
      const a = await e.relay(seen);
      return { ...a, body: swap(a.body, '42', '41') };
    });
    await mustRefuse(
      client.io
        .readFile('sb', '/answer')
        .then(readAll)
        .then((t) => `accepted: ${t}`),
    );
    // A failed read whose error trailer is dropped would look complete.
    const { client: stripped } = await s.through(async (seen, e) => {
      const a = await e.relay(seen);
      const trailers = { ...a.trailers };
      delete trailers['x-dsec-edge-error'];
      return { ...a, trailers };
    });
    await mustRefuse(
      stripped.io
        .readFile('sb', '/broken')
        .then(readAll)
        .then((t) => `accepted: ${t}`),
    );
  } finally {
    await s.close();
  }
});

test('relayed: a changed request body is refused before the edge acts on it', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  let ran = 0;
  const counted: EdgeApi = {
    edgeId: EDGE,
    status: (sig) => fake.status(sig),
    createSandbox: (r, sig) => fake.createSandbox(r, sig),
    getSandbox: (id, sig) => fake.getSandbox(id, sig),
    listSandboxes: (f, sig) => fake.listSandboxes(f, sig),
    stopSandbox: (id, sig) => fake.stopSandbox(id, sig),
    runCommand: (id, c, o) => {
      ran++;
      return fake.runCommand(id, c, o);
    },
  };
  const s = await setting(counted);
  try {
    const sb = await running(fake);
    const { client } = await s.through(async (seen, edge) =>
      edge.relay(seen, { body: swap(seen.body, '"hello"', '"pwned"') }),
    );
    await mustRefuse(
      client
        .runCommand(sb.id, { argv: ['echo', 'hello'] })
        .then((r) => `accepted: ${r.stdout.trim()}`),
    );
    assert.equal(ran, 0, 'the edge ran nothing');
  } finally {
    await s.close();
  }
  // An upload whose bytes are changed on the way never completes.
  const { edge, uploads } = fileEdge();
  const f = await setting(edge);
  try {
    const { client } = await f.through(async (seen, e) =>
      e.relay(seen, { body: swap(seen.body, 'print(1)', 'print(0)') }),
    );
    await mustRefuse(
      client.io
        .writeFile('sb', '/tests/test_fix.py', Readable.from([Buffer.from('print(1)\n')]))
        .then((info) => `accepted: ${info.size} bytes`),
    );
    assert.equal(uploads.length, 1);
    assert.ok(
      isDsecError(uploads[0]!.error, 'unauthenticated'),
      `the edge saw the upload fail its MAC: ${String(uploads[0]!.error)}`,
    );
  } finally {
    await f.close();
  }
});

test('relayed: a changed byte of a terminal stream ends the session, either way', async () => {
  const { edge } = fileEdge();
  const s = await setting(edge);
  try {
    // `direction` names which side's bytes the impostor changes.
    for (const direction of ['to client', 'to edge'] as const) {
      const { client } = await s.through(
        async () => json(500, {}),
        (req, socket, head, target) => {
          void rawUpgrade(target, headLines(req)).then(({ socket: edgeSocket, answer }) => {
            socket.write(answer + '\r\n\r\n');
            let down = 0;
            edgeSocket.on('data', (c: Buffer) => {
              const out = Buffer.from(c);
              // The first output byte, after the first frame's type and length: `$` becomes `%`.
              if (direction === 'to client' && down <= 5 && down + out.length > 5)
                out[5 - down] = out[5 - down]! ^ 0x01;
              down += c.length;
              socket.write(out);
            });
            edgeSocket.resume();
            let up = 0;
            const onUp = (c: Buffer) => {
              const out = Buffer.from(c);
              // The first keystroke: `id` becomes `hd`.
              if (direction === 'to edge' && up <= 5 && up + out.length > 5)
                out[5 - up] = out[5 - up]! ^ 0x01;
              up += c.length;
              edgeSocket.write(out);
            };
            if (head.length > 0) onUp(head);
            socket.on('data', onUp);
            socket.once('close', () => edgeSocket.destroy());
            edgeSocket.once('close', () => socket.destroy());
          });
        },
      );
      const pty = await client.io.openPty('sb');
      let seen = '';
      pty.onOutput((c) => (seen += c.toString()));
      pty.write(Buffer.from('id\n'));
      const exit = await Promise.race([
        pty.exited,
        new Promise((r) => setTimeout(() => r('still open'), 2000)),
      ]);
      assert.deepEqual(exit, { exitCode: 255, signal: undefined }, `${direction}: ${seen}`);
      assert.ok(!seen.includes('%'), `${direction}: changed output was shown: ${seen}`);
      assert.ok(!seen.includes('ran:'), `${direction}: a changed keystroke ran: ${seen}`);
    }
  } finally {
    await s.close();
  }
});

// ---- answers recorded earlier, replayed for a later request ----

test('replayed: an old answer is refused, with its old proof or a harvested one', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    let recorded: Answer | undefined;
    let mode: 'old proof' | 'harvested proof' = 'harvested proof';
    const { client } = await s.through(async (seen, edge) => {
      if (!recorded) {
        recorded = await edge.relay(seen);
        return recorded;
      }
      if (mode === 'old proof') return recorded;
      const proof = (await edge.harvest(seen)).headers[HEADER_PROOF];
      return { ...recorded, headers: { ...recorded.headers, [HEADER_PROOF]: proof } };
    });
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
    await fake.stopSandbox(sb.id);
    mode = 'harvested proof';
    await mustRefuse(client.getSandbox(sb.id).then((i) => `harvested proof accepted: ${i.state}`));
    // (The unfixed client already refused this one: its proof was over another nonce.)
    mode = 'old proof';
    await mustRefuse(client.getSandbox(sb.id).then((i) => `old proof accepted: ${i.state}`));
  } finally {
    await s.close();
  }
});

test('replayed: an old command stream is refused for a new command', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    let recorded: Answer | undefined;
    const { client } = await s.through(async (seen, edge) => {
      if (!recorded) {
        recorded = await edge.relay(seen);
        return recorded;
      }
      const proof = (await edge.harvest(seen)).headers[HEADER_PROOF];
      return { ...recorded, headers: { ...recorded.headers, [HEADER_PROOF]: proof } };
    });
    assert.equal((await client.runCommand(sb.id, { argv: ['true'] })).exitCode, 0);
    await mustRefuse(
      client
        .runCommand(sb.id, { argv: ['false'] })
        .then((r) => `a replayed stream accepted: exit ${r.exitCode}`),
    );
  } finally {
    await s.close();
  }
});

test('the impostor relaying genuine exchanges unchanged is just a proxy', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const { client, seen } = await s.through(async (x, edge) => edge.relay(x));
    assert.equal((await client.getSandbox(sb.id)).projectId, 'prj-owner');
    assert.equal((await client.runCommand(sb.id, { argv: ['echo', 'hi'] })).stdout, 'echo hi\n');
    await client.stopSandbox(sb.id);
    assert.equal((await fake.getSandbox(sb.id)).state, 'stopped');
    assert.equal(seen.length, 3);
    // What it saw cannot be sent again.
    const replay = await send(
      new URL(s.server.url),
      seen[0]!.method,
      seen[0]!.url,
      forwardable(seen[0]!.headers),
      seen[0]!.body,
      seen[0]!.trailers,
    );
    assert.equal(replay.status, 401);
    assert.equal(replay.headers[HEADER_PROOF], undefined, 'no proof on a refused request');
  } finally {
    await s.close();
  }
});

test('an error answer past its bound is dropped, not buffered', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    const { client } = await s.through(async () => ({
      status: 500,
      headers: { 'content-type': 'application/json' },
      body: Buffer.alloc(3 << 20, 0x20),
      trailers: {},
    }));
    await assert.rejects(
      client.getSandbox(sb.id),
      (e) => isDsecError(e, 'unavailable') && /over 1048576 bytes/.test(e.message),
    );
  } finally {
    await s.close();
  }
});

// ---- review of the edge protocol change (issue 24 point 7) ----

test('relayed: a stdin body stripped on the way is refused, and the command sees no EOF', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const writes: { bytes: number; eof: boolean }[] = [];
  const io: Partial<SandboxIoApi> = {
    writeStdin: async (_id, _cid, data, options = {}) => {
      let bytes = 0;
      if (Buffer.isBuffer(data)) bytes = data.length;
      else if (data) for await (const c of data) bytes += (c as Buffer).length;
      writes.push({ bytes, eof: options.eof === true });
      return { bytes };
    },
  };
  const edge: EdgeApi = {
    edgeId: EDGE,
    status: (sig) => fake.status(sig),
    createSandbox: (r, sig) => fake.createSandbox(r, sig),
    getSandbox: (id, sig) => fake.getSandbox(id, sig),
    listSandboxes: (f, sig) => fake.listSandboxes(f, sig),
    stopSandbox: (id, sig) => fake.stopSandbox(id, sig),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
    io: io as SandboxIoApi,
  };
  const s = await setting(edge);
  try {
    // The impostor drops the body (and its trailer): what reaches the edge is a request
    // with no body at all, which the edge took for "no bytes, then EOF".
    const { client } = await s.through(async (seen, e) =>
      e.relay({ ...seen, trailers: {} }, { body: Buffer.alloc(0) }),
    );
    for (const [what, data] of [
      ['a buffer', Buffer.from('yes\n')],
      ['a stream', Readable.from([Buffer.from('yes\n')])],
    ] as const) {
      await mustRefuse(
        client.io
          .writeStdin('sb', 'cmd-1', data, { eof: true })
          .then((r) => `${what}: accepted, ${r.bytes} bytes`),
        what,
      );
    }
    assert.deepEqual(
      writes.filter((w) => w.eof),
      [],
      'the command was never sent an EOF it did not get from the client',
    );
    // Unchanged, the same calls work.
    const direct = s.direct;
    assert.deepEqual(
      await direct.io.writeStdin('sb', 'cmd-1', Buffer.from('yes\n'), { eof: true }),
      { bytes: 4 },
    );
    assert.deepEqual(await direct.io.writeStdin('sb', 'cmd-1', undefined, { eof: true }), {
      bytes: 0,
    });
  } finally {
    await s.close();
  }
});

test('replayed: a request the edge ran before a restart is refused by the restarted edge', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  let ran = 0;
  const counted: EdgeApi = {
    edgeId: EDGE,
    status: (sig) => fake.status(sig),
    createSandbox: (r, sig) => fake.createSandbox(r, sig),
    getSandbox: (id, sig) => fake.getSandbox(id, sig),
    listSandboxes: (f, sig) => fake.listSandboxes(f, sig),
    stopSandbox: (id, sig) => fake.stopSandbox(id, sig),
    runCommand: (id, c, o) => {
      ran++;
      return fake.runCommand(id, c, o);
    },
  };
  const s = await setting(counted);
  let restarted: Awaited<ReturnType<typeof serveEdge>> | undefined;
  try {
    const sb = await running(fake);
    // The impostor relays (and records) a command, as anyone on the path can.
    const { client, seen } = await s.through(async (x, edge) => edge.relay(x));
    assert.equal((await client.runCommand(sb.id, { argv: ['echo', 'rm -rf /work'] })).exitCode, 0);
    assert.equal(ran, 1);
    // The edge restarts (an upgrade, a crash) within the minute a signature is good for;
    // its memory of nonces went with the old process.
    await s.server.close();
    restarted = await serveEdge({ edge: counted, secret: s.secret });
    const x = seen[0]!;
    const replay = await send(
      new URL(restarted.url),
      x.method,
      x.url,
      forwardable(x.headers),
      x.body,
      x.trailers,
    );
    assert.equal(replay.status, 401, `the restarted edge took the replay: ${replay.status}`);
    assert.equal(replay.headers[HEADER_PROOF], undefined);
    assert.equal(ran, 1, 'the command ran once');
    // A request signed after the restart works.
    const fresh = new RemoteEdge({ edgeId: EDGE, url: restarted.url, secret: s.secret });
    assert.equal((await fresh.runCommand(sb.id, { argv: ['true'] })).exitCode, 0);
    fresh.close();
  } finally {
    await restarted?.close();
    await s.close();
  }
});

test('relayed: a request turned into an upgrade on the way is refused, not answered as the edge', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const s = await setting(fake);
  try {
    const sb = await running(fake);
    // The impostor adds `Upgrade` to a genuine signed GET (or strips it from a terminal's
    // request): the edge took the unsigned header and proved its "no such route" 404.
    const { client } = await s.through(async (seen, _edge) => {
      const target = new URL(s.server.url);
      let head = `${seen.method} ${seen.url} HTTP/1.1\r\n`;
      for (const [k, v] of Object.entries(forwardable(seen.headers)))
        head += `${k}: ${String(v)}\r\n`;
      head += 'connection: Upgrade\r\nupgrade: dsec-edge-pty\r\n\r\n';
      const { socket, answer } = await rawUpgrade(target, head);
      const chunks: Buffer[] = [];
      socket.on('data', (c: Buffer) => chunks.push(c));
      const closed = new Promise((r) => socket.once('close', r));
      socket.resume();
      await closed;
      const [statusLine, ...lines] = answer.split('\r\n');
      const headers: IncomingHttpHeaders = {};
      for (const line of lines) {
        const colon = line.indexOf(':');
        headers[line.slice(0, colon).toLowerCase()] = line.slice(colon + 1).trim();
      }
      return {
        status: Number(statusLine!.split(' ')[1]),
        headers,
        body: Buffer.concat(chunks),
        trailers: {},
      };
    });
    await mustRefuse(
      client.getSandbox(sb.id).then(
        (got) => `accepted: ${got.state}`,
        (e: unknown) => {
          if (isDsecError(e) && e.code !== 'unavailable') return `a proven ${e.code}: ${e.message}`;
          throw e;
        },
      ),
    );
    // The other way: a terminal's request relayed without its upgrade headers.
    const { client: stripped } = await s.through(
      async () => json(500, {}),
      (req, socket, _head, target) => {
        let head = `${req.method} ${req.url} HTTP/1.1\r\n`;
        for (let i = 0; i < req.rawHeaders.length; i += 2) {
          const name = req.rawHeaders[i]!.toLowerCase();
          if (name !== 'upgrade' && name !== 'connection')
            head += `${req.rawHeaders[i]}: ${req.rawHeaders[i + 1]}\r\n`;
        }
        head += 'connection: close\r\n\r\n';
        void rawUpgrade(target, head).then(({ socket: edgeSocket, answer }) => {
          socket.write(answer + '\r\n\r\n');
          edgeSocket.pipe(socket);
          edgeSocket.resume();
        });
      },
    );
    await mustRefuse(
      stripped.io.openPty(sb.id).then(
        () => 'terminal accepted',
        (e: unknown) => {
          if (isDsecError(e) && e.code !== 'unavailable') return `a proven ${e.code}: ${e.message}`;
          throw e;
        },
      ),
    );
  } finally {
    await s.close();
  }
});

/**
 * A stdin or upload body the impostor changes, reorders or cuts on the way: the command and the
 * file must get none of the changed bytes (a shell reading stdin would run them), only a prefix
 * of what the client sent, and never its end. Raw bytes used to reach the edge as they came and
 * be checked against the trailer MAC at the end, after the command had read them.
 */
test('relayed: changed, reordered or cut bytes of a streamed body never reach the command or the file', async () => {
  const { edge: files, uploads } = fileEdge();
  const stdin: { bytes: Buffer; eof: boolean; error?: unknown }[] = [];
  const io: Partial<SandboxIoApi> = {
    ...files.io,
    writeStdin: async (_id, _cid, data, options = {}) => {
      const rec: { bytes: Buffer; eof: boolean; error?: unknown } = {
        bytes: Buffer.alloc(0),
        eof: false,
      };
      stdin.push(rec);
      const chunks: Buffer[] = [];
      try {
        if (Buffer.isBuffer(data)) chunks.push(data);
        else if (data) for await (const c of data) chunks.push(c as Buffer);
      } catch (err) {
        rec.error = err;
        throw err;
      } finally {
        rec.bytes = Buffer.concat(chunks);
      }
      rec.eof = options.eof === true;
      return { bytes: rec.bytes.length };
    },
  };
  const s = await setting({ ...files, io: io as SandboxIoApi });
  // Several socket writes' worth, the marker well past the first of them.
  const script = Buffer.concat([
    Buffer.alloc(200 * 1024, '# filler\n'),
    Buffer.from('echo safe\n'),
    Buffer.alloc(200 * 1024, '# filler\n'),
  ]);
  const attacks: [string, (body: Buffer) => Buffer][] = [
    ['a changed byte', (b) => swap(b, 'echo safe', 'rm -rf /;')],
    [
      'halves swapped',
      (b) => Buffer.concat([b.subarray(b.length >> 1), b.subarray(0, b.length >> 1)]),
    ],
    ['cut in half', (b) => b.subarray(0, b.length >> 1)],
  ];
  try {
    for (const [what, change] of attacks) {
      const { client } = await s.through(async (seen, e) =>
        e.relay(
          { ...seen, trailers: what === 'cut in half' ? {} : seen.trailers },
          {
            body: change(seen.body),
          },
        ),
      );
      for (const kind of ['a stream', 'a buffer']) {
        const data = () => (kind === 'a buffer' ? script : Readable.from([script]));
        await mustRefuse(
          client.io
            .writeStdin('sb', 'cmd-1', data(), { eof: true })
            .then((r) => `stdin accepted: ${r.bytes} bytes`),
          `${what}, ${kind} on stdin`,
        );
        await mustRefuse(
          client.io
            .writeFile('sb', '/tests/run.sh', data())
            .then((info) => `upload accepted: ${info.size} bytes`),
          `${what}, ${kind} uploaded`,
        );
      }
      client.close();
    }
    for (const [where, recs] of [
      ['stdin', stdin],
      ['the file', uploads],
    ] as const) {
      assert.equal(recs.length, attacks.length * 2, `every body reached ${where}'s consumer`);
      for (const rec of recs) {
        assert.ok(
          rec.bytes.equals(script.subarray(0, rec.bytes.length)),
          `${where} got only bytes the client sent, in its order (${rec.bytes.length} bytes, ` +
            `"rm -rf" ${rec.bytes.includes('rm -rf') ? 'among them' : 'not there'})`,
        );
        assert.ok(rec.error !== undefined, `${where}'s body failed instead of ending`);
      }
    }
    // Bytes added to a request that signed no body (a chunked or a sized one).
    for (const trailers of [{}, { 'x-pad': '1' }] as Record<string, string>[]) {
      const { client } = await s.through(async (seen, e) =>
        e.relay({ ...seen, trailers }, { body: Buffer.from('rm -rf /;\n') }),
      );
      await mustRefuse(
        client.io
          .writeStdin('sb', 'cmd-1', undefined, { eof: true })
          .then((r) => `stdin accepted: ${r.bytes} bytes`),
        'bytes added',
      );
      client.close();
    }
    for (const rec of stdin.slice(attacks.length * 2))
      assert.equal(rec.bytes.length, 0, `added bytes reached stdin: ${rec.bytes.toString()}`);
    assert.deepEqual(
      stdin.filter((w) => w.eof),
      [],
      'no command was sent an EOF',
    );
    // Unchanged, both work, and an empty upload too.
    assert.deepEqual(await s.direct.io.writeStdin('sb', 'cmd-1', script, { eof: true }), {
      bytes: script.length,
    });
    assert.equal((await s.direct.io.writeFile('sb', '/tests/e', Buffer.alloc(0))).size, 0);
    assert.ok(uploads.at(-1)!.bytes.length === 0 && uploads.at(-1)!.error === undefined);
  } finally {
    await s.close();
  }
});

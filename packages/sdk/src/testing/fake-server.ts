import http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { CommandResult, CommandSpec, LayerInfo, SandboxInfo, SandboxSpec } from '@dsec/core';
import type { CreatedKey, Project } from '../types.js';

/**
 * An in-process stand-in for the apiserver's HTTP API v1, for SDK and CLI
 * tests: plain node:http on 127.0.0.1:0, state in memory, every request
 * recorded. Commands do not run anything; `onCommand` scripts their output.
 * Not a conformance reference: it checks only what client tests need.
 */
export interface RecordedRequest {
  method: string;
  path: string;
  query: URLSearchParams;
  headers: http.IncomingHttpHeaders;
  body: unknown;
}

/** A scripted answer. `ndjson` streams one event per write, `delayMs` apart. */
export interface FakeReply {
  status?: number;
  body?: unknown;
  ndjson?: unknown[];
  delayMs?: number;
  /** Never answer (to test deadlines and aborts). */
  hang?: boolean;
}

export interface ScriptedCommand {
  stdout?: string[];
  stderr?: string[];
  exitCode?: number;
  signal?: string;
  outcome?: CommandResult['outcome'];
  delayMs?: number;
}

export interface FakeServer {
  url: string;
  requests: RecordedRequest[];
  sandboxes: Map<string, SandboxInfo>;
  /** Runs before the built-in routes; return a reply to take over the request. */
  override: ((req: RecordedRequest) => FakeReply | undefined) | undefined;
  /** Scripts the output of `POST /v1/sandboxes/:id/commands`. */
  onCommand: (spec: CommandSpec) => ScriptedCommand;
  /** Count of connections accepted, to check keep-alive reuse. */
  readonly connections: number;
  close(): Promise<void>;
}

const API_KEY = 'test-key';
export const FAKE_API_KEY = API_KEY;

export async function startFakeServer(): Promise<FakeServer> {
  let seq = 0;
  let connections = 0;
  const layers: LayerInfo[] = [
    {
      name: 'busybox',
      version: 'latest',
      kind: 'base',
      digest: `sha256:${'a'.repeat(64)}`,
      sizeBytes: 1_200_000,
      contentBytes: 2_400_000,
      fileCount: 420,
      createdAt: '2026-01-01T00:00:00.000Z',
      source: 'busybox',
    },
  ];
  const projects: Project[] = [{ id: 'prj-root', name: 'root' }];
  const state: FakeServer = {
    url: '',
    requests: [],
    sandboxes: new Map(),
    override: undefined,
    onCommand: (spec) => ({ stdout: [`ran ${spec.shell ?? (spec.argv ?? []).join(' ')}\n`] }),
    get connections() {
      return connections;
    },
    close: async () => {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };

  const route = (req: RecordedRequest): FakeReply => {
    if (req.method === 'GET' && req.path === '/healthz')
      return { body: { ok: true, version: 'fake' } };
    if (req.headers.authorization !== `Bearer ${API_KEY}`) {
      return error(401, 'unauthenticated', 'missing or unknown API key');
    }
    const parts = req.path.split('/').filter(Boolean);
    const [v1, noun, id, sub] = parts;
    if (v1 !== 'v1') return error(404, 'not_found', `no route ${req.path}`);
    if (noun === 'whoami')
      return { body: { keyId: 'key-1', projectId: 'prj-root', role: 'admin' } };
    if (noun === 'images' && req.method === 'GET') return { body: { layers } };
    if (noun === 'projects' && req.method === 'GET') return { body: { projects } };
    if (noun === 'projects' && req.method === 'POST') {
      const b = req.body as { name: string; parentId?: string; quota?: Project['quota'] };
      const project: Project = {
        id: `prj-${++seq}`,
        name: b.name,
        parentId: b.parentId,
        quota: b.quota,
      };
      projects.push(project);
      return { status: 201, body: project };
    }
    if (noun === 'keys' && req.method === 'POST') {
      const b = req.body as { projectId: string; role?: 'admin' | 'member' };
      const key: CreatedKey = {
        id: `key-${++seq}`,
        key: `dsec_secret_${seq}`,
        projectId: b.projectId,
        role: b.role ?? 'member',
      };
      return { status: 201, body: key };
    }
    if (noun === 'keys' && req.method === 'DELETE') return { status: 204 };
    if (noun !== 'sandboxes') return error(404, 'not_found', `no route ${req.path}`);
    if (id === undefined && req.method === 'POST') return create(req.body as Partial<SandboxSpec>);
    if (id === undefined && req.method === 'GET')
      return { body: { sandboxes: [...state.sandboxes.values()] } };
    const sandbox = id === undefined ? undefined : state.sandboxes.get(id);
    if (!sandbox) return error(404, 'sandbox_not_found', `no sandbox "${id}"`);
    if (sub === undefined && req.method === 'GET') return { body: sandbox };
    if (sub === undefined && req.method === 'DELETE') {
      sandbox.state = 'stopped';
      return { status: 204 };
    }
    if (sub === 'commands' && req.method === 'POST') {
      if (sandbox.state !== 'running')
        return error(409, 'sandbox_not_running', `sandbox ${sandbox.id} is ${sandbox.state}`);
      return command(req);
    }
    return error(404, 'not_found', `no route ${req.path}`);
  };

  const create = (body: Partial<SandboxSpec>): FakeReply => {
    if (typeof body.image !== 'string')
      return error(400, 'invalid_argument', 'image is required', 'image');
    if (body.image === 'missing') return error(404, 'image_not_found', `no image "${body.image}"`);
    if (body.memoryLimitMb !== undefined && body.memoryLimitMb < 16) {
      return error(400, 'invalid_argument', 'memoryLimitMb must be at least 16', 'memoryLimitMb');
    }
    if (
      body.qosClass !== undefined &&
      body.qosClass !== 'latency-sensitive' &&
      body.qosClass !== 'best-effort'
    ) {
      return error(
        400,
        'invalid_argument',
        "qosClass must be 'latency-sensitive' or 'best-effort'",
        'qosClass',
      );
    }
    const now = Date.now();
    const ttlSeconds = body.ttlSeconds ?? 3600;
    const info: SandboxInfo = {
      id: `sb-fake${++seq}`,
      edgeId: 'node-1',
      projectId: 'prj-root',
      state: 'running',
      spec: {
        backend: body.backend ?? 'container',
        image: body.image,
        workspace: body.workspace,
        toolkits: body.toolkits ?? [],
        memoryLimitMb: body.memoryLimitMb ?? 512,
        cpuCoresLimit: body.cpuCoresLimit ?? 1,
        pidsLimit: body.pidsLimit ?? 1024,
        qosClass: body.qosClass ?? 'latency-sensitive',
        ttlSeconds,
        networkRules: body.networkRules ?? {},
        initUser: body.initUser ?? 'root',
        env: body.env ?? {},
        labels: body.labels ?? {},
      },
      createdAt: new Date(now).toISOString(),
      expiresAt: new Date(now + ttlSeconds * 1000).toISOString(),
    };
    state.sandboxes.set(info.id, info);
    return { status: 201, body: info };
  };

  const command = (req: RecordedRequest): FakeReply => {
    const script = state.onCommand(req.body as CommandSpec);
    const stdout = (script.stdout ?? []).join('');
    const stderr = (script.stderr ?? []).join('');
    const result: CommandResult = {
      commandId: `cmd-${++seq}`,
      exitCode: script.exitCode ?? 0,
      signal: script.signal,
      outcome: script.outcome ?? (script.signal ? 'signaled' : 'exited'),
      stdout,
      stderr,
      truncated: false,
      stdoutBytes: Buffer.byteLength(stdout),
      stderrBytes: Buffer.byteLength(stderr),
      durationMs: 1,
    };
    if (req.headers.accept !== 'application/x-ndjson')
      return { body: result, delayMs: script.delayMs };
    const events: unknown[] = [];
    for (const s of script.stdout ?? [])
      events.push({ type: 'stdout', data: Buffer.from(s).toString('base64') });
    for (const s of script.stderr ?? [])
      events.push({ type: 'stderr', data: Buffer.from(s).toString('base64') });
    events.push({ type: 'result', result });
    return { ndjson: events, delayMs: script.delayMs };
  };

  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const url = new URL(req.url ?? '/', 'http://fake');
      const text = Buffer.concat(chunks).toString('utf8');
      let body: unknown;
      try {
        body = text ? JSON.parse(text) : undefined;
      } catch {
        send(res, error(400, 'invalid_argument', 'body is not JSON'));
        return;
      }
      const recorded: RecordedRequest = {
        method: req.method ?? 'GET',
        path: url.pathname,
        query: url.searchParams,
        headers: req.headers,
        body,
      };
      state.requests.push(recorded);
      send(res, state.override?.(recorded) ?? route(recorded));
    });
  });
  server.on('connection', () => connections++);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  state.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  return state;
}

function error(status: number, code: string, message: string, field?: string): FakeReply {
  return { status, body: { error: { code, message, ...(field ? { field } : {}) } } };
}

function send(res: http.ServerResponse, reply: FakeReply): void {
  if (reply.hang) return;
  const delay = reply.delayMs ?? 0;
  const status = reply.status ?? 200;
  if (reply.ndjson) {
    res.writeHead(status, { 'content-type': 'application/x-ndjson' });
    if (delay === 0) {
      res.end(reply.ndjson.map((e) => JSON.stringify(e) + '\n').join(''));
      return;
    }
    const events = [...reply.ndjson];
    const next = () => {
      const event = events.shift();
      if (event === undefined) {
        res.end();
        return;
      }
      res.write(JSON.stringify(event) + '\n');
      setTimeout(next, delay);
    };
    next();
    return;
  }
  const answer = () => {
    if (reply.body === undefined) {
      res.writeHead(status).end();
      return;
    }
    const payload = JSON.stringify(reply.body);
    res.writeHead(status, {
      'content-type': 'application/json',
      'content-length': Buffer.byteLength(payload),
    });
    res.end(payload);
  };
  // No timer when there is no delay: a 0 ms timer still costs ~1 ms per request.
  if (delay === 0) answer();
  else setTimeout(answer, delay);
}

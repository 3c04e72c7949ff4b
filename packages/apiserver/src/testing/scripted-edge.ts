import type { IncomingHttpHeaders } from 'node:http';
import { Readable } from 'node:stream';
import { DsecError, randomId } from '@dsec/core';
import type {
  CommandInfo,
  CommandResult,
  CommandSpec,
  FileInfo,
  LayerInfo,
  RunCommandOptions,
  SandboxInfo,
  SandboxIoApi,
  SessionResult,
} from '@dsec/core';
import { FakeEdge } from './fake-edge.js';
import { createTestApi } from './harness.js';
import { addFnCall } from './fncall-double.js';
import type { FnCallDouble } from './fncall-double.js';
import type { TestApi } from './harness.js';

/**
 * For client tests (the SDK's, the CLI's): the real apiserver, its routes,
 * schemas, auth and errors, listening on 127.0.0.1, over `ScriptedEdge`, a
 * `FakeEdge` whose commands can be scripted and that keeps files and a
 * command log in memory (sessions run their line as a command).
 */

/** How a scripted command behaves; unset fields fall back to FakeEdge's echo. */
export interface ScriptedCommand {
  stdout?: string[];
  stderr?: string[];
  /** Output in this order (after `stdout` and `stderr`); bytes may split a character. */
  output?: ({ stdout: string | Buffer } | { stderr: string | Buffer })[];
  exitCode?: number;
  signal?: string;
  outcome?: CommandResult['outcome'];
  /** Wait this long between output chunks (and before the result). */
  delayMs?: number;
  /** Never finish (until the request is aborted). */
  hang?: boolean;
  /** Fail with this error after the output (if any) instead of answering. */
  error?: DsecError;
}

const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener('abort', () => {
      clearTimeout(timer);
      reject(new DsecError('aborted', 'aborted'));
    });
  });

export class ScriptedEdge extends FakeEdge {
  /** Scripts `runCommand`; return undefined to use FakeEdge's echo. */
  onCommand: ((spec: CommandSpec) => ScriptedCommand | undefined) | undefined;
  readonly files = new Map<string, { data: Buffer; mode: number; dir: boolean }>([
    ['/', { data: Buffer.alloc(0), mode: 0o755, dir: true }],
  ]);
  readonly commands = new Map<string, CommandInfo>();
  readonly io: SandboxIoApi;
  /** Creates wait until the request is aborted (to test client deadlines). */
  hangCreates = false;

  constructor() {
    super({ edgeId: 'edge-a' });
    this.io = this.#io();
  }

  override async createSandbox(
    req: Parameters<FakeEdge['createSandbox']>[0],
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    if (this.hangCreates) {
      await new Promise((_resolve, reject) =>
        signal?.addEventListener('abort', () => reject(new DsecError('aborted', 'gone'))),
      );
    }
    return super.createSandbox(req, signal);
  }

  override async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    const script = this.onCommand?.(command);
    if (!script) return super.runCommand(id, command, options);
    // Checks as FakeEdge's own runCommand does: the project, and a running (or resumable) sandbox.
    const info = await this.getSandbox(id);
    if (options.projectId !== undefined && info.projectId !== options.projectId)
      throw new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
    if (info.state === 'paused') await this.resumeSandbox(id);
    else if (info.state !== 'running')
      throw new DsecError('sandbox_not_running', `sandbox ${id} is ${info.state}`);
    if (script.hang) {
      await new Promise((_resolve, reject) =>
        options.signal?.addEventListener('abort', () => reject(new DsecError('aborted', 'gone'))),
      );
    }
    const events = [
      ...(script.stdout ?? []).map((stdout) => ({ stdout })),
      ...(script.stderr ?? []).map((stderr) => ({ stderr })),
      ...(script.output ?? []),
    ];
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    for (const ev of events) {
      if ('stdout' in ev) {
        out.push(Buffer.from(ev.stdout));
        options.onStdout?.(Buffer.from(ev.stdout));
      } else {
        err.push(Buffer.from(ev.stderr));
        options.onStderr?.(Buffer.from(ev.stderr));
      }
      if (script.delayMs) await sleep(script.delayMs, options.signal);
    }
    if (script.error) throw script.error;
    const stdout = Buffer.concat(out).toString();
    const stderr = Buffer.concat(err).toString();
    return {
      commandId: randomId('cmd'),
      exitCode: script.exitCode ?? 0,
      ...(script.signal ? { signal: script.signal } : {}),
      outcome: script.outcome ?? (script.signal ? 'signaled' : 'exited'),
      stdout,
      stderr,
      truncated: false,
      stdoutBytes: Buffer.byteLength(stdout),
      stderrBytes: Buffer.byteLength(stderr),
      durationMs: 1,
    };
  }

  #info(path: string): FileInfo {
    const f = this.files.get(path);
    if (!f) throw new DsecError('not_found', `no such file ${path}`);
    return {
      name: path.split('/').pop() || '/',
      path,
      type: f.dir ? 'directory' : 'file',
      size: f.data.length,
      mode: f.mode,
      mtime: new Date(0).toISOString(),
      uid: 0,
      gid: 0,
    };
  }

  #io(): SandboxIoApi {
    const unsupported = () => {
      throw new DsecError('unavailable', 'not in the scripted edge');
    };
    const run = async (
      sandboxId: string,
      spec: CommandSpec & { requestId?: string | undefined },
    ): Promise<CommandInfo> => {
      for (const c of this.commands.values()) {
        if (spec.requestId !== undefined && c.requestId === spec.requestId) return c;
      }
      const result = await this.runCommand(sandboxId, spec);
      const info: CommandInfo = {
        commandId: result.commandId,
        sandboxId,
        ...(spec.requestId !== undefined ? { requestId: spec.requestId } : {}),
        ...(spec.argv ? { argv: spec.argv } : { shell: spec.shell }),
        background: true,
        state: 'finished',
        startedAt: new Date().toISOString(),
        finishedAt: new Date().toISOString(),
        result,
      };
      this.commands.set(info.commandId, info);
      return info;
    };
    const command = (id: string) => {
      const c = this.commands.get(id);
      if (!c?.result) throw new DsecError('command_not_found', `no command ${id}`);
      return { ...c, result: c.result };
    };
    return {
      runCommand: (id, spec, options) => this.runCommand(id, spec, options),
      startCommand: (id, spec) => run(id, spec),
      getCommand: async (_id, cid) => command(cid),
      listCommands: async () => [...this.commands.values()].reverse(),
      waitCommand: async (_id, cid) => command(cid).result,
      watchCommand: async (_id, cid, options) => {
        const { result } = command(cid);
        if (result.stdout) options?.onStdout?.(Buffer.from(result.stdout));
        if (result.stderr) options?.onStderr?.(Buffer.from(result.stderr));
        return result;
      },
      killCommand: async (_id, cid) => void command(cid),
      signalCommand: async (_id, cid) => void command(cid),
      writeStdin: async (_id, cid, data) => {
        command(cid);
        let bytes = 0;
        if (Buffer.isBuffer(data)) bytes = data.length;
        else if (data) for await (const c of data) bytes += (c as Buffer).length;
        return { bytes };
      },
      runInSession: async (id, name, spec, options): Promise<SessionResult> => ({
        ...(await this.runCommand(id, { shell: spec.line }, options)),
        session: name,
        shellRestarted: false,
        sessionEnded: false,
      }),
      listSessions: async () => [],
      closeSession: async () => undefined,
      readFile: async (_id, path) => {
        if (this.#info(path).type === 'directory') {
          throw new DsecError('invalid_argument', `${path} is a directory`, { field: 'path' });
        }
        return Readable.from([this.files.get(path)?.data ?? Buffer.alloc(0)]);
      },
      writeFile: async (_id, path, body, options) => {
        const chunks: Buffer[] = [];
        if (Buffer.isBuffer(body)) chunks.push(body);
        else for await (const c of body) chunks.push(c as Buffer);
        this.files.set(path, {
          data: Buffer.concat(chunks),
          mode: options?.mode ?? 0o644,
          dir: false,
        });
        return this.#info(path);
      },
      statFile: async (_id, path) => this.#info(path),
      listDir: async (_id, path) => {
        const prefix = path.endsWith('/') ? path : `${path}/`;
        return [...this.files.keys()]
          .filter(
            (p) => p !== path && p.startsWith(prefix) && !p.slice(prefix.length).includes('/'),
          )
          .sort()
          .map((p) => this.#info(p));
      },
      mkdir: async (_id, path, options) => {
        if (this.files.has(path) && !options?.parents) throw new DsecError('conflict', 'exists');
        this.files.set(path, { data: Buffer.alloc(0), mode: options?.mode ?? 0o755, dir: true });
      },
      remove: async (_id, path) => {
        this.#info(path);
        this.files.delete(path);
      },
      rename: async (_id, from, to) => {
        const f = this.files.get(from);
        if (!f) throw new DsecError('not_found', `no such file ${from}`);
        this.files.delete(from);
        this.files.set(to, f);
      },
      connectPort: async () => unsupported(),
      openPty: async () => unsupported(),
    };
  }
}

export interface RecordedRequest {
  method: string;
  /** Without the query. */
  path: string;
  query: URLSearchParams;
  headers: IncomingHttpHeaders;
  /** The parsed JSON body (undefined for none or a raw body). */
  body: unknown;
}

export interface TestServer {
  url: string;
  /** The bootstrap admin key of the root project. */
  key: string;
  api: TestApi;
  edge: ScriptedEdge & { fncallDouble: FnCallDouble };
  /** Every request the apiserver routed, in order. */
  requests: RecordedRequest[];
  /** Connections accepted so far (to check keep-alive reuse). */
  readonly connections: number;
  close(): Promise<void>;
}

/** One base layer, `busybox:latest`, as `GET /v1/images` lists it. */
export const TEST_LAYERS: LayerInfo[] = [
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

/** The real apiserver over a `ScriptedEdge`, listening on 127.0.0.1. */
export async function startTestServer(): Promise<TestServer> {
  // FnCall answers from a double (stdin echoed; script it with `edge.fncallDouble.onCall`).
  const edge = addFnCall(new ScriptedEdge());
  const api = await createTestApi({ edges: [edge], imagesList: async () => TEST_LAYERS });
  const requests: RecordedRequest[] = [];
  api.app.addHook('preHandler', async (req) => {
    const url = new URL(req.url, 'http://x');
    const body: unknown = req.body;
    requests.push({
      method: req.method,
      path: url.pathname,
      query: url.searchParams,
      headers: req.headers,
      body: body instanceof Readable ? undefined : body,
    });
  });
  let connections = 0;
  api.app.server.on('connection', () => connections++);
  const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
  return {
    url,
    key: api.rootKey,
    api,
    edge,
    requests,
    get connections() {
      return connections;
    },
    close: () => api.close(),
  };
}

import type { MessageInitShape } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import type { HandlerContext, ServiceImpl } from '@connectrpc/connect';
import { DsecError, toDsecError } from '@dsec/core';
import type { CommandInfo, CommandResult, StartCommandSpec } from '@dsec/core';
import { schemas } from '@dsec/apiserver';
import { envdUser } from '../auth.js';
import { toConnectError } from '../errors.js';
import { BoundedMap } from '../sandbox-access.js';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';
import { Signal } from '../gen/process/process_pb.js';
import type {
  Process,
  ProcessConfig,
  ProcessEventSchema,
  ProcessInfoSchema,
  ProcessSelector,
  StartRequest,
} from '../gen/process/process_pb.js';
import { EventQueue, keepaliveMs } from './event-queue.js';
import { MAX_PTYS_PER_SANDBOX, PTY_DETACHED_MS } from './process-table.js';
import type { ProcessTable, PtyEntry } from './process-table.js';
import {
  MAX_STREAM_BUFFER_BYTES,
  openTarget,
  requestHeaderOf,
  requestHeadersOf,
  streamBacklogKey,
} from './rpc-context.js';

type EventInit = NonNullable<MessageInitShape<typeof ProcessEventSchema>['event']>;
type EndInit = Extract<EventInit, { case: 'end' }>['value'];

/** DSec's longest command timeout: E2B's "no timeout" (no `Connect-Timeout-Ms`) runs up to it. */
export const MAX_COMMAND_TIMEOUT_MS = 86_400_000;

const SHELLS = new Set(['bash', 'sh']);

/** Validated command bodies kept (see `commandSpec`), and the longest body (as JSON) kept. */
const SPEC_CACHE_ENTRIES = 1024;
const SPEC_CACHE_MAX_KEY_CHARS = 4096;

const SHELL_FLAGS = new Set(['-l', '-i', '--login']);

/**
 * Why a stream stops watching its command. Nothing reads it; a shared value
 * spares the `DOMException` (and its stack trace) `abort()` makes per call.
 */
const STOP_WATCHING = new ConnectError('the stream stopped following the command', Code.Canceled);

export interface ProcessServiceDeps {
  access: SandboxAccess;
  processes: ProcessTable;
}

/**
 * envd's process service over DSec's command log (docs/e2b.md): `Start`
 * runs a background command with its output streamed (it outlives the
 * stream, to its timeout, as in envd), `Connect` follows it again, stdin
 * and signals go to the command by its PID; a `pty` request opens a DSec
 * terminal instead.
 */
export function processService({
  access,
  processes,
}: ProcessServiceDeps): ServiceImpl<typeof Process> {
  async function open(ctx: HandlerContext): Promise<OpenedSandbox> {
    return openTarget(access, ctx);
  }

  async function* followCommand(
    sb: OpenedSandbox,
    commandId: string,
    ctx: HandlerContext,
  ): AsyncGenerator<{ event: { event: EventInit } }> {
    // Watching stops with the call, or earlier when the stream ends or overflows
    // (one controller, linked by hand: `AbortSignal.any` costs more than the rest of this).
    const stop = new AbortController();
    const onCallAbort = () => stop.abort(ctx.signal.reason);
    const stopWatching = () => {
      ctx.signal.removeEventListener('abort', onCallAbort);
      stop.abort(STOP_WATCHING);
    };
    if (ctx.signal.aborted) onCallAbort();
    else ctx.signal.addEventListener('abort', onCallAbort, { once: true });
    const queue = newQueue(ctx, stopWatching);
    const data = (stream: 'stdout' | 'stderr') => (chunk: Buffer) =>
      queue.push({ case: 'data', value: { output: { case: stream, value: chunk } } }, chunk.length);
    sb.io
      .watchCommand(sb.id, commandId, {
        signal: stop.signal,
        onStdout: data('stdout'),
        onStderr: data('stderr'),
      })
      .then(
        async (result) => {
          // A command the platform ended (not by itself, its timeout or OOM) may have died
          // with its sandbox: then the stream ends with an error, as envd's connection
          // breaks, so the SDK raises instead of reporting a clean end.
          if (result.outcome === 'killed' || result.outcome === 'signaled') {
            const gone = await access.isGone(sb).catch(() => false);
            if (gone) {
              queue.end(
                new ConnectError(
                  `the sandbox ${sb.id} was killed while the process ran`,
                  Code.Unavailable,
                ),
              );
              return;
            }
          }
          queue.push({ case: 'end', value: endOf(result) });
          queue.end();
        },
        (err: unknown) => queue.end(toConnectError(err)),
      );
    yield* drain(queue, ctx, stopWatching);
  }

  async function* followPty(
    entry: PtyEntry,
    ctx: HandlerContext,
  ): AsyncGenerator<{ event: { event: EventInit } }> {
    const queue = newQueue(ctx, () => entry.session.kill());
    // Reattached (`Connect`): the terminal is followed again and lives on.
    clearTimeout(entry.detachTimer);
    entry.detachTimer = undefined;
    const listener = (chunk: Buffer) =>
      queue.push({ case: 'data', value: { output: { case: 'pty', value: chunk } } }, chunk.length);
    entry.listeners.add(listener);
    entry.exited.then(
      ({ exitCode, signal }) => {
        queue.push({
          case: 'end',
          value: signal
            ? { exitCode: -1, exited: false, status: `signal: ${signalWord(signal)}` }
            : { exitCode, exited: true, status: `exit status ${exitCode}` },
        });
        queue.end();
      },
      (err: unknown) => queue.end(toConnectError(err)),
    );
    const onAbort = () => queue.end();
    ctx.signal.addEventListener('abort', onAbort, { once: true });
    try {
      yield* drain(queue, ctx, () => undefined);
    } finally {
      ctx.signal.removeEventListener('abort', onAbort);
      entry.listeners.delete(listener);
      // A terminal nobody follows any more waits a while for a `Connect`, then is ended
      // (envd keeps it until it exits; here an abandoned one must not live forever).
      if (entry.listeners.size === 0 && !entry.done) {
        clearTimeout(entry.detachTimer);
        entry.detachTimer = setTimeout(() => entry.session.kill(), PTY_DETACHED_MS);
        entry.detachTimer.unref();
      }
    }
  }

  async function startPty(
    sb: OpenedSandbox,
    req: StartRequest,
    cfg: ProcessConfig,
    user: string | undefined,
    ctx: HandlerContext,
  ): Promise<PtyEntry> {
    // Terminals being opened count too: concurrent Starts would all pass a count of the open ones.
    const opening = ptysOpening.get(sb.id) ?? 0;
    if (processes.ptys(sb.id).length + opening >= MAX_PTYS_PER_SANDBOX) {
      throw new DsecError(
        'resource_exhausted',
        `at most ${MAX_PTYS_PER_SANDBOX} terminals per sandbox: kill one first`,
      );
    }
    ptysOpening.set(sb.id, opening + 1);
    try {
      const shell = (await programExists(access, sb, cfg.cmd, ctx.signal)) ? cfg.cmd : undefined;
      const size = req.pty?.size;
      const session = await sb.io.openPty(sb.id, {
        ...(size?.rows ? { rows: size.rows } : {}),
        ...(size?.cols ? { cols: size.cols } : {}),
        shell,
        user,
        env: cfg.envs,
        cwd: cfg.cwd ? await access.resolvePath(sb, cfg.cwd, user, ctx.signal) : undefined,
        signal: ctx.signal,
      });
      return processes.addPty(sb.id, session, shell ?? '/bin/sh', shell ? cfg.args : []);
    } finally {
      const left = (ptysOpening.get(sb.id) ?? 1) - 1;
      if (left > 0) ptysOpening.set(sb.id, left);
      else ptysOpening.delete(sb.id);
    }
  }
  /** Terminals each sandbox has being opened (`startPty` between its check and `addPty`). */
  const ptysOpening = new Map<string, number>();

  const validSpecs = new BoundedMap<string, Omit<StartCommandSpec, 'timeoutMs'>>(
    SPEC_CACHE_ENTRIES,
  );

  async function commandSpec(
    sb: OpenedSandbox,
    req: StartRequest,
    cfg: ProcessConfig,
    user: string | undefined,
    ctx: HandlerContext,
  ): Promise<StartCommandSpec> {
    const line = shellLine(cfg.cmd, cfg.args);
    // The SDKs wrap every command in `/bin/bash -l -c`; an image without that shell
    // runs the line with the platform's own shell instead of failing to exec.
    const platformShell =
      line !== undefined && !(await programExists(access, sb, cfg.cmd, ctx.signal));
    const remaining = ctx.timeoutMs();
    const body = {
      ...(platformShell ? { shell: line } : { argv: [cfg.cmd, ...cfg.args] }),
      ...(Object.keys(cfg.envs).length > 0 ? { env: cfg.envs } : {}),
      ...(cfg.cwd ? { cwd: await access.resolvePath(sb, cfg.cwd, user, ctx.signal) } : {}),
      ...(user !== undefined ? { user } : {}),
      timeoutMs:
        remaining !== undefined && remaining > 0
          ? Math.min(Math.ceil(remaining), MAX_COMMAND_TIMEOUT_MS)
          : MAX_COMMAND_TIMEOUT_MS,
      stdinOpen: req.stdin ?? true,
    };
    // The body's validation depends on nothing but the body; the deadline is ours and always
    // in range. The SDKs send the same few commands over and over (each `commands.run` the same
    // shape), so a validated body is reused, with this call's deadline.
    const { timeoutMs, ...rest } = body;
    const key = JSON.stringify(rest);
    let spec = key.length <= SPEC_CACHE_MAX_KEY_CHARS ? validSpecs.get(key) : undefined;
    if (spec === undefined) {
      const {
        background: _background,
        timeoutMs: _t,
        ...parsed
      } = schemas.parse(schemas.CommandBody, body);
      spec = parsed;
      if (key.length <= SPEC_CACHE_MAX_KEY_CHARS) validSpecs.set(key, spec);
    }
    // A copy per call: nothing downstream shares the cached arrays.
    return {
      ...spec,
      ...(spec.argv ? { argv: [...spec.argv] } : {}),
      ...(spec.env ? { env: { ...spec.env } } : {}),
      timeoutMs,
    };
  }

  return {
    async *start(req, ctx) {
      try {
        const sb = await open(ctx);
        const cfg = req.process;
        if (!cfg?.cmd) {
          throw new DsecError('invalid_argument', 'process.cmd is required', {
            field: 'process.cmd',
          });
        }
        const user = envdUser(requestHeadersOf(ctx));
        if (req.pty) {
          const entry = await startPty(sb, req, cfg, user, ctx);
          yield { event: { event: { case: 'start', value: { pid: entry.pid } } } };
          yield* followPty(entry, ctx);
          return;
        }
        const info = await sb.io.startCommand(sb.id, await commandSpec(sb, req, cfg, user, ctx));
        const pid = processes.rememberCommand(sb.id, info.commandId);
        yield { event: { event: { case: 'start', value: { pid } } } };
        yield* followCommand(sb, info.commandId, ctx);
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async *connect(req, ctx) {
      try {
        const sb = await open(ctx);
        const pid = selectedPid(req.process);
        const target = await processes.resolve(sb.io, sb.id, pid);
        yield { event: { event: { case: 'start', value: { pid } } } };
        if (target.kind === 'pty') yield* followPty(target.entry, ctx);
        else yield* followCommand(sb, target.commandId, ctx);
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async list(_req, ctx) {
      try {
        const sb = await open(ctx);
        const running = (await sb.io.listCommands(sb.id)).filter(
          (c) => c.state === 'running' && c.session === undefined,
        );
        const out: MessageInitShape<typeof ProcessInfoSchema>[] = running.map((c) => ({
          pid: processes.rememberCommand(sb.id, c.commandId),
          config: configOf(c),
        }));
        for (const p of processes.ptys(sb.id)) {
          out.push({ pid: p.pid, config: { cmd: p.cmd, args: p.args } });
        }
        return { processes: out };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async sendInput(req, ctx) {
      try {
        const sb = await open(ctx);
        const target = await processes.resolve(sb.io, sb.id, selectedPid(req.process));
        const input = req.input?.input;
        if (!input?.case) return {};
        await writeInput(sb, target, Buffer.from(input.value));
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async streamInput(reqs, ctx) {
      try {
        const sb = await open(ctx);
        let target: Awaited<ReturnType<ProcessTable['resolve']>> | undefined;
        for await (const r of reqs) {
          const ev = r.event;
          if (ev.case === 'start') {
            target = await processes.resolve(sb.io, sb.id, selectedPid(ev.value.process));
          } else if (ev.case === 'data') {
            if (!target) {
              throw new DsecError('invalid_argument', 'the first message must select the process');
            }
            const input = ev.value.input?.input;
            if (input?.case) await writeInput(sb, target, Buffer.from(input.value));
          }
        }
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async sendSignal(req, ctx) {
      try {
        const sb = await open(ctx);
        const pid = selectedPid(req.process);
        const target = await processes.resolve(sb.io, sb.id, pid);
        if (req.signal !== Signal.SIGKILL && req.signal !== Signal.SIGTERM) {
          throw new DsecError('invalid_argument', 'signal must be SIGTERM or SIGKILL', {
            field: 'signal',
          });
        }
        if (target.kind === 'pty') {
          target.entry.session.kill();
          return {};
        }
        // A process that has exited is gone, as in envd (the SDKs' kill() then answers false).
        const info = await sb.io.getCommand(sb.id, target.commandId);
        if (info.state !== 'running') {
          throw new DsecError('not_found', `process with pid ${pid} not found`);
        }
        if (req.signal === Signal.SIGKILL) await sb.io.killCommand(sb.id, target.commandId);
        else await sb.io.signalCommand(sb.id, target.commandId, 'SIGTERM');
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async closeStdin(req, ctx) {
      try {
        const sb = await open(ctx);
        const target = await processes.resolve(sb.io, sb.id, selectedPid(req.process));
        if (target.kind === 'pty') {
          throw new DsecError(
            'invalid_argument',
            'a terminal has no stdin to close; send Ctrl+D (0x04) instead',
          );
        }
        await stdinCall(() => sb.io.writeStdin(sb.id, target.commandId, undefined, { eof: true }));
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async update(req, ctx) {
      try {
        const sb = await open(ctx);
        const target = await processes.resolve(sb.io, sb.id, selectedPid(req.process));
        if (target.kind !== 'pty') {
          throw new DsecError('invalid_argument', 'only a terminal can be resized');
        }
        const size = req.pty?.size;
        if (size?.rows && size.cols) target.entry.session.resize(size.rows, size.cols);
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },
  };
}

function newQueue(ctx: HandlerContext, onOverflow: () => void): EventQueue<EventInit> {
  return new EventQueue<EventInit>(
    MAX_STREAM_BUFFER_BYTES,
    () => new ConnectError('client is not reading the stream', Code.ResourceExhausted),
    onOverflow,
    ctx.values.get(streamBacklogKey),
  );
}

/** Yields queued events, with keepalives while quiet (proxies and idle timeouts cut silent streams). */
async function* drain(
  queue: EventQueue<EventInit>,
  ctx: HandlerContext,
  onExit: () => void,
): AsyncGenerator<{ event: { event: EventInit } }> {
  const interval = keepaliveMs(requestHeaderOf(ctx, 'keepalive-ping-interval'));
  const timer = setInterval(() => {
    if (queue.idleMs >= interval / 2) queue.push({ case: 'keepalive', value: {} });
  }, interval);
  timer.unref();
  try {
    for await (const event of queue) yield { event: { event } };
  } finally {
    clearInterval(timer);
    onExit();
  }
}

async function writeInput(
  sb: OpenedSandbox,
  target: Awaited<ReturnType<ProcessTable['resolve']>>,
  data: Buffer,
): Promise<void> {
  if (target.kind === 'pty') target.entry.session.write(data);
  else await stdinCall(() => sb.io.writeStdin(sb.id, target.commandId, data));
}

/** DSec's `conflict` on stdin means the command was started without open stdin. */
async function stdinCall(fn: () => Promise<unknown>): Promise<void> {
  try {
    await fn();
  } catch (err) {
    const e = toDsecError(err);
    if (e.code === 'conflict') {
      throw new ConnectError(
        'this process takes no stdin: start it with stdin: true',
        Code.FailedPrecondition,
      );
    }
    throw err;
  }
}

/** PIDs only: DSec keeps no process tags. */
export function selectedPid(selector: ProcessSelector | undefined): number {
  const s = selector?.selector;
  if (s?.case === 'pid') return s.value;
  if (s?.case === 'tag') {
    throw new ConnectError('DSec selects processes by pid only, not by tag', Code.Unimplemented);
  }
  throw new DsecError('invalid_argument', 'process.pid is required', { field: 'process' });
}

/** The line of `bash|sh [-l] [-i] -c LINE`, the form the SDKs send; undefined for anything else. */
export function shellLine(cmd: string, args: string[]): string | undefined {
  const base = cmd.slice(cmd.lastIndexOf('/') + 1);
  if (!SHELLS.has(base)) return undefined;
  let i = 0;
  while (i < args.length && SHELL_FLAGS.has(args[i]!)) i++;
  if (args[i] !== '-c' || i + 2 !== args.length) return undefined;
  return args[i + 1];
}

/** envd's end event: Go's exit status words, -1 for a process that did not exit by itself. */
export function endOf(r: CommandResult): EndInit {
  if (r.outcome === 'exited') {
    return { exitCode: r.exitCode, exited: true, status: `exit status ${r.exitCode}` };
  }
  const word = signalWord(r.signal ?? 'SIGKILL');
  const error =
    r.outcome === 'timeout'
      ? 'the process ran past its timeout and was killed'
      : r.outcome === 'oom'
        ? 'the process was killed: out of memory'
        : r.reason;
  return {
    exitCode: -1,
    exited: false,
    status: `signal: ${word}`,
    ...(error ? { error } : {}),
  };
}

function signalWord(signal: string): string {
  const words: Record<string, string> = {
    SIGKILL: 'killed',
    SIGTERM: 'terminated',
    SIGINT: 'interrupt',
    SIGHUP: 'hangup',
    SIGSEGV: 'segmentation fault',
    SIGABRT: 'aborted',
    SIGPIPE: 'broken pipe',
  };
  return words[signal] ?? signal;
}

/** What `List` reports of a command: its argv, or the shell line it runs. */
function configOf(c: CommandInfo): MessageInitShape<typeof ProcessInfoSchema>['config'] {
  if (c.argv && c.argv.length > 0) return { cmd: c.argv[0]!, args: c.argv.slice(1) };
  return { cmd: '/bin/sh', args: ['-c', c.shell ?? c.line ?? ''] };
}

/** Whether the sandbox has `cmd` (absolute, or a bare name in /usr/bin or /bin). */
async function programExists(
  access: SandboxAccess,
  sb: OpenedSandbox,
  cmd: string,
  signal: AbortSignal,
): Promise<boolean> {
  if (cmd.startsWith('/')) return access.hasProgram(sb, cmd, signal);
  if (cmd.includes('/')) return false;
  return (
    (await access.hasProgram(sb, `/usr/bin/${cmd}`, signal)) ||
    (await access.hasProgram(sb, `/bin/${cmd}`, signal))
  );
}

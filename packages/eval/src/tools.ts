import { posix } from 'node:path';
import type { CommandResult, Sandbox } from '@dsec/sdk';
import type { RequestIds } from './request-ids.js';

/** A file read or written through the tools holds at most this much (a command's stdin/stdout). */
export const MAX_FILE_BYTES = 900 * 1024;
const READ_CAP_BYTES = 16 * 1024 * 1024;
const FILE_OP_TIMEOUT_MS = 60_000;
export const DEFAULT_SHELL_TIMEOUT_MS = 120_000;

export interface ShellOutcome {
  exitCode: number;
  stdout: string;
  stderr: string;
  /** `exited`, `timeout`, `killed`, … (the command log's outcome). */
  outcome: string;
  truncated: boolean;
}

export interface SandboxToolsOptions {
  sandbox: Sandbox;
  ids: RequestIds;
  /** `a` for the agent, `g` for grading: each phase numbers its own steps. */
  phase: string;
  /** The repository's path: relative paths and the shell session start there. */
  workdir: string;
  /** Request IDs the sandbox's log already held when this driver attached (counted as replayed). */
  recorded?: ReadonlySet<string> | undefined;
  /** Called once a step's command has a result (the journal records it). */
  onStep?: ((requestId: string) => void) | undefined;
  signal?: AbortSignal | undefined;
}

/**
 * A tool call the sandbox refused for a reason the caller can act on (no
 * such file, the old text is not unique, a file command failed): a model gets it
 * back as the tool's answer. Platform failures stay `DsecError`s and end the
 * task as a harness error.
 */
export class ToolError extends Error {
  override readonly name = 'ToolError';
}

/**
 * The tools an agent (and the grader) acts through: a shell session, file
 * read, write, edit and delete. Every call is a step with its own number,
 * and every command it sends carries a request ID derived from (run,
 * instance, attempt, phase, step), so a driver that restarts and repeats the
 * same calls gets the recorded results from the sandbox's command log and
 * runs nothing twice. Files go through commands (`cat`), not the files API,
 * for that reason: the files API has no request IDs, so a resumed driver
 * could neither replay a read's original content nor tell a done write from
 * a pending one.
 */
export class SandboxTools {
  readonly sandbox: Sandbox;
  readonly workdir: string;
  /** Tool calls made (each public method call is one). */
  toolCalls = 0;
  /** Commands whose request ID the log already held: answered from the log, not run. */
  replayedSteps = 0;
  readonly #o: SandboxToolsOptions;
  #step = 0;

  constructor(options: SandboxToolsOptions) {
    this.#o = options;
    this.sandbox = options.sandbox;
    this.workdir = options.workdir;
  }

  /** Runs a line in the task's shell session (cwd, env and variables persist between calls). */
  async shell(
    line: string,
    options: { timeoutMs?: number | undefined } = {},
  ): Promise<ShellOutcome> {
    const n = this.#next();
    const rid = this.#o.ids.step(this.#o.phase, n);
    const session = this.sandbox.session('agent', { cwd: this.workdir });
    const r = await this.#count(
      rid,
      session.run(line, {
        requestId: rid,
        timeoutMs: options.timeoutMs ?? DEFAULT_SHELL_TIMEOUT_MS,
        signal: this.#o.signal,
      }),
    );
    return outcomeOf(r);
  }

  /**
   * Runs a shell line (the platform's shell) as a one-shot command in
   * `workdir`: the grader's steps. `env` adds to the platform's (PATH and
   * the sandbox's creation env); `user` is a name or a uid.
   */
  async exec(
    line: string,
    options: {
      timeoutMs: number;
      maxOutputBytes?: number | undefined;
      stdin?: string | undefined;
      env?: Record<string, string> | undefined;
      user?: string | undefined;
    },
  ): Promise<ShellOutcome> {
    const n = this.#next();
    const rid = this.#o.ids.step(this.#o.phase, n);
    const r = await this.#count(
      rid,
      this.sandbox.commands.run(line, {
        cwd: this.workdir,
        requestId: rid,
        timeoutMs: options.timeoutMs,
        maxOutputBytes: options.maxOutputBytes,
        stdin: options.stdin,
        env: options.env,
        user: options.user,
        signal: this.#o.signal,
      }),
    );
    return outcomeOf(r);
  }

  /** A text file's content; undefined when it does not exist. Throws `ToolError` for a directory. */
  async readFile(path: string): Promise<string | undefined> {
    const n = this.#next();
    return this.#read(this.resolve(path), this.#o.ids.step(this.#o.phase, n));
  }

  /** Creates or replaces a file (parents made as needed); `mode` like `0o755`. */
  async writeFile(path: string, content: string, options: { mode?: number | undefined } = {}) {
    const n = this.#next();
    await this.#write(
      this.resolve(path),
      content,
      options.mode,
      this.#o.ids.step(this.#o.phase, n),
    );
  }

  /**
   * Replaces `oldText` with `newText` in a file; `oldText` must occur exactly
   * once (`ToolError` otherwise, and without the file). One step, two
   * commands: the read and the write.
   */
  async editFile(path: string, oldText: string, newText: string): Promise<void> {
    const n = this.#next();
    const abs = this.resolve(path);
    const content = await this.#read(abs, this.#o.ids.step(this.#o.phase, n, 'read'));
    if (content === undefined) throw new ToolError(`${path} does not exist`);
    if (oldText === '') throw new ToolError('the old text is empty');
    const first = content.indexOf(oldText);
    if (first < 0) throw new ToolError(`the old text does not occur in ${path}`);
    if (content.indexOf(oldText, first + 1) >= 0) {
      throw new ToolError(`the old text occurs more than once in ${path}`);
    }
    const next = content.slice(0, first) + newText + content.slice(first + oldText.length);
    await this.#write(abs, next, undefined, this.#o.ids.step(this.#o.phase, n, 'write'));
  }

  /** Removes a file; removing a missing file is fine. */
  async deleteFile(path: string): Promise<void> {
    const n = this.#next();
    const rid = this.#o.ids.step(this.#o.phase, n);
    const r = await this.#count(
      rid,
      this.sandbox.commands.run('rm -f -- "$P"', {
        env: { P: this.resolve(path) },
        requestId: rid,
        timeoutMs: FILE_OP_TIMEOUT_MS,
        signal: this.#o.signal,
      }),
    );
    if (r.exitCode !== 0) throw fileError('remove', path, r);
  }

  /** `path` inside the sandbox: relative ones are under `workdir`. */
  resolve(path: string): string {
    return posix.resolve(this.workdir, path);
  }

  #next(): number {
    this.toolCalls++;
    return ++this.#step;
  }

  async #read(abs: string, rid: string): Promise<string | undefined> {
    // Exit 10: missing, 11: a directory; the content comes back verbatim on stdout.
    const r = await this.#count(
      rid,
      this.sandbox.commands.run(
        '[ -e "$P" ] || exit 10; [ -d "$P" ] && exit 11; exec cat -- "$P"',
        {
          env: { P: abs },
          requestId: rid,
          timeoutMs: FILE_OP_TIMEOUT_MS,
          maxOutputBytes: READ_CAP_BYTES,
          signal: this.#o.signal,
        },
      ),
    );
    if (r.exitCode === 10) return undefined;
    if (r.exitCode === 11) throw new ToolError(`${abs} is a directory`);
    if (r.exitCode !== 0) throw fileError('read', abs, r);
    if (r.truncated) throw new ToolError(`${abs} is larger than ${READ_CAP_BYTES} bytes`);
    return r.stdout;
  }

  async #write(abs: string, content: string, mode: number | undefined, rid: string): Promise<void> {
    if (Buffer.byteLength(content) > MAX_FILE_BYTES) {
      throw new ToolError(`${abs}: the tools write files up to ${MAX_FILE_BYTES} bytes`);
    }
    const chmod = mode === undefined ? '' : ` && chmod ${(mode & 0o7777).toString(8)} "$P"`;
    const r = await this.#count(
      rid,
      this.sandbox.commands.run(`mkdir -p -- "$(dirname -- "$P")" && cat > "$P"${chmod}`, {
        env: { P: abs },
        stdin: content,
        requestId: rid,
        timeoutMs: FILE_OP_TIMEOUT_MS,
        signal: this.#o.signal,
      }),
    );
    if (r.exitCode !== 0) throw fileError('write', abs, r);
  }

  async #count<R extends CommandResult>(rid: string, pending: PromiseLike<R>): Promise<R> {
    if (this.#o.recorded?.has(rid)) this.replayedSteps++;
    const r = await pending;
    this.#o.onStep?.(rid);
    return r;
  }
}

function outcomeOf(r: CommandResult): ShellOutcome {
  return {
    exitCode: r.exitCode,
    stdout: r.stdout,
    stderr: r.stderr,
    outcome: r.outcome,
    truncated: r.truncated,
  };
}

function fileError(op: string, path: string, r: CommandResult): ToolError {
  return new ToolError(`cannot ${op} ${path}: exit ${r.exitCode}: ${r.stderr.trim()}`);
}

import type { Duplex, Readable } from 'node:stream';
import type { RunCommandOptions } from './edge-api.js';
import type { CommandResult, CommandSpec } from './types.js';

/**
 * The in-sandbox interface of an edge (paper 2.3, 6.2): the command log,
 * background commands, shell sessions, files, ports and terminals. Everything
 * runs through the sandbox's chronus daemon, inside the sandbox's own
 * namespaces and root, with the platform's own shell (never the sandbox's).
 */

export type CommandState = 'running' | 'finished';

/** A command as the command log keeps it (paper 6.2). */
export interface CommandInfo {
  commandId: string;
  sandboxId: string;
  /** The client's idempotency key, when it gave one. */
  requestId?: string | undefined;
  /** `requestFingerprint` of the request that started it: a reused `requestId` must match it. */
  fingerprint?: string | undefined;
  /** Set for a line run in a shell session. */
  session?: string | undefined;
  argv?: string[] | undefined;
  shell?: string | undefined;
  /** The session line. */
  line?: string | undefined;
  background: boolean;
  state: CommandState;
  startedAt: string;
  finishedAt?: string | undefined;
  /** Present once `state` is `finished`. */
  result?: CommandResult | undefined;
}

/** A command to start, with what the log and stdin streaming need. */
export interface StartCommandSpec extends CommandSpec {
  /** Idempotency key: a command with this key runs at most once per sandbox. */
  requestId?: string | undefined;
  /** Keep stdin open after `stdin` so chunks can follow (`writeStdin`, then `eof`). */
  stdinOpen?: boolean | undefined;
}

/** How long a command (or a session line) may run when it names no `timeoutMs`: the server's default. */
export const DEFAULT_COMMAND_TIMEOUT_MS = 60_000;
/** Output kept per stream when a command names no `maxOutputBytes` (head and tail; the middle is dropped). */
export const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;

/** One line run in a shell session. */
export interface SessionRunSpec {
  line: string;
  /** The line's whole stdin (otherwise /dev/null). A final newline is added if missing. */
  stdin?: string | undefined;
  timeoutMs?: number | undefined;
  maxOutputBytes?: number | undefined;
  requestId?: string | undefined;
  /** Used only when this call creates the session: the sandbox's own shell (`/bin/bash`) instead of the platform's `sh`. */
  shell?: string | undefined;
  /** Used only when this call creates the session. */
  user?: string | undefined;
  /** Used only when this call creates the session. */
  env?: Record<string, string> | undefined;
  /** Used only when this call creates the session. */
  cwd?: string | undefined;
}

export interface SessionResult extends CommandResult {
  session: string;
  /** The session's shell had died (or was killed after a timeout) and this call started a new one. */
  shellRestarted: boolean;
  /** The shell exited during this call (`exit`, `set -e`…); the next call starts a new one. */
  sessionEnded: boolean;
}

export interface SessionInfo {
  name: string;
  /** `sh` (the platform's shell) or the sandbox's shell path. */
  shell: string;
  user: string;
  /** Process ID inside the sandbox. */
  pid?: number | undefined;
  alive: boolean;
  busy: boolean;
  calls: number;
  createdAt: string;
}

export type FileType =
  'file' | 'directory' | 'symlink' | 'fifo' | 'socket' | 'char' | 'block' | 'unknown';

export interface FileInfo {
  /** The last path component. */
  name: string;
  path: string;
  type: FileType;
  size: number;
  /** Permission bits (`0o644`), setuid/setgid/sticky included. */
  mode: number;
  mtime: string;
  uid: number;
  gid: number;
  /** A symlink's target, from `stat` only. */
  target?: string | undefined;
}

export interface FileOptions {
  signal?: AbortSignal | undefined;
  /** User the operation runs as inside the sandbox (default: the sandbox's `initUser`). */
  user?: string | undefined;
}

export interface PtyOptions {
  rows?: number | undefined;
  cols?: number | undefined;
  /** The sandbox's shell to run (`/bin/bash`); default the platform's `sh`. */
  shell?: string | undefined;
  user?: string | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
  signal?: AbortSignal | undefined;
}

/** An interactive terminal in a sandbox. */
export interface PtySession {
  onOutput(cb: (chunk: Buffer) => void): void;
  write(data: Buffer): void;
  resize(rows: number, cols: number): void;
  /** Sends end-of-input (^D). */
  end(): void;
  kill(): void;
  readonly exited: Promise<{ exitCode: number; signal?: string | undefined }>;
}

export interface SandboxIoApi {
  /** Runs to completion, through the command log (see `EdgeApi.runCommand`). */
  runCommand(
    sandboxId: string,
    spec: StartCommandSpec,
    options?: RunCommandOptions,
  ): Promise<CommandResult>;
  /** Starts a background command and returns at once. A known `requestId` returns that command. */
  startCommand(sandboxId: string, spec: StartCommandSpec): Promise<CommandInfo>;
  /** Throws `command_not_found`. */
  getCommand(sandboxId: string, commandId: string): Promise<CommandInfo>;
  listCommands(sandboxId: string): Promise<CommandInfo[]>;
  /** Waits for the result; `deadline_exceeded` after `timeoutMs`, the command keeps running. */
  waitCommand(
    sandboxId: string,
    commandId: string,
    options?: { timeoutMs?: number | undefined; signal?: AbortSignal | undefined },
  ): Promise<CommandResult>;
  /**
   * Replays the output kept so far (head and tail within the cap), then live
   * output, and resolves with the result. Aborting stops watching only.
   */
  watchCommand(
    sandboxId: string,
    commandId: string,
    options?: RunCommandOptions,
  ): Promise<CommandResult>;
  /** Kills the command's whole process tree (a session call: its foreground job). */
  killCommand(sandboxId: string, commandId: string): Promise<void>;
  signalCommand(sandboxId: string, commandId: string, signal: string | number): Promise<void>;
  /** Streams bytes to a running command's stdin, with back-pressure; `eof` closes it after. */
  writeStdin(
    sandboxId: string,
    commandId: string,
    data: Readable | Buffer | undefined,
    options?: { eof?: boolean | undefined; signal?: AbortSignal | undefined },
  ): Promise<{ bytes: number }>;

  runInSession(
    sandboxId: string,
    name: string,
    spec: SessionRunSpec,
    options?: RunCommandOptions,
  ): Promise<SessionResult>;
  listSessions(sandboxId: string): Promise<SessionInfo[]>;
  /** Closing a session that does not exist is a no-op. */
  closeSession(sandboxId: string, name: string): Promise<void>;

  /** A file's bytes, streamed with back-pressure. Throws `not_found`, `invalid_argument` (a directory), `permission_denied`. */
  readFile(sandboxId: string, path: string, options?: FileOptions): Promise<Readable>;
  /** Replaces a file atomically (temp file + rename in the same directory). */
  writeFile(
    sandboxId: string,
    path: string,
    body: Readable | Buffer,
    options?: FileOptions & { mode?: number | undefined },
  ): Promise<FileInfo>;
  /** Does not follow a final symlink (`lstat`); `target` says where it points. */
  statFile(sandboxId: string, path: string, options?: FileOptions): Promise<FileInfo>;
  listDir(sandboxId: string, path: string, options?: FileOptions): Promise<FileInfo[]>;
  mkdir(
    sandboxId: string,
    path: string,
    options?: FileOptions & { parents?: boolean | undefined; mode?: number | undefined },
  ): Promise<void>;
  remove(
    sandboxId: string,
    path: string,
    options?: FileOptions & { recursive?: boolean | undefined },
  ): Promise<void>;
  rename(
    sandboxId: string,
    from: string,
    to: string,
    options?: FileOptions & { overwrite?: boolean | undefined },
  ): Promise<void>;

  /** A byte stream to `127.0.0.1:port` inside the sandbox's network namespace. */
  connectPort(
    sandboxId: string,
    port: number,
    options?: { signal?: AbortSignal | undefined },
  ): Promise<Duplex>;
  openPty(sandboxId: string, options?: PtyOptions): Promise<PtySession>;
}

/**
 * The sandbox channel: how the edge's command log, shell sessions, files,
 * ports and terminals (sessions/*) reach the inside of a sandbox, whatever
 * runs it. A channel multiplexes any number of commands; each command has
 * stdin, stdout and stderr streams, signals, a whole-tree kill, an optional
 * pty, and an exit taken from the kernel's wait status (never from output).
 * Files, ports and ptys are commands too: the platform's sealed busybox
 * (`shell: true`) runs `cat`, `stat`, `nc` or a shell inside the sandbox, so
 * a backend only has to carry commands.
 *
 * The wire format is chronus's (packages/native/PROTOCOL.md,
 * chronus-client.ts): containers serve it from a daemon that enters the
 * sandbox's namespaces; microVMs from a guest agent behind a virtio-serial
 * port. `ChronusConnection` satisfies this interface for both, and a backend
 * with another transport implements it directly.
 */
import type { CommandExit, CommandStarted, PidsLimitEvent, SpawnRequest } from '@dsec/native';

export type { CommandExit, CommandStarted, PidsLimitEvent, SpawnRequest };

/** One command started over a {@link SandboxChannel}. Register output callbacks before awaiting. */
export interface SandboxCommand {
  /** The command's pid in the sandbox; rejects (with `code`, e.g. `ENOENT`, `EAGAIN`) when it could not start. */
  readonly started: Promise<CommandStarted>;
  /** Rejects with `code: 'ECONNRESET'` when the channel dropped first. */
  readonly exited: Promise<CommandExit>;
  onStdout(cb: (chunk: Buffer) => void): this;
  onStderr(cb: (chunk: Buffer) => void): this;
  /** False when the channel's send buffer is full: wait for `channel.drained()`. */
  write(data: Buffer | string): boolean;
  endStdin(): void;
  /** Signals the command's process group. */
  signal(sig: NodeJS.Signals | number): void;
  /** SIGKILLs the command and every descendant, including ones that left its process group. */
  killTree(): void;
  /** Only for commands started with `pty`. */
  resize(rows: number, cols: number): void;
}

export interface SandboxChannel {
  /** Told when a spawn met the sandbox's pids limit (set by the channel's owner). */
  onPidsLimit: ((event: PidsLimitEvent) => void) | undefined;
  spawn(request: SpawnRequest): SandboxCommand;
  /** True once the channel is gone (closed here, or by the sandbox side). */
  readonly closed: boolean;
  /** Closes the channel; its commands not started `detached` are killed. */
  close(): void;
  /**
   * Stops reading: the sandbox side then pauses the output of every command
   * on this channel (back-pressure). A stream throttled by its reader wants
   * a dedicated channel.
   */
  pause(): void;
  resume(): void;
  /** Resolves once queued input went out. */
  drained(): Promise<void>;
}

import { createHash, randomInt } from 'node:crypto';
import { DsecError } from '@dsec/core';
import type { CommandInfo, PtySession, SandboxIoApi } from '@dsec/core';
import { BoundedMap } from '../sandbox-access.js';

/**
 * E2B names processes by PID; DSec names commands by command ID, kept by the
 * edge's command log. A command's PID here is derived from its ID (31 bits
 * of a hash), so any apiserver can find the command behind a PID from the
 * log alone; a cache spares the lookup. Terminals are live objects of the
 * apiserver that opened them, so their PIDs (random) are known there only.
 */

/** How long a terminal no stream follows lives, so that `Connect` can reattach to it. */
export const PTY_DETACHED_MS = 5 * 60_000;
/** Terminals one sandbox may have open in one apiserver. */
export const MAX_PTYS_PER_SANDBOX = 32;

/** The PID an E2B client sees for a DSec command. Never 0 (proto3's "unset"). */
export function commandPid(commandId: string): number {
  const n = createHash('sha256').update(commandId).digest().readUInt32BE(0) & 0x7fffffff;
  return n === 0 ? 1 : n;
}

/** An open terminal and the streams following it. */
export interface PtyEntry {
  pid: number;
  sandboxId: string;
  session: PtySession;
  /** Output goes to every attached stream; a terminal with none left is killed. */
  listeners: Set<(chunk: Buffer) => void>;
  exited: Promise<{ exitCode: number; signal?: string | undefined }>;
  done: boolean;
  /** Set while no stream follows the terminal: it is killed when this fires (`PTY_DETACHED_MS`). */
  detachTimer?: NodeJS.Timeout | undefined;
  /** The command the terminal runs, for `List`. */
  cmd: string;
  args: string[];
}

export type ResolvedProcess =
  { kind: 'pty'; entry: PtyEntry } | { kind: 'command'; commandId: string };

export class ProcessTable {
  readonly #ptys = new Map<string, Map<number, PtyEntry>>();
  readonly #commands = new BoundedMap<string, string>();

  /** Registers a command's PID (so a later call on it needs no log lookup). */
  rememberCommand(sandboxId: string, commandId: string): number {
    const pid = commandPid(commandId);
    this.#commands.set(`${sandboxId}\n${pid}`, commandId);
    return pid;
  }

  addPty(sandboxId: string, session: PtySession, cmd: string, args: string[]): PtyEntry {
    let bySandbox = this.#ptys.get(sandboxId);
    if (!bySandbox) this.#ptys.set(sandboxId, (bySandbox = new Map()));
    let pid = randomInt(1, 0x7fffffff);
    while (bySandbox.has(pid)) pid = randomInt(1, 0x7fffffff);
    const entry: PtyEntry = {
      pid,
      sandboxId,
      session,
      listeners: new Set(),
      exited: session.exited,
      done: false,
      cmd,
      args,
    };
    session.onOutput((chunk) => {
      for (const l of entry.listeners) l(chunk);
    });
    const table = bySandbox;
    void session.exited
      .catch(() => undefined)
      .finally(() => {
        entry.done = true;
        clearTimeout(entry.detachTimer);
        table.delete(pid);
        if (table.size === 0 && this.#ptys.get(sandboxId) === table) this.#ptys.delete(sandboxId);
      });
    table.set(pid, entry);
    return entry;
  }

  ptys(sandboxId: string): PtyEntry[] {
    return [...(this.#ptys.get(sandboxId)?.values() ?? [])];
  }

  /** Finds the terminal or command behind a PID of this sandbox; `not_found` when there is none. */
  async resolve(io: SandboxIoApi, sandboxId: string, pid: number): Promise<ResolvedProcess> {
    const pty = this.#ptys.get(sandboxId)?.get(pid);
    if (pty) return { kind: 'pty', entry: pty };
    const key = `${sandboxId}\n${pid}`;
    const cached = this.#commands.get(key);
    if (cached !== undefined) return { kind: 'command', commandId: cached };
    const found = (await io.listCommands(sandboxId)).find(
      (c: CommandInfo) => commandPid(c.commandId) === pid,
    );
    if (!found) throw new DsecError('not_found', `process with pid ${pid} not found`);
    this.#commands.set(key, found.commandId);
    return { kind: 'command', commandId: found.commandId };
  }

  /** Kills every terminal (the server is closing). */
  closeAll(): void {
    for (const table of this.#ptys.values()) {
      for (const e of table.values()) {
        clearTimeout(e.detachTimer);
        e.session.kill();
      }
    }
    this.#ptys.clear();
  }
}

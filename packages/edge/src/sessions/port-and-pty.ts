import { Duplex } from 'node:stream';
import { DsecError } from '@dsec/core';
import type { PtyOptions, PtySession } from '@dsec/core';
import type { SandboxChannel } from '../backends/channel.js';
import { DEFAULT_PATH } from './command-runner.js';
import { isUserRefusal, userRefused } from './spawn-user.js';
import type { UserField } from './spawn-user.js';

/**
 * A byte stream to `127.0.0.1:port` in the sandbox's network namespace: the
 * platform's busybox `nc`, run through chronus over a dedicated connection,
 * with the stream's reads and writes back-pressuring that connection. The
 * caller owns the stream; destroying it kills `nc` and closes the connection.
 */
export async function connectPort(
  conn: SandboxChannel,
  port: number,
  user: string,
): Promise<Duplex> {
  if (!Number.isInteger(port) || port < 1 || port > 65535) {
    conn.close();
    throw new DsecError('invalid_argument', 'port must be 1–65535', { field: 'port' });
  }
  const h = conn.spawn({
    argv: ['nc', '127.0.0.1', String(port)],
    shell: true,
    user,
    env: { PATH: DEFAULT_PATH },
    stdin: true,
  });
  let received = 0;
  let err = '';
  let finished = false;
  // `nc` can fail (nothing listens) before the consumer has attached its
  // listeners; an error emitted then would be lost and the consumer would wait
  // forever. So a failure waits for the first read or write to be delivered.
  let used = false;
  let failure: DsecError | undefined;
  const stream = new Duplex({
    read: () => {
      used = true;
      if (failure) stream.destroy(failure);
      else conn.resume();
    },
    write: (chunk: Buffer, _enc, cb) => {
      used = true;
      if (failure) return cb(failure);
      if (finished) return cb();
      if (h.write(chunk)) cb();
      else void conn.drained().then(() => cb());
    },
    final: (cb) => {
      if (!finished) h.endStdin();
      cb();
    },
    destroy: (e, cb) => {
      if (!finished) h.killTree();
      conn.close();
      cb(e);
    },
  });
  // Failures reach the consumer's own listeners; none must crash the edge meanwhile.
  stream.on('error', () => undefined);
  h.onStdout((chunk) => {
    received += chunk.length;
    if (!stream.push(chunk)) conn.pause();
  });
  h.onStderr((c) => {
    if (err.length < 2048) err += c.toString('utf8');
  });
  try {
    await h.started;
  } catch (e) {
    conn.close();
    if (isUserRefusal(e)) throw userRefused(user, 'initUser', e);
    throw new DsecError('unavailable', `cannot reach port ${port}: ${(e as Error).message}`);
  }
  h.exited.then(
    (exit) => {
      finished = true;
      if (exit.exitCode !== 0 && received === 0) {
        failure = new DsecError('unavailable', `nothing answers on port ${port} in the sandbox`, {
          details: { port, why: err.trim().slice(0, 200) },
        });
        if (used) stream.destroy(failure);
      } else {
        stream.push(null);
        conn.close();
      }
    },
    (e: unknown) => {
      finished = true;
      failure = new DsecError('unavailable', `lost the sandbox's command channel: ${String(e)}`);
      if (used) stream.destroy(failure);
    },
  );
  return stream;
}

/** An interactive shell on a new pty (chronus PTY flag), over a dedicated connection. */
export async function openPty(
  conn: SandboxChannel,
  options: PtyOptions & { user: string; userField: UserField; env: Record<string, string> },
): Promise<PtySession> {
  const h = conn.spawn({
    argv: options.shell !== undefined ? [options.shell] : ['sh'],
    shell: options.shell === undefined,
    env: { PATH: DEFAULT_PATH, TERM: 'xterm-256color', ...options.env },
    cwd: options.cwd ?? '',
    user: options.user,
    stdin: true,
    pty: { rows: options.rows ?? 24, cols: options.cols ?? 80 },
  });
  const listeners: ((chunk: Buffer) => void)[] = [];
  const early: Buffer[] = [];
  h.onStdout((chunk) => {
    if (listeners.length === 0) early.push(chunk);
    for (const l of listeners) l(chunk);
  });
  try {
    await h.started;
  } catch (e) {
    conn.close();
    if (isUserRefusal(e)) throw userRefused(options.user, options.userField, e);
    throw new DsecError('invalid_argument', `cannot start the shell: ${(e as Error).message}`, {
      field: 'shell',
    });
  }
  const exited = h.exited.then(
    (exit) => ({
      exitCode: exit.exitCode ?? 128,
      signal: exit.signal ?? undefined,
    }),
    () => ({ exitCode: 255, signal: undefined }),
  );
  void exited.finally(() => conn.close());
  return {
    onOutput(cb) {
      listeners.push(cb);
      for (const c of early.splice(0)) cb(c);
    },
    write: (data) => void h.write(data),
    resize: (rows, cols) => h.resize(rows, cols),
    end: () => h.endStdin(),
    kill: () => h.killTree(),
    exited,
  };
}

import { DsecError, namesSandboxIds } from '@dsec/core';
import type { SandboxChannel } from '../backends/channel.js';

/**
 * Users a sandbox cannot run as. The syntax and the uid range are checked
 * before anything reaches the sandbox (`checkSandboxUser`); whether a name
 * exists is the sandbox's /etc/passwd's to say, and chronus answers a spawn
 * for a user it cannot become with SPAWN_ERROR ESRCH (packages/native
 * PROTOCOL.md). Every entry point maps that to `invalid_argument` naming the
 * field the user came from: `user` when the call named one, `initUser` when
 * it ran as the sandbox's own.
 */

/** Whether a chronus spawn failure is a user the sandbox cannot run as. */
export function isUserRefusal(err: unknown): boolean {
  return (err as { code?: unknown } | undefined)?.code === 'ESRCH';
}

export type UserField = 'user' | 'initUser';

export function userRefused(user: string, field: UserField, cause?: unknown): DsecError {
  return new DsecError(
    'invalid_argument',
    `the sandbox cannot run as ${JSON.stringify(user.slice(0, 70))}: no such user in its ` +
      '/etc/passwd (or group in its /etc/group), or an id outside its range; name one the ' +
      'image defines, or a numeric uid[:gid]',
    { field, details: { user: user.slice(0, 70) }, cause },
  );
}

/** Who a call runs as, and the field to name if the sandbox cannot run as them. */
export function callUser(
  requested: string | undefined,
  initUser: string,
): { user: string; userField: UserField } {
  return requested !== undefined
    ? { user: requested, userField: 'user' }
    : { user: initUser, userField: 'initUser' };
}

/**
 * Whether a create must look for its `initUser`: one naming a user or group
 * other than root (ids in range always run; root is uid 0 and gid 0 even in
 * an image without /etc/passwd, as with `docker run`).
 */
export function needsInitUserProbe(initUser: string): boolean {
  return namesSandboxIds(initUser);
}

/**
 * Checks once, at create, that a sandbox can run as its named `initUser`: a
 * `true` of the platform's shell as that user (one spawn, only for sandboxes
 * that name one). Throws `userRefused(…, 'initUser')`.
 */
export async function probeInitUser(conn: SandboxChannel, initUser: string): Promise<void> {
  const h = conn.spawn({ argv: ['true'], shell: true, user: initUser, env: {} });
  try {
    await h.started;
  } catch (e) {
    if (isUserRefusal(e)) throw userRefused(initUser, 'initUser', e);
    throw e;
  }
  await h.exited;
}

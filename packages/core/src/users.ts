import { DsecError } from './errors.js';

/**
 * The ids inside a sandbox: every backend maps uids and gids 0 to 65535 of a
 * sandbox onto a range of its own on the host (docs/adr/0003), so a uid at
 * or above this is one no process of the sandbox can take.
 */
export const SANDBOX_ID_COUNT = 65_536;

const NAME_MAX = 32;

/**
 * Whether `user` is something a sandbox can run as, as far as can be told
 * without looking inside it: a uid below {@link SANDBOX_ID_COUNT}, or a user
 * name (`[a-z_][a-z0-9_-]*`, at most 32 characters, as useradd takes them).
 * Whether the name exists is the sandbox's /etc/passwd's to say.
 */
export function isSandboxUser(user: string): boolean {
  if (user.length === 0 || user.length > NAME_MAX) return false;
  const first = user.charCodeAt(0);
  if (first >= 48 && first <= 57) {
    if (user.length > 5) return false;
    for (let i = 0; i < user.length; i++) {
      const c = user.charCodeAt(i);
      if (c < 48 || c > 57) return false;
    }
    return Number(user) < SANDBOX_ID_COUNT;
  }
  for (let i = 0; i < user.length; i++) {
    const c = user.charCodeAt(i);
    const lower = c >= 97 && c <= 122;
    const ok = lower || c === 95 || (i > 0 && ((c >= 48 && c <= 57) || c === 45));
    if (!ok) return false;
  }
  return true;
}

/** `user`, or `invalid_argument` naming `field` when it is not {@link isSandboxUser}. */
export function checkSandboxUser(user: string, field: string): string {
  if (!isSandboxUser(user)) {
    throw new DsecError(
      'invalid_argument',
      `${field} must be a user name or a uid below ${SANDBOX_ID_COUNT}, not ${JSON.stringify(user.slice(0, 40))}`,
      { field },
    );
  }
  return user;
}

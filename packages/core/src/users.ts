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
 * without looking inside it: `USER` or `USER:GROUP` (docker's `--user`), each
 * part a uid/gid below {@link SANDBOX_ID_COUNT} or a name
 * (`[a-z_][a-z0-9_-]*`, at most 32 characters, as useradd takes them).
 * Whether a name exists is the sandbox's /etc/passwd's (or /etc/group's) to
 * say; `root` always does (uid 0, as `docker run` without `--user`).
 */
export function isSandboxUser(user: string): boolean {
  const colon = user.indexOf(':');
  if (colon < 0) return isIdPart(user);
  return isIdPart(user.slice(0, colon)) && isIdPart(user.slice(colon + 1));
}

/** Whether `user` (a valid {@link isSandboxUser}) names a user or group other than `root` by name. */
export function namesSandboxIds(user: string): boolean {
  return user.split(':').some((p) => p !== 'root' && !isNumericId(p));
}

function isNumericId(part: string): boolean {
  const first = part.charCodeAt(0);
  return first >= 48 && first <= 57;
}

function isIdPart(user: string): boolean {
  if (user.length === 0 || user.length > NAME_MAX) return false;
  if (isNumericId(user)) {
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
      `${field} must be USER or USER:GROUP, each a name or an id below ${SANDBOX_ID_COUNT}, not ${JSON.stringify(user.slice(0, 40))}`,
      { field },
    );
  }
  return user;
}

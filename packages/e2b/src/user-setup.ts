import { DsecError } from '@dsec/core';
import type { SandboxService } from '@dsec/apiserver';
import type { Principal } from '@dsec/iam';

/**
 * E2B's sandboxes run as `user` (uid 1000, home /home/user). An image that
 * lacks the user is given it at create, inside the sandbox: one command of
 * DSec's own shell, as root, appends the passwd and group entries, makes the
 * home directory owned by it, and (where the image has sudo's drop-in
 * directory) a NOPASSWD sudoers entry for that new user as E2B's images have. Every path is
 * resolved by the sandbox's own kernel view, never on the host. The sandbox
 * runs as uid:gid 1000:1000 (DSec's `initUser`; numeric ids need no entry at
 * create), which the passwd entry then names `user` with its home.
 */

/** E2B's default user. */
export const E2B_USER = 'user';
/** The DSec `initUser` an E2B `user` sandbox runs as. */
export const E2B_USER_IDS = '1000:1000';

/**
 * Idempotent: an image that has `user` keeps its entries, home and rights as
 * they are (no sudoers entry: an image that made `user` unprivileged keeps it
 * so); only a `user` this script adds gets E2B's NOPASSWD entry.
 */
export const USER_SETUP_SCRIPT = `set -e
made=
if ! grep -q '^user:' /etc/passwd 2>/dev/null; then
  grep -q '^user:' /etc/group 2>/dev/null || echo 'user:x:1000:' >> /etc/group
  login=/bin/sh
  if [ -x /bin/bash ]; then login=/bin/bash; fi
  echo "user:x:1000:1000::/home/user:$login" >> /etc/passwd
  if [ -f /etc/shadow ]; then echo 'user:*:19000:0:99999:7:::' >> /etc/shadow; fi
  made=1
fi
if [ ! -e /home/user ] && [ ! -L /home/user ]; then
  mkdir -p /home
  mkdir -m 0755 /home/user
  chown 1000:1000 /home/user
fi
if [ -n "$made" ] && [ -d /etc/sudoers.d ] && [ ! -e /etc/sudoers.d/e2b-user ] && [ ! -L /etc/sudoers.d/e2b-user ]; then
  echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/e2b-user
  chmod 0440 /etc/sudoers.d/e2b-user
fi`;

/** The longest the setup may take before the create is given up. */
const SETUP_TIMEOUT_MS = 30_000;

/**
 * Gives a new sandbox its E2B user. Throws `invalid_argument` (field
 * `templateID`) when the image cannot take it (a read-only /etc, say); the
 * caller then deletes the sandbox.
 */
export async function setUpE2bUser(
  service: SandboxService,
  principal: Principal,
  id: string,
  template: string,
  signal?: AbortSignal,
): Promise<void> {
  const r = await service.run(
    principal,
    id,
    { shell: USER_SETUP_SCRIPT, user: 'root', timeoutMs: SETUP_TIMEOUT_MS, maxOutputBytes: 4096 },
    { signal },
  );
  if (r.outcome !== 'exited' || r.exitCode !== 0) {
    const why = (r.stderr || r.stdout).trim().slice(0, 300) || r.outcome;
    throw new DsecError(
      'invalid_argument',
      `template ${JSON.stringify(template.slice(0, 200))}: the sandbox could not be given its user ` +
        `"${E2B_USER}" (uid 1000, /home/user): ${why}; give the template a user the image has ` +
        '(`user` or `initUser` in its definition), e.g. root',
      { field: 'templateID' },
    );
  }
}

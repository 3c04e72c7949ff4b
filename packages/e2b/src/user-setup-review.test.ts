/**
 * Review attack on the E2B user setup (user-setup.ts): an image that already
 * has `user` must keep it as it is. The script wrote a NOPASSWD sudoers entry
 * for `user` into any image with /etc/sudoers.d, so an image built to run the
 * agent as an unprivileged `user` (root-owned tests, sudo for root's own use)
 * handed the agent passwordless root. The script is run here by /bin/sh on
 * copies of its files under a temporary directory (every absolute path it
 * names rewritten there): the test's own files, never a sandbox's.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { USER_SETUP_SCRIPT } from './user-setup.js';

const run = promisify(execFile);

async function image(passwd: string, group: string): Promise<string> {
  const root = await mkdtemp(join(tmpdir(), 'e2b-user-setup-'));
  await mkdir(join(root, 'etc', 'sudoers.d'), { recursive: true });
  // The home exists already: the script's mkdir/chown branch is not what is tested here.
  await mkdir(join(root, 'home', 'user'), { recursive: true });
  await writeFile(join(root, 'etc', 'passwd'), passwd);
  await writeFile(join(root, 'etc', 'group'), group);
  return root;
}

async function setUp(root: string): Promise<void> {
  const script = USER_SETUP_SCRIPT.replaceAll('/etc/', `${root}/etc/`).replaceAll(
    '/home',
    `${root}/home`,
  );
  assert.ok(!/(^|[\s'"])\/(etc|home)\b/.test(script), 'a path of the script was not rewritten');
  await run('/bin/sh', ['-c', script]);
}

test("user setup: an image that has `user` gets no sudoers entry for it; one given `user` gets E2B's", async () => {
  const own = await image(
    'root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n',
    'root:x:0:\nuser:x:1000:\n',
  );
  const bare = await image('root:x:0:0::/root:/bin/sh\n', 'root:x:0:\n');
  try {
    await setUp(own);
    assert.equal(
      existsSync(join(own, 'etc', 'sudoers.d', 'e2b-user')),
      false,
      "the image's own unprivileged user was given passwordless sudo",
    );
    assert.equal(
      await readFile(join(own, 'etc', 'passwd'), 'utf8'),
      'root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n',
    );

    await setUp(bare);
    assert.match(await readFile(join(bare, 'etc', 'passwd'), 'utf8'), /^user:x:1000:1000::/m);
    assert.equal(
      await readFile(join(bare, 'etc', 'sudoers.d', 'e2b-user'), 'utf8'),
      'user ALL=(ALL:ALL) NOPASSWD: ALL\n',
    );
    // Run again (a fork, a second create from a snapshot): nothing changes.
    const before = await readFile(join(bare, 'etc', 'passwd'), 'utf8');
    await setUp(bare);
    assert.equal(await readFile(join(bare, 'etc', 'passwd'), 'utf8'), before);
  } finally {
    await rm(own, { recursive: true, force: true });
    await rm(bare, { recursive: true, force: true });
  }
});

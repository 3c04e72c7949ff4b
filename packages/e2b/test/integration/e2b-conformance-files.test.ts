import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FilesystemEventType, FileType, Sandbox } from 'e2b';
import type { FilesystemEvent } from 'e2b';
import { MAX_WATCHERS_PER_SANDBOX } from '../../src/envd/filesystem-service.js';
import { useE2b, withE2bNode } from './e2b-node.js';

/**
 * envd's filesystem behaviour as E2B's SDK suites check it (docs/e2b.md,
 * "Conformance"), through the unmodified SDK and, for the non-streaming
 * watcher RPCs the sync Python SDK uses, Connect's JSON wire directly. Every
 * call names its user (`root` or `user`), so the sandbox's default user does
 * not matter.
 */

const SANDBOX_MS = 300_000;
const ROOT = { user: 'root' } as const;
const USER = { user: 'user' } as const;

async function until(check: () => boolean, what: string, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

/** One unary Connect call (JSON) to envd's filesystem service, as the Python SDK's sync client sends it. */
async function fsRpc(
  url: string,
  key: string,
  sandboxId: string,
  method: string,
  body: unknown,
  user = 'root',
): Promise<{ status: number; body: Record<string, unknown> }> {
  const res = await fetch(`${url}/filesystem.Filesystem/${method}`, {
    method: 'POST',
    headers: {
      'content-type': 'application/json',
      'E2b-Sandbox-Id': sandboxId,
      'X-Access-Token': key,
      authorization: `Basic ${Buffer.from(`${user}:`).toString('base64')}`,
    },
    body: JSON.stringify(body),
  });
  return { status: res.status, body: (await res.json()) as Record<string, unknown> };
}

test('envd files conformance: remove, symlinks, owners, parents for a user, watchers', async (t) => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
    try {
      await t.test('removing a path that is not there succeeds, as os.RemoveAll', async () => {
        await sbx.files.remove('/tmp/never-there', ROOT);
        await sbx.files.remove('/tmp/never/there/either', USER);
        await sbx.files.write('/tmp/rm-me/x.txt', 'x', ROOT);
        await sbx.files.remove('/tmp/rm-me', ROOT);
        assert.equal(await sbx.files.exists('/tmp/rm-me', ROOT), false);
      });

      await t.test(
        "a symlink reads as its target's type with the absolute target path",
        async () => {
          await sbx.files.write('/root/links/t.txt', 'target', ROOT);
          await sbx.files.makeDir('/root/links/dir', ROOT);
          await sbx.commands.run(
            'cd /root/links && ln -s t.txt rel.txt && ln -s rel.txt chain.txt && ln -s dir dlink && ln -s missing broken',
            ROOT,
          );
          const rel = await sbx.files.getInfo('/root/links/rel.txt', ROOT);
          assert.equal(rel.name, 'rel.txt');
          assert.equal(rel.path, '/root/links/rel.txt');
          assert.equal(rel.type, FileType.FILE);
          assert.equal(rel.symlinkTarget, '/root/links/t.txt');
          // A chain resolves to its end; a relative path under the home too.
          const chain = await sbx.files.getInfo('links/chain.txt', ROOT);
          assert.equal(chain.symlinkTarget, '/root/links/t.txt');
          const dlink = await sbx.files.getInfo('/root/links/dlink', ROOT);
          assert.equal(dlink.type, FileType.DIR);
          assert.equal(dlink.symlinkTarget, '/root/links/dir');
          const broken = await sbx.files.getInfo('/root/links/broken', ROOT);
          assert.equal(broken.type, FileType.FILE);
          assert.equal(broken.symlinkTarget, '/root/links/missing');
          const listed = await sbx.files.list('/root/links', ROOT);
          assert.deepEqual(
            listed.map((e) => [e.name, e.type, e.symlinkTarget]),
            [
              ['broken', FileType.FILE, '/root/links/missing'],
              ['chain.txt', FileType.FILE, '/root/links/t.txt'],
              ['dir', FileType.DIR, undefined],
              ['dlink', FileType.DIR, '/root/links/dir'],
              ['rel.txt', FileType.FILE, '/root/links/t.txt'],
              ['t.txt', FileType.FILE, undefined],
            ],
          );
          // On the wire: never the SYMLINK value older decoders do not know.
          const raw = await fsRpc(url, adminKey, sbx.sandboxId, 'Stat', {
            path: '/root/links/rel.txt',
          });
          assert.equal(raw.status, 200);
          const entry = raw.body.entry as Record<string, unknown>;
          assert.equal(entry.type, 'FILE_TYPE_FILE');
          assert.equal(entry.symlinkTarget, '/root/links/t.txt');
        },
      );

      await t.test('attack: a symlink to a host path is resolved in the sandbox only', async () => {
        // This worktree exists on the host, not in the sandbox: the link is broken there.
        const hostDir = process.cwd();
        await sbx.commands.run(`ln -s '${hostDir}' /root/hostlink`, ROOT);
        const info = await sbx.files.getInfo('/root/hostlink', ROOT);
        assert.equal(info.type, FileType.FILE, 'a host directory must not make it a directory');
        await sbx.commands.run(`ln -s /proc/1/root/etc /root/proclink`, ROOT);
        const p = await sbx.files.getInfo('/root/proclink', ROOT);
        // Whatever /proc/1/root is in the sandbox, it is the sandbox's own root.
        assert.ok(p.symlinkTarget === undefined || !p.symlinkTarget.startsWith(hostDir));
      });

      await t.test("owners are the sandbox's names; unknown IDs stay numeric", async () => {
        const home = await sbx.files.getInfo('/home/user', ROOT);
        assert.equal(home.owner, 'user');
        assert.equal(home.group, 'user');
        const mine = await sbx.files.write('/home/user/mine.txt', 'm', USER);
        const info = await sbx.files.getInfo(mine.path, USER);
        assert.equal(info.owner, 'user');
        assert.equal(info.group, 'user');
        assert.equal((await sbx.files.getInfo('/', ROOT)).owner, 'root');
        await sbx.files.write('/tmp/odd.txt', 'o', ROOT);
        await sbx.commands.run('chown 4242:4343 /tmp/odd.txt', ROOT);
        const odd = await sbx.files.getInfo('/tmp/odd.txt', ROOT);
        assert.equal(odd.owner, '4242');
        assert.equal(odd.group, '4343');
        // A user added since the names were read is named at once.
        await sbx.commands.run(
          'echo "late:x:4242:4343::/tmp:/bin/sh" >> /etc/passwd && echo "lategrp:x:4343:" >> /etc/group',
          ROOT,
        );
        const late = await sbx.files.getInfo('/tmp/odd.txt', ROOT);
        assert.equal(late.owner, 'late');
        assert.equal(late.group, 'lategrp');
        const listed = (await sbx.files.list('/tmp', ROOT)).find((e) => e.name === 'odd.txt');
        assert.equal(listed?.owner, 'late');
      });

      await t.test(
        'attack: /etc/passwd pointing at a host file or past the size cap names nothing',
        async (st) => {
          const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-passwd-'));
          st.after(() => rm(dir, { recursive: true, force: true }));
          const hostPasswd = join(dir, 'passwd');
          await writeFile(hostPasswd, 'hostonly:x:5151:5151::/:/bin/sh\n');
          await sbx.files.write('/tmp/h.txt', 'h', ROOT);
          await sbx.commands.run(
            `cp /etc/passwd /etc/passwd.orig && chown 5151:5151 /tmp/h.txt && ln -sf '${hostPasswd}' /etc/passwd`,
            ROOT,
          );
          try {
            const h = await sbx.files.getInfo('/tmp/h.txt', ROOT);
            assert.equal(h.owner, '5151', 'the host file must not be read');
            // A passwd whose entry lies past 1 MiB: the read stops at the cap.
            await sbx.commands.run(
              'rm /etc/passwd && cp /etc/passwd.orig /etc/passwd && ' +
                "head -c 1100000 /dev/zero | tr '\\0' '#' >> /etc/passwd && " +
                'echo >> /etc/passwd && echo "far:x:5151:5151::/:/bin/sh" >> /etc/passwd',
              ROOT,
            );
            const far = await sbx.files.getInfo('/tmp/h.txt', ROOT);
            assert.equal(far.owner, '5151');
            assert.equal((await sbx.files.getInfo('/home/user', ROOT)).owner, 'user');
          } finally {
            await sbx.commands.run('cp /etc/passwd.orig /etc/passwd', ROOT);
          }
        },
      );

      await t.test(
        'writing below missing directories makes them, owned by the user, also outside its home',
        async () => {
          const w = await sbx.files.write('/usr/e2b-new/deep/f.txt', 'deep', USER);
          assert.equal(w.path, '/usr/e2b-new/deep/f.txt');
          assert.equal(await sbx.files.read('/usr/e2b-new/deep/f.txt', USER), 'deep');
          for (const d of ['/usr/e2b-new', '/usr/e2b-new/deep', '/usr/e2b-new/deep/f.txt']) {
            const info = await sbx.files.getInfo(d, ROOT);
            assert.equal(info.owner, 'user', d);
            assert.equal(info.group, 'user', d);
          }
          assert.equal((await sbx.files.getInfo('/usr', ROOT)).owner, 'root');
          // The user may now write there by itself.
          const r = await sbx.commands.run('echo more > /usr/e2b-new/deep/g.txt && id -un', USER);
          assert.equal(r.stdout, 'user\n');
          // makeDir and rename make parents for the user the same way.
          assert.equal(await sbx.files.makeDir('/usr/e2b-mk/a/b', USER), true);
          assert.equal((await sbx.files.getInfo('/usr/e2b-mk/a', ROOT)).owner, 'user');
          // Also one level, in a directory only root may write.
          assert.equal(await sbx.files.makeDir('/usr/e2b-one', USER), true);
          assert.equal((await sbx.files.getInfo('/usr/e2b-one', ROOT)).owner, 'user');
          assert.equal(await sbx.files.makeDir('/usr/e2b-one', USER), false);
          const moved = await sbx.files.rename(
            '/usr/e2b-new/deep/g.txt',
            '/usr/e2b-mv/x/g.txt',
            USER,
          );
          assert.equal(moved.path, '/usr/e2b-mv/x/g.txt');
          assert.equal((await sbx.files.getInfo('/usr/e2b-mv/x', ROOT)).owner, 'user');
          // Relative paths are the user's home.
          const rel = await sbx.files.write('rel/dir/f.txt', 'r', USER);
          assert.equal(rel.path, '/home/user/rel/dir/f.txt');
          assert.equal((await sbx.files.getInfo('/home/user/rel', ROOT)).owner, 'user');
          // Root's writes stay root's.
          await sbx.files.write('/usr/e2b-root/r.txt', 'r', ROOT);
          assert.equal((await sbx.files.getInfo('/usr/e2b-root', ROOT)).owner, 'root');
        },
      );

      await t.test('attack: parents through a file, and shell syntax in paths', async () => {
        await sbx.files.write('/tmp/plain', 'p', ROOT);
        await assert.rejects(sbx.files.write('/tmp/plain/sub/f.txt', 'x', USER));
        const odd = "/usr/e2b-$(touch /tmp/pwned)`touch /tmp/pwned2`'; x/f.txt";
        const w = await sbx.files.write(odd, 'odd', USER);
        assert.equal(w.path, odd);
        assert.equal(await sbx.files.read(odd, USER), 'odd');
        assert.equal(await sbx.files.exists('/tmp/pwned', ROOT), false);
        assert.equal(await sbx.files.exists('/tmp/pwned2', ROOT), false);
        // The user points a name in its home at root's /usr: root makes nothing through it
        // (a chown through the user's directories could be raced onto any of root's).
        await sbx.commands.run('ln -s /usr /home/user/lnk', USER);
        await assert.rejects(sbx.files.write('/home/user/lnk/e2b-evil/f.txt', 'x', USER));
        assert.equal(await sbx.files.exists('/usr/e2b-evil', ROOT), false);
        // A user the sandbox does not have is refused, not made.
        await assert.rejects(sbx.files.write('/usr/e2b-ghost/f.txt', 'x', { user: 'ghost' }));
        assert.equal(await sbx.files.exists('/usr/e2b-ghost', ROOT), false);
      });

      await t.test(
        'file metadata: stored as user.e2b. xattrs, returned by getInfo and list, replaced by each write',
        async () => {
          const w = await sbx.files.write('/home/user/meta/m.txt', 'm', {
            ...USER,
            metadata: { owner: 'alice', 'Run-Id': '42 a=b' },
          });
          assert.deepEqual(w.metadata, { owner: 'alice', 'run-id': '42 a=b' });
          const info = await sbx.files.getInfo('/home/user/meta/m.txt', USER);
          assert.deepEqual(info.metadata, { owner: 'alice', 'run-id': '42 a=b' });
          const listed = await sbx.files.list('/home/user/meta', USER);
          assert.deepEqual(listed[0]?.metadata, { owner: 'alice', 'run-id': '42 a=b' });
          // Several files in one upload get the same metadata.
          const many = await sbx.files.write(
            [
              { path: '/home/user/meta/a', data: 'a' },
              { path: '/home/user/meta/b', data: 'b' },
            ],
            { ...USER, metadata: { batch: 'x' } },
          );
          assert.deepEqual(
            many.map((f) => f.metadata),
            [{ batch: 'x' }, { batch: 'x' }],
          );
          assert.deepEqual((await sbx.files.getInfo('/home/user/meta/b', USER)).metadata, {
            batch: 'x',
          });
          // A rename keeps them; a write without metadata clears them.
          const moved = await sbx.files.rename('/home/user/meta/a', '/home/user/meta/a2', USER);
          assert.deepEqual(moved.metadata, { batch: 'x' });
          await sbx.files.write('/home/user/meta/m.txt', 'again', USER);
          assert.equal(
            (await sbx.files.getInfo('/home/user/meta/m.txt', USER)).metadata,
            undefined,
          );
          // The tool that keeps them was copied into the sandbox once.
          const r = await sbx.commands.run('ls -a /tmp', ROOT);
          const tools = r.stdout.split('\n').filter((n) => n.startsWith('.dsec-xattr-'));
          assert.equal(tools.length, 1, r.stdout);
        },
      );

      await t.test(
        'attack: bad metadata is refused before anything is written; the tool cannot be swapped by the user',
        async () => {
          const post = async (headers: Record<string, string>) =>
            fetch(
              `${url}/files?path=${encodeURIComponent('/home/user/meta/bad.txt')}&username=user`,
              {
                method: 'POST',
                headers: {
                  'E2b-Sandbox-Id': sbx.sandboxId,
                  'X-Access-Token': adminKey,
                  'content-type': 'application/octet-stream',
                  ...headers,
                },
                body: 'bad',
              },
            );
          const long = await post({ [`X-Metadata-${'k'.repeat(247)}`]: 'v' });
          assert.equal(long.status, 400);
          const big = await post({
            'X-Metadata-a': 'v'.repeat(2100),
            'X-Metadata-b': 'v'.repeat(2100),
          });
          assert.equal(big.status, 400);
          assert.equal(await sbx.files.exists('/home/user/meta/bad.txt', ROOT), false);
          // The user cannot remove or replace the root-owned tool in the sticky /tmp.
          const swap = await sbx.commands.run(
            'for f in /tmp/.dsec-xattr-*; do rm -f "$f" 2>/dev/null; echo x > "$f" 2>/dev/null; done; ls -l /tmp/.dsec-xattr-* | cut -c1-10',
            USER,
          );
          assert.equal(swap.stdout, '-rwxr-xr-x\n');
          // Metadata is read with the caller's rights: a user's symlink to a file only root
          // may read shows none of its metadata (a root-run tool followed it).
          await sbx.files.write('/root/e2b-secret.txt', 's', {
            ...ROOT,
            metadata: { secret: 's' },
          });
          await sbx.commands.run('chmod 700 /root && chmod 600 /root/e2b-secret.txt', ROOT);
          await sbx.commands.run('ln -s /root/e2b-secret.txt /home/user/meta/peek', USER);
          assert.deepEqual((await sbx.files.getInfo('/root/e2b-secret.txt', ROOT)).metadata, {
            secret: 's',
          });
          assert.equal((await sbx.files.getInfo('/home/user/meta/peek', USER)).metadata, undefined);
          const peek = (await sbx.files.list('/home/user/meta', USER)).find(
            (e) => e.name === 'peek',
          );
          assert.ok(peek);
          assert.equal(peek.metadata, undefined);
          await sbx.commands.run('rm -f /home/user/meta/peek', USER);
          // Root may remove it; the next write with metadata copies it again.
          await sbx.commands.run('rm -f /tmp/.dsec-xattr-*', ROOT);
          await sbx.files.write('/home/user/meta/again.txt', 'g', {
            ...USER,
            metadata: { k: 'v' },
          });
          assert.deepEqual((await sbx.files.getInfo('/home/user/meta/again.txt', USER)).metadata, {
            k: 'v',
          });
        },
      );

      await t.test('a new file is CREATE then WRITE on a streamed watch', async () => {
        await sbx.files.makeDir('/tmp/w1', ROOT);
        const events: FilesystemEvent[] = [];
        const handle = await sbx.files.watchDir('/tmp/w1', (e) => void events.push(e), {
          ...ROOT,
          timeoutMs: 0,
        });
        try {
          await sbx.files.write('/tmp/w1/new.txt', 'content', ROOT);
          await until(
            () => events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.WRITE),
            'the write of the new file',
          );
          const mine = events.filter((e) => e.name === 'new.txt').map((e) => e.type);
          assert.deepEqual(mine.slice(0, 2), [
            FilesystemEventType.CREATE,
            FilesystemEventType.WRITE,
          ]);
        } finally {
          await handle.stop();
        }
      });

      await t.test(
        'non-streaming watchers outlive CreateWatcher, are bounded per sandbox, and go with RemoveWatcher',
        async () => {
          await sbx.files.makeDir('/tmp/w2', ROOT);
          const created = await fsRpc(url, adminKey, sbx.sandboxId, 'CreateWatcher', {
            path: '/tmp/w2',
          });
          assert.equal(created.status, 200, JSON.stringify(created.body));
          const watcherId = created.body.watcherId as string;
          // The CreateWatcher request has ended: polls must still work.
          for (let i = 0; i < 3; i++) {
            const empty = await fsRpc(url, adminKey, sbx.sandboxId, 'GetWatcherEvents', {
              watcherId,
            });
            assert.equal(empty.status, 200, JSON.stringify(empty.body));
          }
          await sbx.files.write('/tmp/w2/a.txt', 'abc', ROOT);
          const got = await fsRpc(url, adminKey, sbx.sandboxId, 'GetWatcherEvents', {
            watcherId,
          });
          assert.equal(got.status, 200, JSON.stringify(got.body));
          assert.deepEqual(got.body.events, [
            { name: 'a.txt', type: 'EVENT_TYPE_CREATE' },
            { name: 'a.txt', type: 'EVENT_TYPE_WRITE' },
          ]);
          await sbx.files.remove('/tmp/w2/a.txt', ROOT);
          const removed = await fsRpc(url, adminKey, sbx.sandboxId, 'GetWatcherEvents', {
            watcherId,
          });
          assert.deepEqual(removed.body.events, [{ name: 'a.txt', type: 'EVENT_TYPE_REMOVE' }]);

          // The per-sandbox bound.
          const more: string[] = [];
          for (let i = 1; i < MAX_WATCHERS_PER_SANDBOX; i++) {
            const r = await fsRpc(url, adminKey, sbx.sandboxId, 'CreateWatcher', {
              path: '/tmp/w2',
            });
            assert.equal(r.status, 200, JSON.stringify(r.body));
            more.push(r.body.watcherId as string);
          }
          const over = await fsRpc(url, adminKey, sbx.sandboxId, 'CreateWatcher', {
            path: '/tmp/w2',
          });
          assert.equal(over.body.code, 'resource_exhausted', JSON.stringify(over.body));
          for (const id of more) {
            const r = await fsRpc(url, adminKey, sbx.sandboxId, 'RemoveWatcher', {
              watcherId: id,
            });
            assert.equal(r.status, 200);
          }
          const again = await fsRpc(url, adminKey, sbx.sandboxId, 'CreateWatcher', {
            path: '/tmp/w2',
          });
          assert.equal(again.status, 200);
          await fsRpc(url, adminKey, sbx.sandboxId, 'RemoveWatcher', {
            watcherId: again.body.watcherId,
          });
          const rm1 = await fsRpc(url, adminKey, sbx.sandboxId, 'RemoveWatcher', { watcherId });
          assert.equal(rm1.status, 200);
          const gone = await fsRpc(url, adminKey, sbx.sandboxId, 'GetWatcherEvents', {
            watcherId,
          });
          assert.equal(gone.body.code, 'not_found');
        },
      );
    } finally {
      await sbx.kill();
    }

    await t.test(
      "a watcher's sandbox killed: polls fail as a gone sandbox, not as a bad watcher",
      async () => {
        const other = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
        const created = await fsRpc(url, adminKey, other.sandboxId, 'CreateWatcher', {
          path: '/tmp',
        });
        assert.equal(created.status, 200);
        await other.kill();
        for (let i = 0; i < 2; i++) {
          const r = await fsRpc(url, adminKey, other.sandboxId, 'GetWatcherEvents', {
            watcherId: created.body.watcherId,
          });
          assert.notEqual(r.status, 200);
          assert.ok(
            ['unavailable', 'not_found'].includes(r.body.code as string),
            JSON.stringify(r.body),
          );
        }
      },
    );
  });
});

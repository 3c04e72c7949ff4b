import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Sandbox, SandboxNotFoundError } from 'e2b';
import { makeBusyboxRootfs } from '@dsec/images';
import { useE2b, withE2bNode } from './e2b-node.js';

/**
 * DSec's own conformance checks of E2B's control plane (issue 26), one for
 * each behaviour E2B's SDK suites check, with the unmodified `e2b` SDK
 * against a real node: the sandbox's user, isRunning while paused, snapshot
 * listing and deletion, E2B's error shape, 404 for a killed sandbox,
 * getMetrics windows, autoPause/autoResume and public ports.
 */

const SANDBOX_MS = 300_000;

async function until<T>(
  probe: () => Promise<T>,
  ok: (v: T) => boolean,
  what: string,
  timeoutMs = 60_000,
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await probe();
    if (ok(v)) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

test('E2B control plane as E2B answers it: user, paused isRunning, snapshots, errors, killed sandboxes, metrics, autoPause, public ports', async () => {
  await withE2bNode(
    async ({ node, url, adminKey }) => {
      useE2b(url, adminKey);
      // An image without E2B's user: busybox's rootfs with `user` taken out.
      const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-nouser-'));
      try {
        await makeBusyboxRootfs(dir);
        for (const f of ['etc/passwd', 'etc/group', 'etc/shadow']) {
          const text = await readFile(join(dir, f), 'utf8').catch(() => undefined);
          if (text !== undefined) {
            await writeFile(
              join(dir, f),
              text
                .split('\n')
                .filter((l) => !l.startsWith('user:'))
                .join('\n'),
            );
          }
        }
        await rm(join(dir, 'home/user'), { recursive: true, force: true });
        await node.buildLayer({ name: 'nouser', kind: 'base', from: { dir } });
      } finally {
        await rm(dir, { recursive: true, force: true });
      }

      // 1. The sandbox's user: `user` (uid 1000, /home/user), made where the image lacks it.
      const s = await Sandbox.create('nouser', { timeoutMs: SANDBOX_MS });
      const who = await s.commands.run(
        'id -u; id -un; echo "$HOME"; pwd; stat -c "%u %U %a" /home/user',
      );
      assert.deepEqual(who.stdout.trim().split('\n'), [
        '1000',
        'user',
        '/home/user',
        '/home/user',
        '1000 user 755',
      ]);
      await s.files.write('rel.txt', 'mine');
      const owned = await s.commands.run('stat -c "%u" /home/user/rel.txt');
      assert.equal(owned.stdout.trim(), '1000', 'a relative write lands in the home, as the user');
      assert.equal((await s.commands.run('id -u', { user: 'root' })).stdout.trim(), '0');
      // sudo cannot give root in a DSec sandbox: the kernel ignores setuid bits under NoNewPrivs.
      const nnp = await s.commands.run('grep NoNewPrivs /proc/self/status');
      assert.match(nnp.stdout, /NoNewPrivs:\s+1/);
      // The same setup again is a no-op (an image that has the user: busybox's own).
      const b = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      assert.equal(
        (await b.commands.run('id -un; grep -c "^user:" /etc/passwd')).stdout,
        'user\n1\n',
      );
      const r = await Sandbox.create('rooted', { timeoutMs: SANDBOX_MS });
      assert.equal(
        (await r.commands.run('id -u')).stdout.trim(),
        '0',
        'a template may run as root',
      );
      await r.kill();

      // 2. isRunning: false while paused, true once connected again.
      assert.equal(await b.isRunning(), true);
      assert.equal(await b.pause(), true);
      assert.equal(await b.isRunning(), false);
      await assert.rejects(b.commands.run('true', { requestTimeoutMs: 20_000 }));
      const back = await Sandbox.connect(b.sandboxId, { timeoutMs: SANDBOX_MS });
      assert.equal(await back.isRunning(), true);

      // 3. Snapshots: listed (paged, by sandbox), deleted once.
      const snap = await s.createSnapshot();
      const ids = async (opts?: Parameters<typeof Sandbox.listSnapshots>[0]) => {
        const pages = Sandbox.listSnapshots(opts);
        const out: string[] = [];
        while (pages.hasNext) out.push(...(await pages.nextItems()).map((x) => x.snapshotId));
        return out;
      };
      assert.ok((await ids()).includes(snap.snapshotId));
      assert.deepEqual(await ids({ sandboxId: s.sandboxId }), [snap.snapshotId]);
      assert.deepEqual(await ids({ sandboxId: back.sandboxId }), []);
      const second = await s.createSnapshot();
      assert.deepEqual(
        (await ids({ limit: 1 })).sort(),
        [snap.snapshotId, second.snapshotId].sort(),
      );
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true);
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false);
      assert.deepEqual(await ids(), [second.snapshotId]);

      // 4. E2B's error shape on an unknown E2B route.
      const unknown = await fetch(`${url}/v3/templates`, { headers: { 'x-api-key': adminKey } });
      assert.equal(unknown.status, 404);
      const body = (await unknown.json()) as { code: number; message: string };
      assert.equal(body.code, 404);
      assert.match(body.message, /E2B API has no GET \/v3\/templates/);

      // 5. getMetrics honours its window.
      const past = new Date(Date.now() - 3_600_000);
      assert.deepEqual(
        await s.getMetrics({ start: past, end: new Date(past.getTime() + 1000) }),
        [],
      );
      assert.ok((await s.getMetrics({ start: past })).length >= 0);

      // 6. A killed sandbox is not found (404) to connect, fork and snapshot.
      await s.kill();
      await assert.rejects(Sandbox.connect(s.sandboxId), SandboxNotFoundError);
      for (const path of ['fork', 'snapshots']) {
        const res = await fetch(`${url}/sandboxes/${s.sandboxId}/${path}`, {
          method: 'POST',
          headers: { 'x-api-key': adminKey, 'content-type': 'application/json' },
          body: '{}',
        });
        assert.equal(res.status, 404, path);
      }

      // 7. autoPause: the timeout pauses; autoResume: the next request resumes.
      const auto = await Sandbox.create('base', {
        timeoutMs: 3_000,
        lifecycle: { onTimeout: 'pause', autoResume: true },
      });
      await auto.files.write('/tmp/kept', 'state');
      await until(
        () => auto.getInfo(),
        (i) => i.state === 'paused',
        'the timeout to pause the sandbox',
      );
      assert.equal(
        (await auto.commands.run('cat /tmp/kept')).stdout,
        'state',
        'resumed by the request',
      );
      assert.equal((await auto.getInfo()).state, 'running');
      assert.deepEqual((await auto.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true });
      const held = await Sandbox.create('base', {
        timeoutMs: 3_000,
        lifecycle: { onTimeout: 'pause' },
      });
      await until(
        () => held.getInfo(),
        (i) => i.state === 'paused',
        'the timeout to pause',
      );
      assert.equal(await held.isRunning(), false);
      await assert.rejects(held.commands.run('true', { requestTimeoutMs: 20_000 }));
      assert.equal((await held.getInfo()).state, 'paused', 'without autoResume it stays paused');
      const woken = await Sandbox.connect(held.sandboxId, { timeoutMs: SANDBOX_MS });
      assert.equal((await woken.commands.run('echo up')).stdout, 'up\n');
      await auto.kill();
      await held.kill();

      // 8. Public ports: keyless traffic to a sandbox made public, the key required otherwise.
      const serve = async (sbx: Sandbox) => {
        await sbx.commands.run('mkdir -p /tmp/www && echo hello > /tmp/www/index.html', {
          user: 'root',
        });
        await sbx.commands.run('busybox httpd -f -p 127.0.0.1:8080 -h /tmp/www', {
          background: true,
        });
        await until(
          () =>
            sbx.commands.run('wget -qO- http://127.0.0.1:8080/').then(
              (x) => x.stdout,
              () => '',
            ),
          (t) => t === 'hello\n',
          'httpd to answer',
        );
      };
      const pub = await Sandbox.create('base', {
        timeoutMs: SANDBOX_MS,
        network: { allowPublicTraffic: true },
        lifecycle: { onTimeout: 'pause', autoResume: true },
      });
      const priv = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      await serve(pub);
      await serve(priv);
      const port = (id: string, headers: Record<string, string> = {}) =>
        fetch(`${url}/index.html`, {
          headers: { 'e2b-sandbox-id': id, 'e2b-sandbox-port': '8080', ...headers },
        });
      const open = await port(pub.sandboxId);
      assert.equal(open.status, 200);
      assert.equal(await open.text(), 'hello\n');
      assert.equal((await port(priv.sandboxId)).status, 401);
      assert.equal(
        (await port(priv.sandboxId, { 'e2b-traffic-access-token': priv.trafficAccessToken! }))
          .status,
        200,
      );
      const envd = await fetch(`${url}/files?path=/etc/passwd`, {
        headers: { 'e2b-sandbox-id': pub.sandboxId },
      });
      assert.equal(envd.status, 401, "a public sandbox's envd still needs the key");
      // Port traffic resumes an autoResume sandbox; a sandbox without it stays paused.
      assert.equal(await pub.pause(), true);
      const resumed = await port(pub.sandboxId);
      assert.equal(resumed.status, 200);
      assert.equal(await resumed.text(), 'hello\n');
      assert.equal((await pub.getInfo()).state, 'running');
      assert.equal(await priv.pause(), true);
      const token = { 'e2b-traffic-access-token': priv.trafficAccessToken! };
      assert.equal((await port(priv.sandboxId, token)).status, 502);
      assert.equal((await priv.getInfo()).state, 'paused');
      await pub.kill();
      await priv.kill();
      await back.kill();
    },
    {
      templates: {
        base: 'busybox',
        nouser: 'nouser',
        rooted: { image: 'busybox', user: 'root' },
      },
    },
  );
});

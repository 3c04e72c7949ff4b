/**
 * Issue 24 item 9: a user the sandbox cannot run as is `invalid_argument`
 * naming the field it came from, at create and in every call, instead of a
 * sandbox whose every command fails. On a real edge: a uid outside the
 * sandbox's 65536 ids, a name its /etc/passwd lacks, a passwd entry whose
 * uid is outside the range, and a user the agent deleted after create.
 */
import { copyFile, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError, randomId, type ImageStore } from '@dsec/core';
import type { DsecError } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { importOci } from '@dsec/images';
import { makeOciLayoutFromDirs } from '@dsec/images/testing/registry';
import { hostResources, makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;
const opts = { skip: root ? false : 'needs root', timeout: 180_000 };

async function refusal(p: Promise<unknown>): Promise<DsecError> {
  return p.then(
    (r) => assert.fail(`accepted: ${JSON.stringify(r)}`),
    (e: unknown) => e as DsecError,
  );
}

function assertRefused(e: DsecError, field: string, what: string): void {
  assert.ok(isDsecError(e, 'invalid_argument'), `${what}: ${String(e)}`);
  assert.equal(e.field, field, `${what}: ${e.message}`);
}

async function withEdge(
  fn: (edge: Edge, dir: string, store: ImageStore) => Promise<void>,
): Promise<void> {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  let edge: Edge | undefined;
  try {
    edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: `${dir}/edge`,
      store,
      cgroupParent,
    });
    await fn(edge, dir, store);
  } finally {
    if (edge) {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
    }
    await cleanup();
  }
}

test('create refuses an initUser the sandbox cannot run as, and leaves nothing behind', opts, () =>
  withEdge(async (edge, dir) => {
    const before = await hostResources(dir);
    for (const initUser of ['9999999999', '65536', 'mallory']) {
      const e = await refusal(
        edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec({ initUser }) }),
      );
      assertRefused(e, 'initUser', initUser);
    }
    assert.deepEqual(await hostResources(dir), before, 'a refused create leaves nothing');
    // What the sandbox can run as is accepted and used.
    for (const [initUser, uid] of [
      ['user', '1000'],
      ['1000', '1000'],
      ['65535', '65535'],
      ['root', '0'],
    ] as const) {
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p',
        spec: spec({ initUser }),
      });
      const r = await edge.runCommand(sb.id, { argv: ['id', '-u'] });
      assert.equal(r.stdout.trim(), uid, initUser);
      await edge.stopSandbox(sb.id);
    }
  }),
);

test('every call refuses a user the sandbox cannot run as, naming where it came from', opts, () =>
  withEdge(async (edge) => {
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() });
    // A passwd entry whose ids lie outside the sandbox's range: the setuid itself fails.
    await edge.io.writeFile(
      sb.id,
      '/etc/passwd',
      Buffer.from(
        'root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\nfar:x:70000:70000::/:/bin/sh\n',
      ),
    );
    for (const user of ['9999999999', '70000', 'mallory', 'far']) {
      assertRefused(
        await refusal(edge.runCommand(sb.id, { argv: ['true'], user })),
        'user',
        `exec ${user}`,
      );
      assertRefused(
        await refusal(edge.io.startCommand(sb.id, { argv: ['true'], user })),
        'user',
        `background ${user}`,
      );
      assertRefused(
        await refusal(edge.io.runInSession(sb.id, `s-${user}`, { line: 'true', user })),
        'user',
        `session ${user}`,
      );
      assertRefused(
        await refusal(edge.io.statFile(sb.id, '/etc', { user })),
        'user',
        `stat ${user}`,
      );
      assertRefused(
        await refusal(edge.io.writeFile(sb.id, '/tmp/x', Buffer.from('x'), { user })),
        'user',
        `write ${user}`,
      );
      assertRefused(await refusal(edge.io.openPty(sb.id, { user })), 'user', `pty ${user}`);
    }
    // The sandbox still works for a user it has.
    const ok = await edge.runCommand(sb.id, { argv: ['id', '-u'], user: 'user' });
    assert.equal(ok.stdout.trim(), '1000');
  }),
);

test('an initUser the agent removed afterwards is named as initUser', opts, () =>
  withEdge(async (edge) => {
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'p',
      spec: spec({ initUser: 'user' }),
    });
    await edge.runCommand(sb.id, {
      shell: "sed -i '/^user:/d' /etc/passwd",
      user: 'root',
    });
    assertRefused(await refusal(edge.runCommand(sb.id, { argv: ['true'] })), 'initUser', 'exec');
    assertRefused(await refusal(edge.io.statFile(sb.id, '/etc')), 'initUser', 'stat');
    const r = await edge.runCommand(sb.id, { argv: ['true'], user: 'root' });
    assert.equal(r.exitCode, 0);
  }),
);

test(
  'a FROM scratch image (static busybox, no /etc/passwd) runs as root; names it lacks are refused at create',
  opts,
  () =>
    withEdge(async (edge, dir, store) => {
      // Issue 25 point 5: what `docker run` accepts. One layer: the static busybox, nothing else.
      const tree = join(dir, 'scratch-tree');
      await mkdir(join(tree, 'bin'), { recursive: true });
      await copyFile('/usr/bin/busybox', join(tree, 'bin/busybox'));
      const layout = join(dir, 'scratch-oci');
      await makeOciLayoutFromDirs(layout, [tree], { Cmd: ['/bin/busybox', 'sh'] });
      await importOci(store, { path: layout, name: 'scratch-busybox', kind: 'base' });
      const image = 'scratch-busybox';
      for (const [initUser, ids] of [
        ['root', '0 0'],
        ['0', '0 0'],
        ['root:root', '0 0'],
        ['1234:4321', '1234 4321'],
      ] as const) {
        const sb = await edge.createSandbox({
          id: randomId('sb'),
          projectId: 'p',
          spec: spec({ image, initUser }),
        });
        const r = await edge.runCommand(sb.id, {
          argv: ['/bin/busybox', 'sh', '-c', 'echo $(/bin/busybox id -u) $(/bin/busybox id -g)'],
        });
        assert.equal(r.exitCode, 0, `${initUser}: ${r.stderr}`);
        assert.equal(r.stdout.trim(), ids, initUser);
        await edge.stopSandbox(sb.id);
      }
      const before = await hostResources(dir);
      for (const initUser of ['user', 'root:wheel', '0:staff']) {
        const e = await refusal(
          edge.createSandbox({
            id: randomId('sb'),
            projectId: 'p',
            spec: spec({ image, initUser }),
          }),
        );
        assertRefused(e, 'initUser', initUser);
        assert.match(e.message, /uid\[:gid\]/, 'says what to do next');
      }
      assert.deepEqual(await hostResources(dir), before, 'a refused create leaves nothing');
    }),
);

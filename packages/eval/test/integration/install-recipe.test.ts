/**
 * Issue 25 point 4: an `install` recipe runs its commands in a builder
 * sandbox under its egress policy, and the sandbox's writable layer becomes a
 * platform toolkit. On a real single node behind the tests' own fake
 * internet (packages/edge/test/integration/fake-internet.ts): only hosts this
 * test creates are ever reached. Also the attacks: a command reaching past
 * its policy, one that fills the disk, one that forks without end; each
 * fails the build with the recipe and command named, and no builder sandbox
 * or half-made layer is left.
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { isDsecError, type DsecError, type LayerInfo } from '@dsec/core';
import { ensureEnvironment, type InstallRecipe } from '@dsec/images';
import { clusterInstallRunner } from '../../src/index.js';
import {
  startEgressNode,
  type EgressNode,
} from '../../../edge/test/integration/network-helpers.js';

const skip = process.getuid?.() === 0 ? false : 'needs root';
let egress: EgressNode;

before(async () => {
  if (skip) return;
  egress = await startEgressNode('dsec-install-it-');
});

after(async () => {
  await egress?.close();
});

/** The node's sandboxes: a build must leave none. */
async function sandboxCount(): Promise<number> {
  return (await egress.node.edge.listSandboxes({})).length;
}

function runner() {
  // Tight limits: what the attack commands run into (disk, pids, time).
  return clusterInstallRunner(egress.client, {
    memoryLimitMb: 256,
    cpuCoresLimit: 1,
    pidsLimit: 64,
    diskLimitMb: 32,
  });
}

async function build(
  name: string,
  recipe: Omit<InstallRecipe, 'kind' | 'base'>,
  workspace?: LayerInfo,
) {
  const recipes = { busybox: BASE, [name]: { kind: 'install', base: 'busybox', ...recipe } };
  return await ensureEnvironment(egress.node.store, name, recipes as never, {
    cacheDir: `${egress.work}/cache`,
    installer: runner(),
    workspace,
  });
}

// The node's busybox layer stands for a base recipe's product: ensureEnvironment would rebuild
// a base it has no record of, so the record is seeded below instead of running debootstrap.
const BASE = { kind: 'base', debootstrap: { suite: 'bookworm' } } as const;

async function seedBaseRecord(): Promise<void> {
  const { mkdir, writeFile } = await import('node:fs/promises');
  const { recipeDigest } = await import('@dsec/images');
  const layer = await egress.node.store.getLayer('busybox');
  await mkdir(`${egress.work}/cache/environments`, { recursive: true });
  await writeFile(
    `${egress.work}/cache/environments/busybox_latest.json`,
    JSON.stringify({
      name: 'busybox',
      ref: 'busybox:latest',
      recipeDigest: recipeDigest(BASE),
      layerDigest: layer.digest,
      builtAt: new Date().toISOString(),
    }),
  );
}

async function refused(p: Promise<unknown>): Promise<DsecError> {
  return await p.then(
    () => assert.fail('the build succeeded'),
    (e: unknown) => e as DsecError,
  );
}

test(
  'an install recipe builds in a sandbox under its egress policy and becomes a toolkit',
  { skip },
  async () => {
    await seedBaseRecord();
    const recipe = {
      commands: [
        'mkdir -p /opt/env && echo installed > /opt/env/marker',
        // The policy's domain only: the fake internet's web server at allowed.test.
        "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 allowed.test 80 > /opt/env/page",
      ],
      egress: { allow: ['allowed.test'] },
      workdir: '/opt',
      env: { DSEC_BUILD: 'yes' },
    };
    const first = await build('env-ok', recipe);
    assert.equal(first.built, true);
    const layer: LayerInfo = first.layer;
    assert.equal(layer.kind, 'toolkit');
    assert.equal(layer.source, 'install');
    assert.equal(layer.project, undefined, 'a platform layer');
    assert.deepEqual(layer.parents, ['busybox:latest']);
    assert.equal(await sandboxCount(), 0, 'the builder sandbox is gone');
    // The snapshot's own record went; its blob is the toolkit's.
    const all = await egress.node.store.listLayers();
    assert.deepEqual(
      all.filter((l) => l.name.startsWith('env-ok')).map((l) => `${l.project ?? ''}/${l.name}`),
      ['/env-ok'],
    );
    // A sandbox on the toolkit sees what the commands made.
    const sb = await egress.client.runContainer({ image: 'busybox', toolkits: ['env-ok'] });
    try {
      assert.equal((await sb.runShell('cat /opt/env/marker')).stdout, 'installed\n');
      assert.match((await sb.runShell('cat /opt/env/page')).stdout, /^HTTP\/1\.[01] 200/);
    } finally {
      await sb.stop();
    }
    // Same inputs: nothing to build. A changed command: built again.
    assert.equal((await build('env-ok', recipe)).built, false);
    const changed = await build('env-ok', {
      ...recipe,
      commands: [...recipe.commands, 'echo again >> /opt/env/marker'],
    });
    assert.equal(changed.built, true);
    assert.notEqual(changed.recipeDigest, first.recipeDigest);
    assert.equal(await sandboxCount(), 0);
  },
);

test(
  'an install recipe on the task workspace (pip install -e . style) is built per workspace',
  { skip },
  async () => {
    await seedBaseRecord();
    const { mkdir, writeFile } = await import('node:fs/promises');
    const tree = `${egress.work}/ws-tree`;
    await mkdir(`${tree}/repo`, { recursive: true });
    await writeFile(`${tree}/repo/setup.txt`, 'name = demo\n');
    const ws = await egress.node.buildLayer({
      name: 'ws-demo',
      kind: 'workspace',
      from: { dir: tree },
    });
    const recipe = {
      workspace: true,
      workdir: '/repo',
      // Reads the repository and writes beside it, as `pip install -e .` writes its egg-info.
      commands: ['cat setup.txt > installed.txt', 'mkdir -p /opt/ws && cp setup.txt /opt/ws/'],
    };
    const e = await refused(build('env-ws', recipe));
    assert.ok(isDsecError(e, 'invalid_argument') && e.field === 'env-ws.workspace', String(e));
    const r = await build('env-ws', recipe, ws);
    assert.equal(r.built, true);
    assert.match(r.layer.name, /^env-ws\.ws-[0-9a-f]{32}$/);
    assert.deepEqual(r.layer.parents, ['busybox:latest', 'ws-demo:latest']);
    assert.equal((await build('env-ws', recipe, ws)).built, false);
    const sb = await egress.client.runContainer({
      image: 'busybox',
      workspace: 'ws-demo',
      toolkits: [r.layer.name],
    });
    try {
      assert.equal(
        (await sb.runShell('cat /repo/installed.txt /opt/ws/setup.txt')).stdout,
        'name = demo\nname = demo\n',
      );
    } finally {
      await sb.stop();
    }
    assert.equal(await sandboxCount(), 0);
  },
);

test(
  'attacks: past the egress policy, filling the disk, forking without end',
  { skip },
  async () => {
    await seedBaseRecord();
    const cases: [string, Omit<InstallRecipe, 'kind' | 'base'>, number][] = [
      // denied.test is a host of the fake internet the policy does not name (no answer for it),
      // and its address dialled directly is not reachable either: the policy allows names only.
      [
        'esc-domain',
        {
          commands: ["printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 denied.test 80 | grep -q HTTP"],
          egress: { allow: ['allowed.test'] },
        },
        0,
      ],
      [
        'esc-ip',
        {
          commands: [
            `printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 ${egress.fake.deniedIp} 80 | grep -q HTTP`,
          ],
          egress: { allow: ['allowed.test'] },
        },
        0,
      ],
      [
        'esc-none',
        {
          commands: [
            'true',
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 allowed.test 80 | grep -q HTTP",
          ],
          egress: 'none',
        },
        1,
      ],
      [
        'fill-disk',
        { commands: ['dd if=/dev/zero of=/big bs=1M count=256 && sync'], timeoutSeconds: 60 },
        0,
      ],
      [
        'fork-bomb',
        {
          commands: ['i=0; while [ $i -lt 500 ]; do sleep 30 & i=$((i+1)); done; wait'],
          timeoutSeconds: 10,
        },
        0,
      ],
    ];
    for (const [name, recipe, index] of cases) {
      const e = await refused(build(name, recipe));
      assert.ok(isDsecError(e, 'invalid_argument'), `${name}: ${String(e)}`);
      assert.equal(e.field, `${name}.commands.${index}`, name);
      const d = e.details as { reason?: string; recipe?: string; command?: string };
      assert.equal(d.reason, 'install_command_failed', name);
      assert.equal(d.recipe, name);
      assert.equal(d.command, recipe.commands[index]);
      assert.match(e.message, new RegExp(`install recipe ${name}: command ${index + 1}`));
      assert.equal(await sandboxCount(), 0, `${name}: the builder sandbox is gone`);
      await assert.rejects(egress.node.store.getLayer(name), (x: unknown) =>
        isDsecError(x, 'image_not_found'),
      );
      assert.ok(
        !(await egress.node.store.listLayers()).some((l) => l.name.startsWith(`${name}-install-`)),
        `${name}: no snapshot left`,
      );
    }
    // What reached the fake internet: never denied.test's address.
    const hits = await egress.fake.log();
    assert.ok(
      !hits.some((h) => JSON.stringify(h).includes(egress.fake.deniedIp)),
      JSON.stringify(hits),
    );
    // The node still works after the disk filler and the fork bomb.
    const sb = await egress.client.runContainer({ image: 'busybox' });
    try {
      assert.equal((await sb.runShell('echo ok')).stdout, 'ok\n');
    } finally {
      await sb.stop();
    }
  },
);

import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { isDsecError, type DsecError } from '@dsec/core';
import { hostErofsMounter } from '@dsec/edge';
import { listImages, registrySettings } from '@dsec/images';
import { startLocalRegistry, type LocalRegistry } from '@dsec/images/testing/registry';
import { DSecClient } from '@dsec/sdk';
import { importTaskImages, swebenchImageRef, type TaskImageProgress } from '../../src/index.js';
import {
  pushSwebenchImages,
  TESTBED_ENV_BIN,
  type PushedSwebenchImages,
} from '../../src/testing/index.js';

// SWE-bench-shaped images (shared base layers, the repository at /testbed,
// a conda `testbed` environment) pushed to Debian's docker-registry on
// loopback, imported by convention on first use, and run in a sandbox with
// the image's own Env and WorkingDir. Needs root, skopeo and docker-registry.

let dir: string;
let registry: LocalRegistry;
let node: SingleNode;
let pushed: PushedSwebenchImages;
const IDS = ['demo__calc-1', 'demo__calc-2'];

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-task-images-'));
  await chmod(dir, 0o711);
  registry = await startLocalRegistry({ dir: join(dir, 'registry') });
  pushed = await pushSwebenchImages({
    registry: registry.host,
    dir: join(dir, 'images'),
    instances: IDS.map((instanceId, i) => ({
      instanceId,
      files: { 'calc.py': `def add(a, b):\n    return a - b  # ${i}\n`, README: `${instanceId}\n` },
    })),
  });
  node = await startSingleNode({
    stateDir: join(dir, 'state'),
    port: 0,
    network: { mode: 'none' },
    cgroupParent: `dsec-test-${basename(dir)}`,
  });
});

after(async () => {
  await node?.close({ stopSandboxes: true }).catch(() => undefined);
  await registry?.close();
  if (dir) {
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/dsec-test-${basename(dir)}`).catch(() => undefined);
    await rm(dir, { recursive: true, force: true });
  }
});

test('images by convention: imported once, base layers shared, a missing one fails alone, the image config reaches the sandbox', async () => {
  const refs = IDS.map((id) => swebenchImageRef(pushed.template, id));
  const missing = swebenchImageRef(pushed.template, 'demo__calc-404');
  // The registry is insecure by the node's settings, not by a flag.
  const registries = registrySettings(undefined, { DSEC_INSECURE_REGISTRIES: registry.host });
  const mounter = hostErofsMounter({ probeDir: join(dir, 'probe') });
  const seen: TaskImageProgress[] = [];
  const first = await importTaskImages([...refs, missing, refs[0]!], {
    store: node.store,
    registries,
    mounter,
    concurrency: 1,
    onProgress: (p) => seen.push(p),
  });
  assert.deepEqual([...first.keys()], [...refs, missing]);
  assert.equal(first.get(refs[0]!), 'sweb.eval.x86_64.demo_1776_calc-1:latest');
  assert.equal(first.get(refs[1]!), 'sweb.eval.x86_64.demo_1776_calc-2:latest');
  const err = first.get(missing) as DsecError;
  assert.ok(isDsecError(err, 'image_not_found'), String(err));
  assert.equal(seen.at(-1)?.done, 3);

  // Two shared layers and one top per image: four conversions, not six.
  const all = await listImages(node.store, { all: true });
  assert.equal(all.filter((l) => l.name === 'oci-diff').length, 4);
  const b = all.find((l) => l.name === 'sweb.eval.x86_64.demo_1776_calc-2')!;
  assert.deepEqual(
    b.parents?.slice(0, 2),
    pushed.sharedDiffIds.map((d) => `oci-diff:${d.slice('sha256:'.length)}`),
  );
  assert.equal(b.config?.workingDir, '/testbed/');

  // A second call imports nothing: one lookup per image.
  const again: TaskImageProgress[] = [];
  const second = await importTaskImages(refs, {
    store: node.store,
    registries,
    mounter,
    onProgress: (p) => again.push(p),
  });
  assert.deepEqual([...second.values()], [...first.values()].slice(0, 2));
  assert.deepEqual(
    again.map((p) => p.state),
    ['present', 'present'],
  );

  const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
  await client.open();
  try {
    const sb = await client.runContainer(
      { image: first.get(refs[1]!) as string, memoryLimitMb: 256, cpuCoresLimit: 1 },
      { timeoutMs: 120_000 },
    );
    try {
      // What SWE-bench's eval script does first, under bash as its scripts run.
      const run = await sb.runShell(
        'pwd; echo "$PATH"; bash -c \'source /opt/miniconda3/bin/activate && conda activate testbed && ' +
          'command -v python && python -c "import dsec_testbed_env, pytest; print(dsec_testbed_env.NAME)" && ' +
          "git -C /testbed rev-parse HEAD && git -C /testbed status --porcelain | wc -l'",
      );
      assert.equal(run.exitCode, 0, run.stderr);
      const [pwd, path, python, envName, commit, dirty] = run.stdout.trim().split('\n');
      assert.equal(pwd, '/testbed');
      assert.ok(path!.startsWith('/opt/miniconda3/bin:'), path);
      assert.equal(python, `${TESTBED_ENV_BIN}/python`);
      assert.equal(envName, 'testbed');
      assert.equal(commit, pushed.images.get(IDS[1]!)!.baseCommit);
      assert.equal(dirty?.trim(), '0');
      // A command naming its own cwd still gets it.
      const tmp = await sb.runShell('pwd', { cwd: '/tmp' });
      assert.equal(tmp.stdout.trim(), '/tmp');
    } finally {
      await sb.stop();
    }
  } finally {
    client.close();
  }
});

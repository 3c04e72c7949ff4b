/**
 * Composable layers end to end through the in-process single-node cluster:
 * SDK → apiserver → edge → layer cache → idmapped overlay → runc.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readdir, readFile, mkdir, mkdtemp, rm, stat, writeFile, chmod } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import type { LayerInfo } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';

async function writeFiles(root: string, files: Record<string, string>): Promise<void> {
  for (const [path, content] of Object.entries(files)) {
    await mkdir(join(root, path, '..'), { recursive: true });
    await writeFile(join(root, path), content, { mode: path.includes('/bin/') ? 0o755 : 0o644 });
  }
}

// The container backend's per-sandbox directory (ContainerBackend.paths).
function upperDir(stateDir: string, id: string): string {
  const name = 'dsec-' + createHash('sha256').update(id).digest('hex').slice(0, 20);
  return join(stateDir, 'edge', 'sandboxes', name, 'upper');
}

/** Mount points of EROFS layers in the edge's layer cache, by mount directory. */
async function layerMounts(stateDir: string): Promise<string[]> {
  const prefix = join(stateDir, 'edge', 'layers') + '/';
  return (await readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .filter((l) => l.includes(' - erofs '))
    .map((l) => l.split(' ')[4] ?? '')
    .filter((p) => p.startsWith(prefix));
}

function mountDirOf(stateDir: string, layer: LayerInfo): string {
  return join(
    stateDir,
    'edge',
    'layers',
    layer.digest.slice('sha256:'.length, 'sha256:'.length + 32),
  );
}

/** Files loop devices are bound to (none is ours unless the edge mounts layers through loop devices). */
async function loopBackingFiles(): Promise<string[]> {
  const out: string[] = [];
  for (const dev of await readdir('/sys/block').catch(() => [])) {
    if (!dev.startsWith('loop')) continue;
    const f = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
    if (f.trim()) out.push(f.trim());
  }
  return out;
}

async function sha256File(path: string): Promise<string> {
  return (
    'sha256:' +
    createHash('sha256')
      .update(await readFile(path))
      .digest('hex')
  );
}

void describe('layers: base + workspace + toolkits through a real sandbox', () => {
  let work: string;
  let stateDir: string;
  let node: SingleNode;
  let client: DSecClient;
  const sandboxes: Sandbox[] = [];
  const layers: Record<string, LayerInfo> = {};

  const sh = async (sb: Sandbox, cmd: string): Promise<string> => {
    const r = await sb.runShell(cmd);
    assert.equal(r.exitCode, 0, `${cmd}: ${r.stderr}`);
    return r.stdout;
  };
  const create = async (toolkits: string[]): Promise<Sandbox> => {
    const sb = await client.runContainer({
      image: 'lbase',
      workspace: 'lws:1',
      toolkits,
      memoryLimitMb: 128,
      cpuCoresLimit: 1,
    });
    sandboxes.push(sb);
    return sb;
  };

  before(async () => {
    work = await mkdtemp(join(tmpdir(), 'dsec-layers-'));
    await chmod(work, 0o711);
    stateDir = join(work, 'state');
    node = await startSingleNode({ stateDir, port: 0 });
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();

    const base = join(work, 'base');
    await makeBusyboxRootfs(base);
    await writeFiles(base, {
      'opt/shared/from-base': 'base\n',
      'etc/prio-bw': 'base\n',
      'etc/prio-all': 'base\n',
    });
    await writeFiles(join(work, 'ws'), {
      'workspace/repo/main.py': 'print("hi")\n',
      'opt/shared/from-ws': 'ws\n',
      'etc/prio-bw': 'ws\n',
      'etc/prio-wt': 'ws\n',
      'etc/prio-all': 'ws\n',
    });
    await writeFiles(join(work, 't1v1'), {
      'opt/t1/bin/tool': '#!/bin/sh\necho t1 v1\n',
      'opt/t1/lib/mod.py': 'x = 1\n',
      'opt/shared/from-t1': 't1\n',
      'etc/prio-wt': 't1\n',
      'etc/prio-all': 't1\n',
    });
    await writeFiles(join(work, 't1v2'), {
      'opt/t1/bin/tool': '#!/bin/sh\necho t1 v2\n',
      'opt/t1/lib/mod.py': 'x = 2\n',
      'opt/shared/from-t1': 't1\n',
      'etc/prio-wt': 't1\n',
      'etc/prio-all': 't1\n',
    });
    await writeFiles(join(work, 't2'), {
      'opt/t2/lib/mod.py': 'y = 1\n',
      'opt/shared/from-t2': 't2\n',
      'etc/prio-all': 't2\n',
    });
    layers.base = await node.buildLayer({ name: 'lbase', kind: 'base', from: { dir: base } });
    layers.ws = await node.buildLayer({
      name: 'lws',
      version: '1',
      kind: 'workspace',
      from: { dir: join(work, 'ws') },
      split: true,
    });
    layers.t1 = await node.buildLayer({
      name: 'lt1',
      version: '1',
      kind: 'toolkit',
      from: { dir: join(work, 't1v1') },
    });
    layers.t2 = await node.buildLayer({
      name: 'lt2',
      version: '1',
      kind: 'toolkit',
      from: { dir: join(work, 't2') },
    });
  });

  after(async () => {
    for (const sb of sandboxes) await sb.stop().catch(() => undefined);
    client?.close();
    await node?.close({ stopSandboxes: true });
    if (work) await rm(work, { recursive: true, force: true });
  });

  void test('files merge, priority is toolkit > workspace > base, the last toolkit wins', async () => {
    const sb = await create(['lt1:1', 'lt2:1']);
    assert.equal(
      await sh(sb, 'ls /opt/shared | tr "\\n" " "'),
      'from-base from-t1 from-t2 from-ws ',
    );
    assert.equal(await sh(sb, 'cat /etc/prio-bw /etc/prio-wt /etc/prio-all'), 'ws\nt1\nt2\n');
    // Appending never hides a whole directory: the base's /etc and /bin are all there.
    assert.match(await sh(sb, 'ls /etc; ls /bin | head -3'), /passwd/);
    assert.equal(await sh(sb, '/opt/t1/bin/tool'), 't1 v1\n');
    assert.equal(await sh(sb, 'cat /workspace/repo/main.py'), 'print("hi")\n');
  });

  void test('writes land in the upper dir; tools write into their own tree; layers stay untouched', async () => {
    const sb = await create(['lt1:1', 'lt2:1']);
    await sh(
      sb,
      [
        'echo new > /workspace/repo/new.txt',
        'mkdir -p /opt/t2/lib/__pycache__ && echo pyc > /opt/t2/lib/__pycache__/mod.cpython.pyc',
        'echo changed >> /opt/t1/lib/mod.py',
        'rm /opt/shared/from-base',
      ].join(' && '),
    );
    assert.equal(await sh(sb, 'ls /opt/shared | tr "\\n" " "'), 'from-t1 from-t2 from-ws ');
    const upper = upperDir(stateDir, sb.id);
    assert.equal(await readFile(join(upper, 'workspace/repo/new.txt'), 'utf8'), 'new\n');
    assert.equal(
      await readFile(join(upper, 'opt/t2/lib/__pycache__/mod.cpython.pyc'), 'utf8'),
      'pyc\n',
    );
    assert.equal(await readFile(join(upper, 'opt/t1/lib/mod.py'), 'utf8'), 'x = 1\nchanged\n');
    assert.ok(
      (await stat(join(upper, 'opt/shared/from-base'))).isCharacterDevice(),
      'deletion is a whiteout in upper',
    );
    // Every layer blob still hashes to its digest.
    for (const l of Object.values(layers)) {
      assert.equal(await sha256File(await node.store.blobPath(l.digest)), l.digest);
      if (l.blobDigest)
        assert.equal(await sha256File(await node.store.blobPath(l.blobDigest)), l.blobDigest);
    }
    // A sibling sandbox sees pristine layers.
    const other = await create(['lt1:1', 'lt2:1']);
    assert.equal(await sh(other, 'ls -A /opt/t2/lib; ls -A /workspace/repo'), 'mod.py\nmain.py\n');
    assert.equal(await sh(other, 'cat /opt/t1/lib/mod.py /opt/shared/from-base'), 'x = 1\nbase\n');
  });

  void test('upgrading a toolkit builds one new layer; old sandboxes keep v1, new ones get v2', async () => {
    const old = await create(['lt1:1', 'lt2:1']);
    const before = await node.store.listLayers();
    const v2 = await node.buildLayer({
      name: 'lt1',
      version: '2',
      kind: 'toolkit',
      from: { dir: join(work, 't1v2') },
    });
    const after = await node.store.listLayers();
    assert.deepEqual(
      after
        .filter((l) => !before.some((b) => b.name === l.name && b.version === l.version))
        .map((l) => `${l.name}:${l.version}`),
      ['lt1:2'],
      'exactly one layer was built',
    );
    for (const l of before) {
      const now = after.find((a) => a.name === l.name && a.version === l.version);
      assert.equal(now?.digest, l.digest, `${l.name}:${l.version} unchanged`);
    }
    assert.notEqual(v2.digest, layers.t1!.digest);
    const fresh = await create(['lt1:2', 'lt2:1']);
    assert.equal(await sh(fresh, '/opt/t1/bin/tool; cat /opt/t1/lib/mod.py'), 't1 v2\nx = 2\n');
    assert.equal(await sh(old, '/opt/t1/bin/tool; cat /opt/t1/lib/mod.py'), 't1 v1\nx = 1\n');
    // Both versions mounted side by side, the shared layers once.
    const mounts = await layerMounts(stateDir);
    assert.ok(mounts.includes(mountDirOf(stateDir, layers.t1!)));
    assert.ok(mounts.includes(mountDirOf(stateDir, v2)));
  });

  void test('parallel creates mount each shared layer exactly once, without loop devices', async () => {
    await writeFiles(join(work, 't3'), { 'opt/t3/data': 'fresh toolkit\n' });
    const t3 = await node.buildLayer({
      name: 'lt3',
      version: '1',
      kind: 'toolkit',
      from: { dir: join(work, 't3') },
      split: true,
    });
    const created = await Promise.all(Array.from({ length: 6 }, () => create(['lt3:1'])));
    for (const sb of created) assert.equal(await sh(sb, 'cat /opt/t3/data'), 'fresh toolkit\n');
    const mounts = await layerMounts(stateDir);
    for (const l of [layers.base!, layers.ws!, t3]) {
      assert.equal(
        mounts.filter((m) => m === mountDirOf(stateDir, l)).length,
        1,
        `${l.name} mounted once`,
      );
    }
    // The split layers' metadata is a local copy under the edge's state dir; data comes from the store.
    const meta = await readdir(join(stateDir, 'edge', 'layers', '.meta'));
    assert.ok(
      meta.includes(t3.digest.slice(7)) && meta.includes(layers.ws!.digest.slice(7)),
      meta.join(),
    );
    const backing = (await loopBackingFiles()).filter((f) => f.startsWith(stateDir));
    if (process.env.DSEC_EROFS_MOUNT === 'loop') {
      // Loop mode (older kernels): one device per mounted image or blob, none twice.
      assert.ok(backing.length > 0);
      assert.equal(new Set(backing).size, backing.length, backing.join());
    } else assert.deepEqual(backing, []);
  });
});

/**
 * Harbor task directories end to end on a single node: two of the shipped
 * tasks (all four with DSEC_HARBOR_ALL_TASKS=1) with `--agent oracle`
 * (reward 1) and `none` (0), then the attacks an agent can make on the
 * verifier, each written as a task whose `solution/solve.sh` is the attack
 * (`--agent oracle` runs it as the agent). The base is the Debian bookworm
 * root the demo mirrors into its registry (`ensureDebianLayout`, cached
 * under /var/cache/dsec); a task's Dockerfile is stood in for by layers on
 * it (`emulatedBuild`: its apt packages as a toolkit, its COPYs as a
 * workspace), so no base is rebuilt per task; and one of them (no RUN
 * step, so no build network) is built for real by `buildDockerfile` FROM
 * the image pushed to a registry on loopback. Needs root, runc, buildah
 * and Debian's mirror on the first run (debootstrap, apt).
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, cp, mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { DSecClient } from '@dsec/sdk';
import { buildDockerfile, buildFromDebs, registrySettings } from '@dsec/images';
import { mountErofs, unmount } from '@dsec/native';
import {
  NoneAgent,
  OracleAgent,
  loadHarborTasks,
  runHarbor,
  type Agent,
  type HarborEnvironment,
  type HarborEnvironmentBuilder,
  type HarborResult,
  type HarborTask,
} from '../../src/index.js';
import { ensureDebianLayout, startDebianRegistry } from '../../src/testing/debian-registry.js';

const REPO = resolve(fileURLToPath(new URL('../../../..', import.meta.url)));
const SHIPPED = join(REPO, 'examples/harbor-tasks');

let node: SingleNode;
let client: DSecClient;
let work: string;
let image: string;

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-harbor-it-'));
  await chmod(work, 0o711);
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'harbor-node' });
  const { layout } = await ensureDebianLayout();
  const layer = await node.buildLayer({
    name: 'debian-harbor',
    kind: 'base',
    from: { dir: join(layout, '..', 'rootfs') },
  });
  image = `${layer.name}:${layer.version}`;
  client = new DSecClient({ url: node.url, apiKey: node.adminKey });
});

after(async () => {
  client?.close();
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

/** Where the emulated builds keep apt's state and .debs between runs (apt resolves on the host). */
const DEBS_CACHE = '/var/cache/dsec/harbor-test-debs';

/**
 * A stand-in for the Dockerfile build, for the shipped tasks' simple
 * Dockerfiles (`FROM` the Debian base, `RUN apt-get install … PKGS`,
 * `COPY SRC DEST`): the packages become a toolkit layer on the base
 * (`buildFromDebs`), the copied files a workspace layer. The layers are
 * what the build would make, without building the same base per task.
 */
async function emulatedBuild(task: HarborTask): Promise<HarborEnvironment> {
  const text = (await readFile(task.dockerfile, 'utf8')).replace(/\\\n/g, ' ');
  const packages: string[] = [];
  const tree = join(work, 'ws', task.name);
  await mkdir(tree, { recursive: true });
  let workdir = '/';
  for (const line of text.split('\n').map((l) => l.trim())) {
    const install = /apt-get install ([^&]*)/.exec(line);
    if (line.startsWith('RUN ') && install) {
      packages.push(...install[1]!.split(/\s+/).filter((w) => w !== '' && !w.startsWith('-')));
    }
    const wd = /^WORKDIR (\S+)$/.exec(line);
    if (wd) {
      workdir = wd[1]!;
      await mkdir(join(tree, workdir), { recursive: true });
    }
    const copy = /^COPY (\S+) (\S+)$/.exec(line);
    if (copy) {
      const dest = copy[2]!.startsWith('/') ? copy[2]! : join(workdir, copy[2]!);
      await cp(join(task.environmentDir, copy[1]!), join(tree, dest), { recursive: true });
    }
  }
  const ws = await node.buildLayer({
    name: `ws-${task.name}`,
    kind: 'workspace',
    from: { dir: tree },
  });
  const toolkits: string[] = [];
  if (packages.length > 0) {
    await mkdir(DEBS_CACHE, { recursive: true });
    const tk = await buildFromDebs(node.store, {
      name: `tk-${task.name}`,
      packages,
      base: image,
      cacheDir: DEBS_CACHE,
    });
    toolkits.push(`${tk.layer.name}:${tk.layer.version}`);
  }
  return { image, toolkits, workspace: `${ws.name}:${ws.version}`, cached: false };
}

async function run(
  dir: string,
  agent: Agent,
  out: string,
  environment: HarborEnvironmentBuilder = async () => ({ image, cached: true }),
): Promise<Record<string, HarborResult>> {
  const tasks = await loadHarborTasks(dir);
  const summary = await runHarbor({
    client,
    tasks,
    agent,
    environment,
    tasksPath: dir,
    outPath: join(work, out),
    concurrency: 4,
    sandbox: { memoryLimitMb: 512 },
  });
  assert.equal(summary.pending, 0);
  return Object.fromEntries(summary.results.map((r) => [r.instance_id, r]));
}

test('shipped tasks: oracle scores 1, none scores 0', async () => {
  // Two of them (DSEC_HARBOR_ALL_TASKS=1: all four), copied so the batch is just those.
  const names = process.env['DSEC_HARBOR_ALL_TASKS']
    ? ['log-top-ips', 'make-c-tool', 'python-fix-median', 'serve-status-page']
    : ['log-top-ips', 'python-fix-median'];
  const dir = join(work, 'shipped');
  for (const n of names) await cp(join(SHIPPED, n), join(dir, n), { recursive: true });
  const built = new Map<string, Promise<HarborEnvironment>>();
  const build: HarborEnvironmentBuilder = (task) => {
    if (!built.has(task.name)) built.set(task.name, emulatedBuild(task));
    return built.get(task.name)!;
  };
  const oracle = await run(dir, new OracleAgent(), 'oracle.jsonl', build);
  const none = await run(dir, new NoneAgent(), 'none.jsonl', build);
  for (const n of names) {
    const r = oracle[n]!;
    assert.equal(r.error, undefined, JSON.stringify(r));
    assert.equal(r.reward, 1, JSON.stringify(r));
    assert.equal(r.verifier?.source, 'reward.txt');
    assert.equal(r.grading, 'harbor');
    assert.ok(r.sandboxId);
    assert.equal(none[n]!.error, undefined, JSON.stringify(none[n]));
    assert.equal(none[n]!.reward, 0, JSON.stringify(none[n]));
  }
});

test('a shipped task built from its Dockerfile FROM the mirrored Debian image: oracle 1, none 0, the second build cached', async () => {
  // log-top-ips has no RUN step, so the build needs no network: FROM the registry, then one COPY.
  const registry = await startDebianRegistry({ dir: join(work, 'registry') });
  try {
    const registries = registrySettings(undefined, registry.env);
    const build: HarborEnvironmentBuilder = async (task, { signal }) => {
      const r = await buildDockerfile(node.store, {
        name: `harbor-${task.name}`,
        contextDir: task.environmentDir,
        dockerfile: task.dockerfile,
        buildArgs: { DEBIAN_IMAGE: registry.image },
        registries,
        mounter: { mountErofs, unmount },
        signal,
      });
      return { image: `${r.layer.name}:${r.layer.version}`, cached: r.cached };
    };
    const dir = join(SHIPPED, 'log-top-ips');
    const oracle = (await run(dir, new OracleAgent(), 'built-oracle.jsonl', build))['log-top-ips']!;
    assert.equal(oracle.error, undefined, JSON.stringify(oracle));
    assert.equal(oracle.reward, 1, JSON.stringify(oracle));
    const none = (await run(dir, new NoneAgent(), 'built-none.jsonl', build))['log-top-ips']!;
    assert.equal(none.error, undefined, JSON.stringify(none));
    assert.equal(none.reward, 0, JSON.stringify(none));
    assert.equal(none.environment?.cached, true);
    assert.equal(none.environment?.image, oracle.environment?.image);
  } finally {
    await registry.close();
  }
});

/** One attack task: `solve` is what the agent does, `test` the verifier's test.sh. */
async function attackTask(
  root: string,
  name: string,
  solve: string,
  testSh: string,
  toml = '[agent]\ntimeout_sec = 60.0\n\n[verifier]\ntimeout_sec = 30.0\n',
): Promise<void> {
  const dir = join(root, name);
  await mkdir(join(dir, 'environment'), { recursive: true });
  await mkdir(join(dir, 'tests'), { recursive: true });
  await mkdir(join(dir, 'solution'), { recursive: true });
  await writeFile(join(dir, 'task.toml'), toml);
  await writeFile(join(dir, 'instruction.md'), `attack ${name}\n`);
  await writeFile(join(dir, 'environment', 'Dockerfile'), 'FROM debian:bookworm\n');
  await writeFile(join(dir, 'solution', 'solve.sh'), `#!/bin/bash\n${solve}\n`, { mode: 0o755 });
  await writeFile(join(dir, 'tests', 'test.sh'), `#!/bin/bash\n${testSh}\n`, { mode: 0o755 });
}

test('the agent cannot fool the verifier; a bad reward is a 0 with a reason', async () => {
  const root = join(work, 'attacks');
  const honest0 = 'mkdir -p /logs/verifier; echo 0 > /logs/verifier/reward.txt';
  const silent = 'true';
  await attackTask(
    root,
    'prewritten-reward',
    'mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; echo "{\\"reward\\": 1}" > /logs/verifier/reward.json',
    silent,
  );
  await attackTask(
    root,
    'replaced-tests',
    'rm -rf /tests; mkdir -p /tests; printf "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\\n" > /tests/test.sh; chattr +i /tests/test.sh 2>/dev/null || true',
    honest0,
  );
  await attackTask(
    root,
    'leftover-rewriter',
    "setsid bash -c 'while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.01; done' </dev/null >/dev/null 2>&1 &\nsleep 0.2",
    'sleep 1',
  );
  await attackTask(
    root,
    'symlinked-logs',
    'mkdir -p /tmp/fake/verifier; echo 1 > /tmp/fake/verifier/reward.txt; rm -rf /logs; ln -s /tmp/fake /logs',
    silent,
  );
  await attackTask(
    root,
    'symlinked-reward',
    'echo 1 > /tmp/one',
    'mkdir -p /logs/verifier; ln -sf /tmp/one /logs/verifier/reward.txt',
  );
  await attackTask(root, 'garbled-reward', 'true', 'echo yes > /logs/verifier/reward.txt');
  await attackTask(
    root,
    'huge-reward',
    'true',
    'head -c 100000 /dev/zero | tr "\\0" 1 > /logs/verifier/reward.txt',
  );
  await attackTask(
    root,
    'json-reward',
    'true',
    'echo \'{"reward": 0.5, "passed": 3}\' > /logs/verifier/reward.json',
  );
  await attackTask(
    root,
    'agent-timeout',
    'sleep 600',
    'mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt',
    '[agent]\ntimeout_sec = 2.0\n',
  );
  const rs = await run(root, new OracleAgent(), 'attacks.jsonl');
  const want: Record<string, [number, string | undefined]> = {
    'prewritten-reward': [0, 'reward_missing'],
    'replaced-tests': [0, undefined],
    'leftover-rewriter': [0, 'reward_missing'],
    'symlinked-logs': [0, 'reward_missing'],
    'symlinked-reward': [0, 'reward_not_regular'],
    'garbled-reward': [0, 'reward_garbled'],
    'huge-reward': [0, 'reward_too_large'],
    'json-reward': [0.5, undefined],
    'agent-timeout': [1, undefined],
  };
  for (const [name, [reward, reason]] of Object.entries(want)) {
    const r = rs[name]!;
    assert.equal(r.error, undefined, `${name}: ${JSON.stringify(r)}`);
    assert.equal(r.reward, reward, `${name}: ${JSON.stringify(r)}`);
    assert.equal(r.details?.reason, reason, `${name}: ${JSON.stringify(r)}`);
  }
  assert.ok((rs['leftover-rewriter']!.killedProcesses ?? 0) >= 1);
  assert.equal(rs['agent-timeout']!.agentTimedOut, true);
  assert.deepEqual(rs['json-reward']!.verifier?.metrics, { reward: 0.5, passed: 3 });
});

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { test } from 'node:test';
import { startSingleNode } from '@dsec/cluster';
import { ensureEnvironment, loadEnvironmentRecipes } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { checkTask, readTasks, type TaskShell } from '../../../../examples/swe-tasks/lib.js';
import { main } from '../../src/main.js';

// Builds the shipped environments (examples/swe-tasks/environments.json) from
// the Debian mirror: debootstrap for the base, .debs for the toolkits. Slow
// (a minute or two) and needs root plus the mirror: opt in with
// DSEC_TEST_DEBOOTSTRAP=1. DSEC_TEST_DEBS_CACHE keeps downloads between runs.
const enabled = process.env['DSEC_TEST_DEBOOTSTRAP'] === '1';
const EXAMPLES = join(import.meta.dirname, '../../../../examples/swe-tasks');

void test(
  'environments from recipes: debian-base + python-test/node-test compose in a sandbox and every shipped task checks out there',
  { skip: !enabled && 'set DSEC_TEST_DEBOOTSTRAP=1', timeout: 15 * 60_000 },
  async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dsec-swe-env-'));
    await chmod(dir, 0o711);
    const stateDir = join(dir, 'state');
    const cacheDir = process.env['DSEC_TEST_DEBS_CACHE'] ?? join(dir, 'cache');
    const cgroupParent = `dsec-test-${basename(dir)}`;
    const node = await startSingleNode({ stateDir, port: 0, cgroupParent });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    try {
      const recipes = await loadEnvironmentRecipes(join(EXAMPLES, 'environments.json'));
      const phases = new Set<string>();
      const onProgress = (p: { environment: string; phase: string }): void => {
        phases.add(`${p.environment}:${p.phase}`);
      };
      const py = await ensureEnvironment(node.store, 'python-test', recipes, {
        cacheDir,
        onProgress,
      });
      assert.equal(py.built, true);
      assert.equal(py.layer.kind, 'toolkit');
      assert.equal(py.layer.source, 'debs');
      assert.ok(phases.has('debian-base:cleanup'), 'the base was bootstrapped first');
      assert.ok(phases.has('python-test:unpack'));
      const pinned = new Map(py.manifest?.packages.map((p) => [p.name, p.version]));
      assert.match(pinned.get('python3-pytest') ?? '', /^7\./);
      assert.ok(!pinned.has('libc6') && !pinned.has('git'), 'what the base has is left out');

      // Idempotent: a second call builds nothing; the node toolkit reuses the base.
      phases.clear();
      const again = await ensureEnvironment(node.store, 'python-test', recipes, {
        cacheDir,
        onProgress,
      });
      assert.equal(again.built, false);
      assert.equal(again.layer.digest, py.layer.digest);
      assert.deepEqual([...phases].sort(), [
        'debian-base:check',
        'debian-base:skip',
        'python-test:check',
        'python-test:skip',
      ]);
      const nodeTk = await ensureEnvironment(node.store, 'node-test', recipes, { cacheDir });
      assert.equal(nodeTk.built, true);

      // The CLI's --from-debs reads the base's dpkg status out of the stored layer.
      const out = { stdout: '', stderr: '' };
      const code = await main(
        [
          'image',
          'build',
          'pytest-only',
          '--from-debs',
          'python3-pytest,patch',
          '--base',
          'debian-base',
          '--kind',
          'toolkit',
        ],
        {
          stdout: { write: (s: string) => (out.stdout += s) },
          stderr: { write: (s: string) => (out.stderr += s) },
          env: { DSEC_STATE_DIR: stateDir },
        },
      );
      assert.equal(code, 0, out.stderr);
      assert.match(out.stdout, /^pytest-only:latest toolkit /);

      await client.open();
      const shells = new Map<string, Awaited<ReturnType<DSecClient['runContainer']>>>();
      const sandboxFor = async (image: string, toolkits: string[]) => {
        const key = [image, ...toolkits].join('+');
        let sb = shells.get(key);
        if (!sb) {
          sb = await client.runContainer(
            {
              image,
              toolkits,
              memoryLimitMb: 1024,
              cpuCoresLimit: 1,
              networkRules: {},
              initUser: 'root',
            },
            { timeoutMs: 120_000 },
          );
          shells.set(key, sb);
        }
        return sb;
      };

      const py3 = await (
        await sandboxFor('debian-base', ['python-test'])
      ).runShell('python3 -m pytest --version 2>&1; git --version; patch --version | head -1');
      assert.equal(py3.exitCode, 0, py3.stdout + py3.stderr);
      assert.match(py3.stdout, /pytest 7\.\d+\.\d+/);
      assert.match(py3.stdout, /git version 2\./);
      const nodeV = await (
        await sandboxFor('debian-base', ['node-test'])
      ).runShell('node --version');
      assert.match(nodeV.stdout, /^v18\./);

      // Each shipped task, in the sandbox its environment names: a checkout of
      // the bundle at base_commit goes in as a tar; the check runs there.
      for (const task of await readTasks(join(EXAMPLES, 'tasks.jsonl'))) {
        const sb = await sandboxFor(task.environment.image, task.environment.toolkits);
        const checkout = join(dir, task.instance_id);
        execFileSync('git', ['clone', '-q', '--no-checkout', task.repo_archive, checkout]);
        execFileSync('git', ['-C', checkout, 'checkout', '-q', '--detach', task.base_commit]);
        const tar = execFileSync('tar', ['-C', checkout, '--exclude=.git', '-cf', '-', '.']);
        const where = `/work/${task.instance_id}`;
        const put = await sb.runShell(`mkdir -p ${where} && base64 -d | tar -x -C ${where}`, {
          stdin: tar.toString('base64'),
        });
        assert.equal(put.exitCode, 0, put.stderr);
        // Through bash, not runShell: runShell's sh is DSec's busybox, whose
        // applets (patch, tar…) would shadow the image's GNU tools.
        const shell: TaskShell = {
          run: async (script, stdin) => {
            const r = await sb.exec(['bash', '-c', `cd ${where} && ${script}`], {
              ...(stdin !== undefined ? { stdin } : {}),
              timeoutMs: 120_000,
            });
            return { exitCode: r.exitCode, output: r.stdout + r.stderr };
          },
        };
        const r = await checkTask(task, shell);
        assert.deepEqual(r.problems, [], task.instance_id);
      }
    } finally {
      client.close();
      await node.close({ stopSandboxes: true });
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    }
  },
);

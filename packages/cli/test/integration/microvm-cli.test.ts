/**
 * `dsec sandbox create --backend microvm` end to end: CLI → SDK → API server
 * → placement → the edge's microVM backend, then exec in the guest.
 * Skipped where QEMU or the built microVM kernel is absent.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { release, tmpdir } from 'node:os';
import { join } from 'node:path';
import { startSingleNode } from '@dsec/cluster';
import { DEFAULT_MICROVM_ASSETS_DIR, findMicrovmAssets, findQemu } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { main } from '../../src/main.js';

const available = Boolean(findQemu() && findMicrovmAssets(DEFAULT_MICROVM_ASSETS_DIR));

test(
  'dsec sandbox create --backend microvm boots a VM the other commands work in',
  { skip: !available, timeout: 120_000 },
  async () => {
    const work = await mkdtemp(join(tmpdir(), 'dsec-cli-microvm-'));
    await chmod(work, 0o711);
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      edgeId: 'vm-node',
    });
    const dsec = async (args: string[]) => {
      const run = { code: -1, stdout: '', stderr: '' };
      run.code = await main(args, {
        stdout: { write: (s: string) => (run.stdout += s) },
        stderr: { write: (s: string) => (run.stderr += s) },
        env: { DSEC_URL: node.url, DSEC_API_KEY: node.adminKey },
      });
      return run;
    };
    try {
      const rootfs = join(work, 'rootfs');
      await makeBusyboxRootfs(rootfs);
      await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
      const created = await dsec([
        'sandbox',
        'create',
        '--image',
        'busybox',
        '--backend',
        'microvm',
      ]);
      assert.equal(created.code, 0, created.stderr);
      const id = created.stdout.trim();
      const r = await dsec(['sandbox', 'exec', id, '--', 'uname -r; exit 4']);
      assert.equal(r.code, 4, r.stderr);
      assert.match(r.stdout, /cloud-amd64/);
      assert.doesNotMatch(r.stdout, new RegExp(release().replaceAll('.', '\\.')));
    } finally {
      await node.close({ stopSandboxes: true });
      // No QEMU of this test outlives it, whatever failed above.
      for (const e of await readdir('/proc')) {
        const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
        if (cmd.includes('qemu-system') && cmd.includes(work)) process.kill(Number(e), 'SIGKILL');
      }
      await rm(work, { recursive: true, force: true });
    }
  },
);

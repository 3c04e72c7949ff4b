import { createHash } from 'node:crypto';
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { chmod, mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startSingleNode } from '@dsec/cluster';
import { DSecClient } from '@dsec/sdk';
import { main } from '../../src/main.js';

/*
 * `dsec up` ends on SIGTERM (issue 9, item 8): with sandboxes made from
 * toolkit layers and an exec done (the edge then holds a connection to the
 * sandbox's command daemon), it must exit by itself, not print `stopped` and
 * hang until a second signal. Running sandboxes are adopted by the next
 * `dsec up`; `--stop-sandboxes` leaves nothing behind.
 */

/** A hang check, not a speed target: shutdown takes well under a second here. */
const EXIT_BOUND_MS = 15_000;
const REPO = fileURLToPath(new URL('../../../../', import.meta.url));

let work: string;
let stateDir: string;

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(args, {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_STATE_DIR: stateDir },
  });
  return run;
}

interface Up {
  child: ChildProcess;
  url: string;
  adminKey: string;
  stderr: () => string;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

/** `dsec up` from source in its own process, as `bin/dsec up` runs the bundle. */
async function startUp(extra: string[] = []): Promise<Up> {
  const child = spawn(
    process.execPath,
    [
      '--conditions=dsec-source',
      '--import',
      'tsx',
      '--input-type=module',
      '-e',
      "import { main } from '@dsec/cli/main'; process.exitCode = await main(process.argv.slice(1));",
      '--',
      '--state-dir',
      stateDir,
      'up',
      '--port',
      '0',
      ...extra,
    ],
    { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'] },
  );
  let stdout = '';
  let stderr = '';
  child.stdout.setEncoding('utf8').on('data', (s: string) => (stdout += s));
  child.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once('exit', (code, signal) => resolve({ code, signal })),
  );
  const url = await new Promise<string>((resolve, reject) => {
    const onData = () => {
      const m = /^ready (\S+)$/m.exec(stdout);
      if (m?.[1]) {
        child.stdout.off('data', onData);
        resolve(m[1]);
      }
    };
    child.stdout.on('data', onData);
    void exited.then(({ code }) => reject(new Error(`dsec up exited (${code}): ${stderr}`)));
  });
  const adminKey = (await readFile(join(stateDir, 'admin.key'), 'utf8')).trim();
  return { child, url, adminKey, stderr: () => stderr, exited };
}

/** SIGTERM, then the time until the process is gone (rejects past the bound). */
async function terminate(up: Up): Promise<{ ms: number; code: number | null }> {
  const started = performance.now();
  up.child.kill('SIGTERM');
  let timer: NodeJS.Timeout | undefined;
  const bound = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new Error(`dsec up still running ${EXIT_BOUND_MS} ms after SIGTERM`)),
      EXIT_BOUND_MS,
    );
  });
  try {
    const { code } = await Promise.race([up.exited, bound]);
    return { ms: performance.now() - started, code };
  } finally {
    clearTimeout(timer);
    if (up.child.exitCode === null && up.child.signalCode === null) up.child.kill('SIGKILL');
  }
}

/** Processes whose command line names this state dir (sandbox runtimes, daemons). */
/**
 * Processes of the node: those naming its state dir, and those in the
 * sandbox's cgroup (a detached runtime leaves only the sandbox's own
 * processes and its command daemon, neither of which names a path).
 */
async function processesOf(dir: string, sandboxId: string): Promise<string[]> {
  const found: string[] = [];
  for (const pid of await readdir('/proc')) {
    if (!/^\d+$/.test(pid)) continue;
    const cmd = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes(dir)) found.push(`${pid}: ${cmd.replaceAll('\0', ' ')}`);
  }
  // The container backend's cgroup name for the sandbox, under `dsec up`'s default parent.
  const name = 'dsec-' + createHash('sha256').update(sandboxId).digest('hex').slice(0, 20);
  const procs = await readFile(`/sys/fs/cgroup/pids/dsec/${name}/cgroup.procs`, 'utf8').catch(
    () => '',
  );
  found.push(...procs.split('\n').filter(Boolean));
  return found;
}

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-up-sigterm-'));
  await chmod(work, 0o711);
  stateDir = join(work, 'state');
  const built = await dsec(['image', 'build', 'busybox', '--from-busybox']);
  assert.equal(built.code, 0, built.stderr);
  for (const name of ['tools', 'harness']) {
    const dir = join(work, name);
    await mkdir(join(dir, 'opt', name), { recursive: true });
    await writeFile(join(dir, 'opt', name, 'version'), `${name} 1\n`);
    const r = await dsec(['image', 'build', `${name}:v1`, '--from-dir', dir, '--kind', 'toolkit']);
    assert.equal(r.code, 0, r.stderr);
  }
});

after(async () => {
  // Whatever failed above, stop what this state dir still runs.
  const node = await startSingleNode({ stateDir, port: 0 });
  await node.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

test('SIGTERM ends `dsec up` after toolkit sandboxes and an exec; the next start adopts them; --stop-sandboxes leaves nothing', async () => {
  const up = await startUp();
  let client = new DSecClient({ url: up.url, apiKey: up.adminKey });
  await client.open();
  const sandbox = await client.runContainer(
    { image: 'busybox', toolkits: ['tools:v1', 'harness:v1'], ttlRunningStopSeconds: 600 },
    { timeoutMs: 60_000 },
  );
  assert.equal((await sandbox.runShell('cat /opt/tools/version')).stdout, 'tools 1\n');
  client.close();

  const first = await terminate(up);
  assert.equal(first.code, 0, up.stderr());
  assert.match(up.stderr(), /^stopped$/m);
  assert.doesNotMatch(up.stderr(), /handles still open/, 'it ended by itself, not by the guard');
  assert.notDeepEqual(await processesOf(stateDir, sandbox.id), [], 'the sandbox kept running');

  const again = await startUp(['--stop-sandboxes']);
  client = new DSecClient({ url: again.url, apiKey: again.adminKey });
  await client.open();
  assert.deepEqual(
    (await client.listSandboxes()).map((s) => [s.id, s.state]),
    [[sandbox.id, 'running']],
  );
  assert.equal(
    (await client.sandbox(sandbox.id).runShell('cat /opt/harness/version')).stdout,
    'harness 1\n',
  );
  client.close();

  const second = await terminate(again);
  assert.equal(second.code, 0, again.stderr());
  assert.doesNotMatch(again.stderr(), /handles still open/);
  assert.deepEqual(await processesOf(stateDir, sandbox.id), [], 'no sandbox process is left');
  const mounts = (await readFile('/proc/mounts', 'utf8'))
    .split('\n')
    .filter((l) => l.includes(stateDir));
  assert.deepEqual(mounts, [], 'no layer or sandbox mount is left');
  assert.deepEqual(await readdir(join(stateDir, 'edge', 'sandboxes')), []);
});

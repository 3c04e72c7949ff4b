import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { chmod, lstat, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { promisify } from 'node:util';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';

/*
 * SECURITY: host-side state is private to the platform (issue 9, item 7;
 * docs/adr/0010-private-host-state.md). A running node with a sandbox that
 * wrote a secret into a world-readable directory of its own, and whose
 * command log holds the secret too, is probed by an unprivileged host user
 * (`nobody`, through setpriv): it must list no directory and open no file or
 * socket of the node's state, and see no sandbox directory or socket path in
 * any process's command line.
 */

const execFileAsync = promisify(execFile);
const NOBODY = ['--reuid=65534', '--regid=65534', '--clear-groups'];

let dir: string;
let stateDir: string;
let cgroupParent: string;
let node: SingleNode;
let client: DSecClient;
const secret = `dsec-secret-${randomBytes(12).toString('hex')}`;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-privacy-'));
  await chmod(dir, 0o711); // the sandboxes' mapped roots pass through it, like /var/lib
  stateDir = join(dir, 'state');
  cgroupParent = `dsec-test-${basename(dir)}`;
  node = await startSingleNode({ stateDir, port: 0, cgroupParent });
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
  client = new DSecClient({ url: node.url, apiKey: node.adminKey });
  await client.open();
  const sandbox = await client.runContainer(
    // With the default network policy: a veth, a resolver and its resolv.conf too.
    { image: 'busybox', ttlRunningStopSeconds: 600, networkRules: {} },
    { timeoutMs: 60_000 },
  );
  // World-readable inside the sandbox (0644 in /tmp, 1777): only the host-side
  // directories can keep it from other host users.
  const wrote = await sandbox.runShell(
    `echo ${secret} > /tmp/secret && chmod 0644 /tmp/secret && cat /tmp/secret`,
  );
  assert.equal(wrote.exitCode, 0, wrote.stderr);
  assert.equal(wrote.stdout, `${secret}\n`); // now in the command log as well
});

after(async () => {
  client?.close();
  await node?.close({ stopSandboxes: true });
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
});

type Kind = 'dir' | 'file' | 'socket' | 'symlink' | 'other';

/** Every path under `root` as root sees it (mounted layers included). */
async function walk(root: string): Promise<{ path: string; kind: Kind }[]> {
  const out: { path: string; kind: Kind }[] = [];
  const visit = async (path: string): Promise<void> => {
    const st = await lstat(path).catch(() => undefined);
    if (!st) return; // gone meanwhile (a -journal, a temp file)
    const kind: Kind = st.isDirectory()
      ? 'dir'
      : st.isFile()
        ? 'file'
        : st.isSocket()
          ? 'socket'
          : st.isSymbolicLink()
            ? 'symlink'
            : 'other';
    out.push({ path, kind });
    if (kind === 'dir')
      for (const name of await readdir(path).catch(() => [])) await visit(join(path, name));
  };
  await visit(root);
  return out;
}

/** Unix sockets the kernel knows whose path names this node's state or one of its sandboxes. */
async function socketsOf(names: string[]): Promise<string[]> {
  const table = await readFile('/proc/net/unix', 'utf8');
  const paths = table
    .split('\n')
    .slice(1)
    .map((line) => line.trim().split(/\s+/)[7])
    .filter((p): p is string => p !== undefined && p.startsWith('/'));
  return [...new Set(paths.filter((p) => names.some((n) => p.includes(n))))];
}

/**
 * Runs as `nobody`: for each path, lists it (directories), opens and reads it
 * (files and anything else), connects to it (sockets) or reads the link
 * (symlinks). Prints, per path, the error code or what it got.
 */
const PROBE = `
import { openSync, readSync, closeSync, readdirSync, readlinkSync, constants } from 'node:fs';
import { connect } from 'node:net';
let input = '';
for await (const chunk of process.stdin) input += chunk;
const results = [];
for (const { path, kind } of JSON.parse(input)) {
  try {
    if (kind === 'dir') {
      results.push({ path, got: readdirSync(path).join('\\n') });
    } else if (kind === 'symlink') {
      results.push({ path, got: readlinkSync(path) });
    } else if (kind === 'socket') {
      await new Promise((resolve, reject) => {
        const s = connect({ path });
        s.once('connect', () => { s.destroy(); resolve(); });
        s.once('error', reject);
      });
      results.push({ path, got: '(connected)' });
    } else {
      const fd = openSync(path, constants.O_RDONLY | constants.O_NONBLOCK);
      const buf = Buffer.alloc(65536);
      const n = readSync(fd, buf, 0, buf.length, 0);
      closeSync(fd);
      results.push({ path, got: buf.subarray(0, n).toString('latin1') });
    }
  } catch (err) {
    results.push({ path, code: err.code ?? String(err) });
  }
}
process.stdout.write(JSON.stringify(results));
`;

async function probeAsNobody(
  paths: { path: string; kind: Kind }[],
): Promise<{ path: string; code?: string; got?: string }[]> {
  const child = spawn(
    'setpriv',
    [...NOBODY, process.execPath, '--input-type=module', '-e', PROBE],
    { stdio: ['pipe', 'pipe', 'pipe'], cwd: '/' },
  );
  let stdout = '';
  let stderr = '';
  child.stdout.setEncoding('utf8').on('data', (s: string) => (stdout += s));
  child.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
  child.stdin.end(JSON.stringify(paths));
  const code = await new Promise<number | null>((resolve) => child.once('close', resolve));
  assert.equal(code, 0, `probe failed: ${stderr}`);
  return JSON.parse(stdout) as { path: string; code?: string; got?: string }[];
}

/**
 * The one thing under the state dir another user may read: a sandbox's
 * resolv.conf, bind-mounted into it for every user inside (so o+r), named
 * after a hash of the sandbox ID in a directory nobody can list. It holds the
 * sandbox's resolver address and nothing a tenant wrote.
 */
function isResolvConf(path: string, content: string | undefined): boolean {
  return (
    path.startsWith(join(stateDir, 'edge', 'network', 'resolv') + '/') &&
    path.endsWith('.conf') &&
    content !== undefined &&
    /^nameserver [0-9a-f.:]+\n(options [^\n]*\n)?$/.test(content)
  );
}

test('an unprivileged host user lists, opens and connects to nothing of the node’s state', async () => {
  const entries = await walk(stateDir);
  const has = (p: string) => entries.some((e) => e.path === p);
  // The probe must cover what matters, or passing it means nothing.
  for (const p of ['iam.db', 'iam.db-wal', 'admin.key', 'cluster.secret', 'edge/edge.db'])
    assert.ok(has(join(stateDir, p)), `${p} exists`);
  const upperSecret = entries.find((e) => e.path.endsWith('/upper/tmp/secret'));
  assert.ok(upperSecret, "the sandbox's writable layer holds /tmp/secret");
  assert.equal(await readFile(upperSecret.path, 'utf8'), `${secret}\n`);
  const sandboxDirs = entries
    .filter((e) => e.path.startsWith(join(stateDir, 'edge', 'sandboxes') + '/'))
    .map((e) =>
      e.path
        .split('/')
        .slice(0, stateDir.split('/').length + 3)
        .join('/'),
    );
  const names = [...new Set(sandboxDirs)].map((p) => basename(p));
  assert.equal(names.length, 1, 'one sandbox directory');
  const sockets = await socketsOf([stateDir, ...names]);
  const probes = [
    ...entries,
    ...sockets.filter((s) => !has(s)).map((path) => ({ path, kind: 'socket' as const })),
    // SQLite's side files appear and go; ask for them by name whether or not they exist now.
    ...['iam.db-shm', 'edge/edge.db-wal', 'edge/edge.db-shm', 'edge/events.db-wal'].map((p) => ({
      path: join(stateDir, p),
      kind: 'file' as const,
    })),
  ];

  const results = await probeAsNobody(probes);
  const leaks = results.filter(
    (r) =>
      !(r.code === 'EACCES' || r.code === 'EPERM') &&
      !(r.code === 'ENOENT' && !has(r.path)) && // a side file that does not exist now
      !isResolvConf(r.path, r.got),
  );
  assert.deepEqual(
    leaks.map((r) => `${r.path}: ${r.code ?? `read ${JSON.stringify(r.got?.slice(0, 80))}`}`),
    [],
    'every list, open and connect fails with EACCES/EPERM',
  );
  assert.ok(!results.some((r) => r.got?.includes(secret)), 'the secret never reaches nobody');
  // The walk's top: even listing the state dir is refused.
  assert.equal(results.find((r) => r.path === stateDir)?.code, 'EACCES');
});

test('a find over the state dir as an unprivileged user finds nothing inside it', async () => {
  const { stdout } = await execFileAsync(
    'setpriv',
    [
      ...NOBODY,
      'sh',
      '-c',
      `find "$1" 2>/dev/null; cat "$1"/iam.db "$1"/edge/edge.db 2>/dev/null; true`,
      'sh',
      stateDir,
    ],
    { encoding: 'latin1', maxBuffer: 64 * 2 ** 20 },
  );
  assert.deepEqual(stdout.split('\n').filter(Boolean), [stateDir]);
  assert.ok(!stdout.includes(secret));
});

// Depends on the per-node chronus supervisor (no per-sandbox `--sock PATH`
// argument) and the detached runtime (no `runc run --bundle PATH` shim):
// fails until those land, and only for those processes.
test('no process command line names a sandbox directory or socket (chronus supervisor, detached runtime)', async () => {
  const names = (await readdir(join(stateDir, 'edge', 'sandboxes'))).filter((n) =>
    n.startsWith('dsec-'),
  );
  assert.equal(names.length, 1);
  const sockets = await socketsOf([stateDir, ...names]);
  const { stdout } = await execFileAsync(
    'setpriv',
    [...NOBODY, 'ps', '-eo', 'args', '--no-headers'],
    {
      maxBuffer: 16 * 2 ** 20,
    },
  );
  const revealing = stdout
    .split('\n')
    .filter(
      (line) =>
        names.some((n) => line.includes(n)) ||
        line.includes(join(stateDir, 'edge', 'sandboxes')) ||
        sockets.some((s) => line.includes(s)),
    );
  assert.deepEqual(revealing, []);
});

/**
 * `node --import tsx scripts/e2b-suites.ts --git-dir DIR [--js] [--python] [--json]`: runs E2B's
 * own SDK test suites, unmodified, against a `dsec up` that this script starts (issue 26,
 * point 1; docs/e2b.md, "E2B's own test suites"). A development tool, not a CI step: CI cannot
 * fetch the suites, and they are never copied into this repository.
 *
 * - `--git-dir DIR` (or env E2B_GIT_DIR): a bare git dir of github:e2b-dev/E2B holding the pinned
 *   commits below. The JS SDK (packages/js-sdk) is exported at `JS_COMMIT`, the Python SDK
 *   (packages/python-sdk) at `PY_COMMIT`: the last python-sdk release whose dependencies
 *   Debian 13 (trixie) packages (2.1.0 added dockerfile-parse, which trixie lacks).
 * - Preparation (the only step that uses the network: the npm registry and Debian's mirror):
 *   the JS SDK's dependencies by `npm install --ignore-scripts` (no install script downloads
 *   anything); a Debian trixie root by debootstrap, cached under `--work`; from it the image of
 *   the template `base` (a `user` account with passwordless sudo, python, git, curl) and a
 *   client chroot with the python-sdk's dependencies and pytest from Debian's packages.
 * - The run, in a network namespace of its own with only loopback in it (`unshare --net`), so
 *   nothing it starts has a route off the machine: `dsec up` with the template `base` mapped to
 *   that image, sandboxes denied 0.0.0.0/0 and ::/0 (`up.network.protectedRanges`), a TLS bridge
 *   on 127.0.0.1:443 for the SDKs' https URLs under the domain `DOMAIN`, and name lookups
 *   answered in the test processes themselves (loopback-dns.mjs, pytest_dsec_suites.py): the
 *   domain and its subdomains are 127.0.0.1, no other name resolves, no DNS server is asked.
 * - Exclusions: scripts/e2b-suites/exclude.txt, a reason each. vitest leaves excluded files out
 *   (`exclude`), pytest deselects excluded tests at collection; the reports are checked
 *   afterwards, and an excluded test that shows up in one fails the run.
 * - `--only PATH` (repeatable) runs just those test files (a `.py` path or pytest node ID goes to
 *   the Python suite, any other to vitest); a suite none of them names does not run. Runs share
 *   WORK's client chroot: run one at a time (`flock /var/tmp/dsec-e2b-suites.lock …`).
 * - Output: per suite passed/failed/skipped and the pass rate over the tests that need a server
 *   (a test file that creates, lists or connects to sandboxes or templates and mocks no HTTP),
 *   JSON with `--json`; `--out DIR` (default WORK/results) gets results.json, failures.txt
 *   (each failing test and the first line of its error) and the raw reports.
 *
 * Needs root (debootstrap, chroot, network namespaces, `dsec up`), git, debootstrap, openssl,
 * unshare and ip. Exit status: 0 when both suites ran (whatever their pass rates), 1 when the
 * run could not be made or an excluded test ran, 2 on bad arguments.
 */
import { spawn, spawnSync, type SpawnOptions } from 'node:child_process';
import { once } from 'node:events';
import {
  appendFileSync,
  cpSync,
  existsSync,
  mkdirSync,
  readFileSync,
  renameSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { connect, createServer as createTcpServer, type Server as TcpServer } from 'node:net';
import { dirname, join, resolve } from 'node:path';
import { createServer as createTlsServer } from 'node:tls';
import { fileURLToPath } from 'node:url';
import {
  DOMAIN,
  JS_COMMIT,
  PY_COMMIT,
  PY_VERSION,
  checkExclusionsExist,
  leakedExclusions,
  parseExclusions,
  pyExcluded,
  readJsResults,
  readPyResults,
  summarize,
  type Exclusion,
  type SuiteSummary,
  type TestResult,
} from './e2b-suites/lib.js';

const DEBIAN_SUITE = 'trixie';
const DEBIAN_MIRROR = 'http://deb.debian.org/debian';
const TEMPLATE_IMAGE = 'e2bsuite-base:1';
/** Packages of the template `base` image besides minbase (E2B's base has these commands). */
const IMAGE_PACKAGES = [
  'python3',
  'python-is-python3',
  'sudo',
  'git',
  'procps',
  'curl',
  'ca-certificates',
];
/** The python-sdk 2.0.2 dependencies and its test tools, as Debian 13 names them. */
const CLIENT_PACKAGES = [
  'python3-httpx',
  'python3-httpcore',
  'python3-h2',
  'python3-protobuf',
  'python3-attr',
  'python3-dateutil',
  'python3-packaging',
  'python3-typing-extensions',
  'python3-pytest',
  'python3-pytest-asyncio',
  'python3-pytest-xdist',
  'python3-pytest-timeout',
  'python3-dotenv',
  'ca-certificates',
];
/** A suite that runs longer than this is stopped (its report so far is still read). */
const SUITE_LIMIT_MS = 60 * 60 * 1000;

const HERE = dirname(fileURLToPath(import.meta.url));
const REPO = resolve(HERE, '..');
const ASSETS = join(HERE, 'e2b-suites');

interface Options {
  js: boolean;
  python: boolean;
  json: boolean;
  gitDir: string;
  work: string;
  out: string;
  /** `--only PATH` (repeatable): run just these test files (or pytest node IDs), per suite. */
  only: string[];
}

function usage(message: string): never {
  process.stderr.write(
    `e2b-suites: ${message}\nusage: node --import tsx scripts/e2b-suites.ts --git-dir DIR [--js] [--python] [--json] [--work DIR] [--out DIR] [--only PATH]...\n`,
  );
  process.exit(2);
}

function parseArgs(argv: string[]): Options {
  let js = false;
  let python = false;
  let json = false;
  let gitDir = process.env.E2B_GIT_DIR;
  let work = '/var/tmp/dsec-e2b-suites';
  let out: string | undefined;
  const only: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    const value = (): string => {
      const v = argv[++i];
      if (v === undefined || v.startsWith('--')) usage(`${a} needs a value`);
      return v;
    };
    if (a === '--js') js = true;
    else if (a === '--python') python = true;
    else if (a === '--json') json = true;
    else if (a === '--git-dir') gitDir = value();
    else if (a === '--work') work = value();
    else if (a === '--out') out = value();
    else if (a === '--only') only.push(value());
    else usage(`unknown argument ${JSON.stringify(a)}`);
  }
  if (!gitDir) usage('--git-dir (or E2B_GIT_DIR) is required: a bare git dir of e2b-dev/E2B');
  if (!js && !python) js = python = true;
  // With --only, a suite runs only when some of the paths are its own (.py for Python).
  if (only.length > 0) {
    js &&= only.some((x) => !isPyPath(x));
    python &&= only.some(isPyPath);
  }
  work = resolve(work);
  return {
    js,
    python,
    json,
    gitDir: resolve(gitDir),
    work,
    out: resolve(out ?? join(work, 'results')),
    only,
  };
}

function isPyPath(path: string): boolean {
  return /\.py(::|$)/.test(path);
}

function log(line: string): void {
  process.stderr.write(`e2b-suites: ${line}\n`);
}

/** Runs a command to completion; throws with its output's tail when it fails. */
function run(
  cmd: string,
  args: string[],
  options: { cwd?: string; input?: string; env?: NodeJS.ProcessEnv } = {},
): string {
  const r = spawnSync(cmd, args, {
    cwd: options.cwd,
    input: options.input,
    env: options.env ?? process.env,
    encoding: 'utf8',
    maxBuffer: 64 * 2 ** 20,
  });
  if (r.error) throw new Error(`${cmd}: ${r.error.message}`);
  if (r.status !== 0) {
    const tail = `${r.stdout ?? ''}${r.stderr ?? ''}`.slice(-2000);
    throw new Error(`${cmd} ${args.join(' ')} exited ${r.status ?? r.signal}:\n${tail}`);
  }
  return r.stdout;
}

// ---------------------------------------------------------------------------
// Preparation (network: npm registry, Debian's mirror)
// ---------------------------------------------------------------------------

function exportTree(o: Options, commit: string, path: string, into: string): string {
  const dir = join(into, path);
  if (existsSync(join(into, '.complete'))) return dir;
  const tmp = `${into}.tmp`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(tmp, { recursive: true });
  const kind = run('git', ['--git-dir', o.gitDir, 'cat-file', '-t', commit]).trim();
  if (kind !== 'commit')
    throw new Error(`${o.gitDir} has no commit ${commit} (fetch github:e2b-dev/E2B)`);
  const tar = spawnSync('git', ['--git-dir', o.gitDir, 'archive', '--format=tar', commit, path], {
    maxBuffer: 1 << 30,
  });
  if (tar.status !== 0) throw new Error(`git archive ${commit} ${path}: ${tar.stderr.toString()}`);
  run('tar', ['-x', '-C', tmp], { input: tar.stdout as unknown as string });
  writeFileSync(join(tmp, '.complete'), `${commit}\n`);
  rmSync(into, { recursive: true, force: true });
  renameSync(tmp, into);
  return dir;
}

function installJsDeps(jsDir: string): void {
  if (existsSync(join(jsDir, 'node_modules', '.dsec-e2b-suites'))) return;
  log(
    'npm install: the JS SDK and its dev dependencies, no install scripts (--legacy-peer-deps: E2B installs with pnpm, whose peer rules npm does not share)',
  );
  run(
    'npm',
    [
      'install',
      '--ignore-scripts',
      '--legacy-peer-deps',
      '--no-audit',
      '--no-fund',
      '--loglevel=error',
    ],
    { cwd: jsDir },
  );
  writeFileSync(join(jsDir, 'node_modules', '.dsec-e2b-suites'), 'installed\n');
}

/** `chroot ROOT CMD…` with /proc mounted for the command's time. */
function inChroot(root: string, args: string[], env: NodeJS.ProcessEnv = {}): string {
  mkdirSync(join(root, 'proc'), { recursive: true });
  run('mount', ['-t', 'proc', 'proc', join(root, 'proc')]);
  try {
    return run('chroot', [root, ...args], {
      env: {
        PATH: '/usr/sbin:/usr/bin:/sbin:/bin',
        DEBIAN_FRONTEND: 'noninteractive',
        LANG: 'C.UTF-8',
        ...env,
      },
    });
  } finally {
    run('umount', [join(root, 'proc')]);
  }
}

function debianRoot(o: Options): string {
  const dir = join(o.work, `debian-${DEBIAN_SUITE}`);
  if (existsSync(join(dir, '.complete'))) return dir;
  log(`debootstrap ${DEBIAN_SUITE} (minbase) from ${DEBIAN_MIRROR}: minutes`);
  const tmp = `${dir}.tmp`;
  rmSync(tmp, { recursive: true, force: true });
  run('debootstrap', [
    '--variant=minbase',
    `--include=${IMAGE_PACKAGES.join(',')}`,
    DEBIAN_SUITE,
    tmp,
    DEBIAN_MIRROR,
  ]);
  inChroot(tmp, ['apt-get', 'update', '-q']);
  writeFileSync(join(tmp, '.complete'), `${DEBIAN_SUITE}\n`);
  renameSync(tmp, dir);
  return dir;
}

/** The template `base`: E2B's sandboxes run as `user` (home /home/user, passwordless sudo). */
function imageRoot(o: Options, base: string): string {
  const dir = join(o.work, 'image-base');
  if (existsSync(join(o.work, 'image-base.complete'))) return dir;
  log('image root for the template `base` (user account, sudo)');
  rmSync(dir, { recursive: true, force: true });
  run('cp', ['-a', base, dir]);
  rmSync(join(dir, '.complete'), { force: true });
  inChroot(dir, ['useradd', '--create-home', '--shell', '/bin/bash', '--groups', 'sudo', 'user']);
  writeFileSync(join(dir, 'etc/sudoers.d/user'), 'user ALL=(ALL:ALL) NOPASSWD: ALL\n', {
    mode: 0o440,
  });
  inChroot(dir, ['apt-get', 'clean']);
  rmSync(join(dir, 'var/lib/apt/lists'), { recursive: true, force: true });
  mkdirSync(join(dir, 'var/lib/apt/lists/partial'), { recursive: true });
  writeFileSync(join(o.work, 'image-base.complete'), 'ok\n');
  return dir;
}

function clientRoot(o: Options, base: string): string {
  const dir = join(o.work, 'client-python');
  if (existsSync(join(o.work, 'client-python.complete'))) return dir;
  log("client chroot: the python-sdk's dependencies and pytest from Debian's packages");
  rmSync(dir, { recursive: true, force: true });
  run('cp', ['-a', base, dir]);
  rmSync(join(dir, '.complete'), { force: true });
  inChroot(dir, ['apt-get', 'install', '-y', '-q', '--no-install-recommends', ...CLIENT_PACKAGES]);
  inChroot(dir, ['apt-get', 'clean']);
  writeFileSync(join(o.work, 'client-python.complete'), 'ok\n');
  return dir;
}

/** A self-signed certificate for DOMAIN and *.DOMAIN, the TLS bridge's. */
function certificate(o: Options): { cert: string; key: string } {
  const dir = join(o.work, 'tls');
  const cert = join(dir, 'cert.pem');
  const key = join(dir, 'key.pem');
  if (existsSync(cert) && existsSync(key)) return { cert, key };
  mkdirSync(dir, { recursive: true });
  run('openssl', [
    'req',
    '-x509',
    '-newkey',
    'ec',
    '-pkeyopt',
    'ec_paramgen_curve:prime256v1',
    '-nodes',
    '-days',
    '3650',
    '-subj',
    `/CN=${DOMAIN}`,
    '-keyout',
    key,
    '-out',
    cert,
    '-addext',
    `subjectAltName=DNS:${DOMAIN},DNS:*.${DOMAIN}`,
    '-addext',
    'basicConstraints=critical,CA:TRUE',
  ]);
  return { cert, key };
}

// ---------------------------------------------------------------------------
// The run (inside a network namespace with only loopback)
// ---------------------------------------------------------------------------

interface Prepared {
  options: Options;
  jsDir?: string;
  pyDir?: string;
  image: string;
  client?: string;
  cert: string;
  key: string;
}

/** Refuses to go on unless loopback is the only interface and no route leads anywhere else. */
function assertLoopbackOnly(): void {
  run('ip', ['link', 'set', 'lo', 'up']);
  const links = run('ip', ['-o', 'link', 'show'])
    .split('\n')
    .filter(Boolean)
    .map((l) => l.split(':')[1]!.trim().split('@')[0]!);
  if (links.length !== 1 || links[0] !== 'lo')
    throw new Error(`network namespace has ${links.join(', ')}: want lo only`);
  for (const family of ['-4', '-6']) {
    const routes = run('ip', [family, 'route', 'show']).trim();
    if (routes && !routes.split('\n').every((r) => / dev lo\b/.test(r)))
      throw new Error(`network namespace has routes off loopback:\n${routes}`);
  }
}

/**
 * Refuses to go on unless the node's firewall denies every destination to sandboxes: its
 * `protected4` / `protected6` sets hold 0.0.0.0/0 and ::/0 (`up.network.protectedRanges`). An
 * edge without the sandbox network (mode `none`) gives sandboxes loopback only, which is no
 * egress either.
 */
function assertEgressDenied(): void {
  const tables = run('nft', ['list', 'tables'])
    .split('\n')
    .map((l) => /^table inet (dsec_\S+)$/.exec(l.trim())?.[1])
    .filter((t): t is string => t !== undefined);
  if (tables.length === 0) {
    log('no sandbox network on the node: sandboxes have loopback only');
    return;
  }
  for (const t of tables) {
    const v4 = run('nft', ['list', 'set', 'inet', t, 'protected4']);
    const v6 = run('nft', ['list', 'set', 'inet', t, 'protected6']);
    if (
      !/elements = \{([^}]*,)?\s*0\.0\.0\.0\/0\s*[,}]/.test(v4) ||
      !/elements = \{([^}]*,)?\s*::\/0\s*[,}]/.test(v6)
    )
      throw new Error(`table ${t} does not protect 0.0.0.0/0 and ::/0:\n${v4}${v6}`);
  }
}

/** TLS on 127.0.0.1:443 (http/1.1 only), bytes passed to the apiserver as they are. */
async function startTlsBridge(cert: string, key: string, targetPort: number): Promise<TcpServer> {
  const server = createTlsServer(
    { cert: readFileSync(cert), key: readFileSync(key), ALPNProtocols: ['http/1.1'] },
    (tls) => {
      const upstream = connect({ host: '127.0.0.1', port: targetPort });
      tls.pipe(upstream).pipe(tls);
      const end = (): void => {
        tls.destroy();
        upstream.destroy();
      };
      tls.on('error', end);
      upstream.on('error', end);
      tls.on('close', end);
      upstream.on('close', end);
    },
  );
  server.listen(443, '127.0.0.1');
  await once(server, 'listening');
  return server;
}

async function freePort(): Promise<number> {
  const s = createTcpServer();
  s.listen(0, '127.0.0.1');
  await once(s, 'listening');
  const { port } = s.address() as { port: number };
  await new Promise<void>((r) => s.close(() => r()));
  return port;
}

function dsecArgs(...args: string[]): string[] {
  return [
    '--conditions=dsec-source',
    '--import',
    'tsx',
    join(REPO, 'packages/cli/src/run.ts'),
    ...args,
  ];
}

interface Node {
  url: string;
  port: number;
  apiKey: string;
  stop(): Promise<void>;
}

async function startDsec(stateDir: string, runDir: string): Promise<Node> {
  mkdirSync(stateDir, { recursive: true });
  const config = join(runDir, 'dsec-config.json');
  writeFileSync(
    config,
    JSON.stringify(
      {
        up: { network: { mode: 'isolated', protectedRanges: ['0.0.0.0/0', '::/0'] } },
        e2b: { templates: { base: TEMPLATE_IMAGE }, sandboxDomain: DOMAIN },
      },
      null,
      2,
    ),
  );
  const port = await freePort();
  const logFile = join(runDir, 'dsec-up.log');
  const child = spawn(
    process.execPath,
    dsecArgs(
      'up',
      '--config',
      config,
      '--state-dir',
      stateDir,
      '--port',
      String(port),
      '--stop-sandboxes',
    ),
    { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, NODE_OPTIONS: '' } },
  );
  child.stderr.on('data', (b: Buffer) => appendFileSync(logFile, b));
  let url: string | undefined;
  await new Promise<void>((resolvePromise, reject) => {
    let buf = '';
    child.stdout.on('data', (b: Buffer) => {
      appendFileSync(logFile, b);
      buf += b.toString();
      const m = /^ready (\S+)$/m.exec(buf);
      if (m && url === undefined) {
        url = m[1];
        resolvePromise();
      }
    });
    child.once('exit', (code, signal) =>
      reject(new Error(`dsec up exited ${code ?? signal} before it was ready (log: ${logFile})`)),
    );
  });
  const apiKey = readFileSync(join(stateDir, 'admin.key'), 'utf8').trim();
  return {
    url: url!,
    port,
    apiKey,
    stop: async () => {
      if (child.exitCode !== null || child.signalCode !== null) return;
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 120_000);
      await once(child, 'exit');
      clearTimeout(timer);
    },
  };
}

/** Runs a suite's command with a time limit; resolves with its exit code (null: stopped). */
async function runSuite(
  cmd: string,
  args: string[],
  opts: SpawnOptions,
  logFile: string,
): Promise<number | null> {
  const child = spawn(cmd, args, { ...opts, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  child.stdout.on('data', (b: Buffer) => appendFileSync(logFile, b));
  child.stderr.on('data', (b: Buffer) => appendFileSync(logFile, b));
  const timer = setTimeout(() => {
    log(`${cmd}: past ${SUITE_LIMIT_MS / 60000} minutes, stopped`);
    try {
      process.kill(-child.pid!, 'SIGKILL');
    } catch {
      // already gone
    }
  }, SUITE_LIMIT_MS);
  const [code] = (await once(child, 'exit')) as [number | null];
  clearTimeout(timer);
  return code;
}

function testEnv(node: Node, cert: string): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = {};
  // Only what a user's shell would hold; no E2B_* variable of this process's leaks in.
  for (const k of ['PATH', 'HOME', 'LANG', 'TERM', 'TMPDIR'])
    if (process.env[k]) env[k] = process.env[k];
  return {
    ...env,
    E2B_DOMAIN: DOMAIN,
    // The admin key in E2B's format (`dsec key create --e2b` prints a key so): the SDKs' own key
    // check passes as with an E2B key, so E2B_VALIDATE_API_KEY is left unset.
    E2B_API_KEY: `e2b_${Buffer.from(node.apiKey.slice('dsk_'.length), 'base64url').toString('hex')}`,
    DSEC_E2B_SUITES_DOMAIN: DOMAIN,
    NODE_EXTRA_CA_CERTS: cert,
  };
}

async function runJs(
  p: Prepared,
  node: Node,
  runDir: string,
  exclusions: Exclusion[],
): Promise<{ code: number | null; report: string }> {
  const jsDir = p.jsDir!;
  const report = join(runDir, 'js-report.json');
  const config = join(jsDir, 'dsec-e2b-suites.vitest.config.mts');
  const excluded = exclusions.filter((e) => e.suite === 'js').map((e) => e.target);
  // E2B's own config, less its browser project, with the excluded files left out.
  writeFileSync(
    config,
    `// Written by DSec's scripts/e2b-suites.ts: E2B's vitest.config.mts, without its browser
// project (Chromium cannot be downloaded here), with the files of exclude.txt left out.
import base from './vitest.config.mts'
const excluded = ${JSON.stringify(excluded)}
const projects = base.test.projects
  .filter((p) => p.test.name !== 'browser')
  .map((p) => ({ ...p, test: { ...p.test, exclude: [...(p.test.exclude ?? ['**/node_modules/**', '**/.git/**']), ...excluded] } }))
// includeTaskLocation: each test's line in the JSON report, for telling which tests need a server.
export default { ...base, test: { ...base.test, includeTaskLocation: true, projects } }
`,
  );
  log('JS suite: vitest run (maxWorkers 2)');
  const code = await runSuite(
    process.execPath,
    [
      join(jsDir, 'node_modules/vitest/vitest.mjs'),
      'run',
      '--config',
      config,
      '--maxWorkers=2',
      '--reporter=json',
      `--outputFile=${report}`,
      '--reporter=default',
      ...p.options.only.filter((x) => !isPyPath(x)),
    ],
    {
      cwd: jsDir,
      env: {
        ...testEnv(node, p.cert),
        NODE_OPTIONS: `--import ${join(ASSETS, 'loopback-dns.mjs')}`,
      },
    },
    join(runDir, 'js.log'),
  );
  return { code, report };
}

async function runPython(
  p: Prepared,
  node: Node,
  runDir: string,
): Promise<{ code: number | null; report: string }> {
  const client = p.client!;
  const inside = join(client, 'e2b');
  rmSync(inside, { recursive: true, force: true });
  mkdirSync(inside, { recursive: true });
  cpSync(p.pyDir!, join(inside, 'python-sdk'), { recursive: true });
  cpSync(join(ASSETS, 'pytest_dsec_suites.py'), join(inside, 'plugin', 'pytest_dsec_suites.py'));
  cpSync(join(ASSETS, 'exclude.txt'), join(inside, 'exclude.txt'));
  cpSync(p.cert, join(inside, 'ca.pem'));
  // What installing the package would leave for `importlib.metadata.version('e2b')`, which the
  // SDK reads at import; the sources themselves run from the exported tree.
  const distInfo = join(inside, 'site', `e2b-${PY_VERSION}.dist-info`);
  mkdirSync(distInfo, { recursive: true });
  writeFileSync(
    join(distInfo, 'METADATA'),
    `Metadata-Version: 2.1\nName: e2b\nVersion: ${PY_VERSION}\n`,
  );
  const reportInside = '/e2b/report.jsonl';
  const env: NodeJS.ProcessEnv = {
    ...testEnv(node, '/e2b/ca.pem'),
    PATH: '/usr/sbin:/usr/bin:/sbin:/bin',
    HOME: '/root',
    LANG: 'C.UTF-8',
    SSL_CERT_FILE: '/e2b/ca.pem',
    PYTHONPATH: '/e2b/python-sdk:/e2b/site:/e2b/plugin',
    PYTHONDONTWRITEBYTECODE: '1',
    DSEC_E2B_SUITES_EXCLUDE: '/e2b/exclude.txt',
    DSEC_E2B_SUITES_REPORT: reportInside,
  };
  delete env.NODE_EXTRA_CA_CERTS;
  log(`Python suite (e2b ${PY_VERSION}): pytest -n 2 in the Debian ${DEBIAN_SUITE} client chroot`);
  mkdirSync(join(client, 'proc'), { recursive: true });
  run('mount', ['-t', 'proc', 'proc', join(client, 'proc')]);
  let code: number | null;
  try {
    code = await runSuite(
      'chroot',
      [
        client,
        '/bin/sh',
        '-c',
        `cd /e2b/python-sdk && exec python3 -m pytest -p pytest_dsec_suites -p no:cacheprovider -n 2 -rN ${pyTargets(p.options.only)}`,
      ],
      { env },
      join(runDir, 'py.log'),
    );
  } finally {
    spawnSync('umount', ['-l', join(client, 'proc')]);
  }
  const report = join(runDir, 'py-report.jsonl');
  if (existsSync(join(client, reportInside))) cpSync(join(client, reportInside), report);
  const deselected = `${reportInside}.deselected`;
  if (existsSync(join(client, deselected)))
    cpSync(join(client, deselected), `${report}.deselected`);
  return { code, report };
}

/** The pytest targets: `tests`, or the --only paths that are Python's, shell-quoted. */
function pyTargets(only: string[]): string {
  const paths = only.filter(isPyPath);
  if (paths.length === 0) return 'tests';
  return paths.map((x) => `'${x.replace(/'/g, `'\\''`)}'`).join(' ');
}

/** Throws unless each py exclusion deselected at least one test (read from the plugin's list). */
function checkPyDeselected(report: string, exclusions: Exclusion[]): string[] {
  const path = `${report}.deselected`;
  const ids = existsSync(path)
    ? [...new Set(readFileSync(path, 'utf8').split('\n').filter(Boolean))]
    : [];
  for (const e of exclusions.filter((x) => x.suite === 'py')) {
    if (!ids.some((id) => pyExcluded(id, [e])))
      throw new Error(`exclude.txt: py ${e.target} deselected no test: is the plugin loaded?`);
  }
  return ids.sort();
}

async function inner(p: Prepared): Promise<void> {
  assertLoopbackOnly();
  const o = p.options;
  const exclusions = parseExclusions(readFileSync(join(ASSETS, 'exclude.txt'), 'utf8'));
  const runDir = join(o.work, `run-${new Date().toISOString().replace(/[:.]/g, '-')}`);
  mkdirSync(runDir, { recursive: true });
  // Short: sandboxes' unix sockets live under it, and a socket path has 107 bytes at most.
  const stateDir = `/var/tmp/e2bs-${process.pid}`;
  rmSync(stateDir, { recursive: true, force: true });
  log(`importing the template image ${TEMPLATE_IMAGE}`);
  run(
    process.execPath,
    dsecArgs('image', 'build', '--from-dir', p.image, '--state-dir', stateDir, TEMPLATE_IMAGE),
    {
      cwd: REPO,
      env: { ...process.env, NODE_OPTIONS: '' },
    },
  );
  const node = await startDsec(stateDir, runDir);
  log(`dsec up: ${node.url}`);
  try {
    assertEgressDenied();
  } catch (err) {
    await node.stop();
    throw err;
  }
  const bridge = await startTlsBridge(p.cert, p.key, node.port);
  const results: TestResult[] = [];
  const summaries: SuiteSummary[] = [];
  let pyDeselected: string[] = [];
  try {
    if (o.js) {
      const { code, report } = await runJs(p, node, runDir, exclusions);
      const rs = readJsResults(report, p.jsDir!);
      results.push(...rs);
      summaries.push(summarize('js', rs, code, exclusions));
    }
    if (o.python) {
      const { code, report } = await runPython(p, node, runDir);
      const rs = readPyResults(report, p.pyDir!);
      results.push(...rs);
      summaries.push(summarize('py', rs, code, exclusions));
      // A run of --only paths deselects only the exclusions among them, so none is checked.
      if (rs.length > 0 && o.only.length === 0)
        pyDeselected = checkPyDeselected(report, exclusions);
    }
  } finally {
    await new Promise<void>((r) => bridge.close(() => r()));
    await node.stop();
  }
  mkdirSync(o.out, { recursive: true });
  const leaked = leakedExclusions(results, exclusions);
  writeFileSync(
    join(o.out, 'results.json'),
    `${JSON.stringify({ domain: DOMAIN, runDir, suites: summaries, leaked, pyDeselected, tests: results }, null, 2)}\n`,
  );
  writeFileSync(
    join(o.out, 'failures.txt'),
    results
      .filter((r) => r.outcome === 'failed')
      .map(
        (r) =>
          `${r.suite} ${r.file} > ${r.name}${r.needsServer ? '' : ' [no server]'}\n    ${r.error}\n`,
      )
      .join(''),
  );
  for (const f of ['js-report.json', 'py-report.jsonl', 'js.log', 'py.log', 'dsec-up.log'])
    if (existsSync(join(runDir, f))) cpSync(join(runDir, f), join(o.out, f));
  // The state dir goes once nothing is mounted under it (dsec up unmounts at shutdown).
  const mounts = readFileSync('/proc/self/mountinfo', 'utf8');
  if (!mounts.includes(`${stateDir}/`) && !mounts.includes(` ${stateDir} `))
    rmSync(stateDir, { recursive: true, force: true });
  else log(`mounts left under ${stateDir}: not removed`);
  for (const s of summaries) {
    if (!s.ran) {
      log(`the ${s.suite} suite reported no test (see ${s.suite}.log)`);
      process.exitCode = 1;
    }
  }
  if (leaked.length > 0) {
    log(`EXCLUDED TESTS RAN:\n  ${leaked.join('\n  ')}`);
    process.exitCode = 1;
  }
}

function printSummary(o: Options): void {
  const data = JSON.parse(readFileSync(join(o.out, 'results.json'), 'utf8')) as {
    suites: SuiteSummary[];
    leaked: string[];
  };
  if (o.json) {
    process.stdout.write(
      `${JSON.stringify({ suites: data.suites, leaked: data.leaked, out: o.out }, null, 2)}\n`,
    );
    return;
  }
  for (const s of data.suites) {
    const rate = s.server.passRate === null ? 'n/a' : `${(s.server.passRate * 100).toFixed(1)} %`;
    process.stdout.write(
      `${s.suite === 'js' ? 'JS    ' : 'Python'} ${s.version} @ ${s.commit.slice(0, 12)}: ${s.passed} passed, ${s.failed} failed, ${s.skipped} skipped; ` +
        `needing a server: ${s.server.passed} of ${s.server.passed + s.server.failed} pass (${rate}), ${s.excluded.length} exclusions\n`,
    );
  }
  process.stdout.write(`failures: ${join(o.out, 'failures.txt')}\n`);
}

async function main(): Promise<void> {
  if (process.argv[2] === '--inner') {
    await inner(JSON.parse(readFileSync(process.argv[3]!, 'utf8')) as Prepared);
    return;
  }
  const o = parseArgs(process.argv.slice(2));
  if (process.getuid?.() !== 0)
    usage('needs root (debootstrap, chroot, network namespaces, dsec up)');
  mkdirSync(o.work, { recursive: true });
  const p: Prepared = { options: o, image: '', ...certificate(o) };
  if (o.js) {
    p.jsDir = exportTree(o, JS_COMMIT, 'packages/js-sdk', join(o.work, 'src', `js-${JS_COMMIT}`));
    installJsDeps(p.jsDir);
  }
  if (o.python)
    p.pyDir = exportTree(
      o,
      PY_COMMIT,
      'packages/python-sdk',
      join(o.work, 'src', `py-${PY_COMMIT}`),
    );
  const exclusions = parseExclusions(readFileSync(join(ASSETS, 'exclude.txt'), 'utf8'));
  if (p.jsDir) checkExclusionsExist('js', p.jsDir, exclusions);
  if (p.pyDir) checkExclusionsExist('py', p.pyDir, exclusions);
  const base = debianRoot(o);
  p.image = imageRoot(o, base);
  if (o.python) p.client = clientRoot(o, base);
  const settings = join(o.work, 'inner.json');
  writeFileSync(settings, JSON.stringify(p));
  log('running in a network namespace with only loopback');
  rmSync(join(o.out, 'results.json'), { force: true });
  const r = spawnSync(
    'unshare',
    [
      '--net',
      '--',
      process.execPath,
      '--import',
      'tsx',
      fileURLToPath(import.meta.url),
      '--inner',
      settings,
    ],
    {
      cwd: REPO,
      stdio: 'inherit',
    },
  );
  if (r.status !== 0 || !existsSync(join(o.out, 'results.json'))) {
    log(`the run failed (exit ${r.status ?? r.signal})`);
    if (existsSync(join(o.out, 'results.json'))) printSummary(o);
    process.exit(1);
  }
  printSummary(o);
}

main().catch((err: unknown) => {
  process.stderr.write(`e2b-suites: ${(err as Error).stack ?? String(err)}\n`);
  process.exit(1);
});

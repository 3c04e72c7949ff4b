import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { chmod, chown, mkdir, mkdtemp, readFile, readdir, rm, rmdir, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import puppeteer from 'puppeteer-core';
import type { Browser, Page } from 'puppeteer-core';

/*
 * The dashboard end to end (issue 16, item 2): a real `dsec up` (apiserver,
 * watcher and a local edge running busybox sandboxes), driven from headless
 * Chromium: sign in with `/ui/#key=`, create a sandbox in the UI, run a
 * command in its terminal and read the output off the screen, find the
 * sandbox in the list, stop it. The sign-in form is tried too.
 *
 * Chromium runs as `nobody` with its sandbox on: as root it refuses to start
 * without `--no-sandbox`, which this test never passes (docs/adr/0015).
 * With DSEC_UI_SCREENSHOT=PATH it saves the sandboxes page there
 * (docs/images/dashboard.png).
 */

const REPO = fileURLToPath(new URL('../../../../', import.meta.url));
const CHROMIUM = process.env.DSEC_CHROMIUM ?? '/usr/bin/chromium';
const NOBODY = 65534;
/** Hang bounds, not speed targets. */
const READY_TIMEOUT_MS = 180_000;
const STEP_TIMEOUT_MS = 60_000;

let work: string;
let stateDir: string;
let up: ChildProcess | undefined;
let upExited: Promise<number | null> | undefined;
let upStderr = '';
let url: string;
let adminKey: string;
let chromium: ChildProcess | undefined;
let browser: Browser | undefined;
let cgroupParentsBefore: Set<string>;

function dsecArgs(...args: string[]): string[] {
  return [
    '--conditions=dsec-source',
    '--import',
    'tsx',
    'packages/cli/src/run.ts',
    '--state-dir',
    stateDir,
    ...args,
  ];
}

async function cgroupParents(): Promise<Set<string>> {
  const out = new Set<string>();
  for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [])) {
    const p = join('/sys/fs/cgroup', ctrl, 'dsec');
    if (await stat(p).catch(() => undefined)) out.add(p);
  }
  return out;
}

/** Resolves with the first match of `re` in a growing stream's text. */
function waitFor(stream: NodeJS.ReadableStream, re: RegExp, what: string): Promise<string> {
  return new Promise((resolve, reject) => {
    let text = '';
    const timer = setTimeout(() => reject(new Error(`no ${what}:\n${text}`)), READY_TIMEOUT_MS);
    const on = (chunk: Buffer | string) => {
      text += chunk.toString();
      const m = re.exec(text);
      if (m?.[1]) {
        clearTimeout(timer);
        stream.off('data', on);
        resolve(m[1]);
      }
    };
    stream.on('data', on);
  });
}

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-ui-e2e-'));
  // 0711: sandboxes' mapped roots pass through it to their root filesystems.
  await chmod(work, 0o711);
  stateDir = join(work, 'state');
  cgroupParentsBefore = await cgroupParents();

  // The apiserver serves packages/ui/dist; `npm run build` makes it, this makes sure.
  if (!(await stat(join(REPO, 'packages/ui/dist/index.html')).catch(() => undefined))) {
    const b = spawnSync('npm', ['run', 'build', '-w', '@dsec/ui'], { cwd: REPO, encoding: 'utf8' });
    assert.equal(b.status, 0, b.stderr);
  }
  const built = spawnSync(
    process.execPath,
    dsecArgs('image', 'build', 'busybox', '--from-busybox', '--kind', 'base'),
    { cwd: REPO, encoding: 'utf8', timeout: READY_TIMEOUT_MS },
  );
  assert.equal(built.status, 0, built.stderr);

  up = spawn(
    process.execPath,
    dsecArgs('up', '--port', '0', '--stop-sandboxes', '--no-cgroup-favordynmods'),
    { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'] },
  );
  const child = up;
  child.stderr?.setEncoding('utf8').on('data', (s: string) => (upStderr += s));
  upExited = new Promise((resolve) => child.once('exit', (code) => resolve(code)));
  url = await Promise.race([
    waitFor(child.stdout!, /^ready (\S+)$/m, '`ready` line from dsec up'),
    upExited.then((code) => {
      throw new Error(`dsec up exited ${code}:\n${upStderr}`);
    }),
  ]);
  child.stdout?.resume();
  adminKey = (await readFile(join(stateDir, 'admin.key'), 'utf8')).trim();

  // Chromium's profile must belong to the user it runs as.
  const profile = join(work, 'chromium');
  await mkdir(profile);
  await chown(profile, NOBODY, NOBODY);
  chromium = spawn(
    CHROMIUM,
    [
      '--headless',
      '--remote-debugging-address=127.0.0.1',
      '--remote-debugging-port=0',
      `--user-data-dir=${profile}`,
      '--no-first-run',
      '--no-default-browser-check',
      '--disable-gpu',
      '--disable-extensions',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      '--metrics-recording-only',
      '--password-store=basic',
      '--window-size=1280,800',
      'about:blank',
    ],
    {
      uid: NOBODY,
      gid: NOBODY,
      cwd: profile,
      env: { HOME: profile, PATH: process.env.PATH ?? '' },
      stdio: ['ignore', 'ignore', 'pipe'],
    },
  );
  const endpoint = await waitFor(
    chromium.stderr!,
    /DevTools listening on (ws:\S+)/,
    'DevTools endpoint',
  );
  chromium.stderr?.resume();
  browser = await puppeteer.connect({
    browserWSEndpoint: endpoint,
    defaultViewport: { width: 1280, height: 800 },
  });
});

after(async () => {
  await browser?.disconnect().catch(() => undefined);
  if (chromium && chromium.exitCode === null) {
    const gone = new Promise((r) => chromium!.once('exit', r));
    chromium.kill('SIGTERM');
    await gone;
  }
  if (up && upExited) {
    up.kill('SIGTERM');
    const code = await Promise.race([
      upExited,
      new Promise<'hang'>((r) => setTimeout(() => r('hang'), READY_TIMEOUT_MS).unref()),
    ]);
    if (code === 'hang') up.kill('SIGKILL');
    assert.equal(code, 0, `dsec up exited ${code}:\n${upStderr}`);
  }
  const mounts = (await readFile('/proc/mounts', 'utf8'))
    .split('\n')
    .filter((l) => l.includes(work));
  for (const p of await cgroupParents()) {
    if (!cgroupParentsBefore.has(p)) await rmdir(p).catch(() => undefined);
  }
  if (mounts.length === 0) await rm(work, { recursive: true, force: true });
  assert.deepEqual(mounts, [], 'dsec up left mounts behind');
});

async function api<T>(path: string, method = 'GET'): Promise<T> {
  const res = await fetch(`${url}${path}`, {
    method,
    headers: { authorization: `Bearer ${adminKey}` },
  });
  assert.ok(res.ok, `${method} ${path}: ${res.status}`);
  return (res.status === 204 ? undefined : await res.json()) as T;
}

/** Text of the terminal's rows as shown on screen, one string per row. */
async function terminalRows(page: Page): Promise<string[]> {
  return page.$$eval('.xterm-rows > div', (rows) =>
    rows.map((r) => (r.textContent ?? '').trimEnd()),
  );
}

let sandboxId = '';

/** The sandboxes page with a few more sandboxes in it, saved as a PNG for the README. */
async function takeScreenshot(page: Page, path: `${string}.png`): Promise<void> {
  const extra: string[] = [];
  for (const labels of [
    { team: 'rl', task: 'swe-1042' },
    { team: 'eval', task: 'swe-77' },
  ]) {
    const res = await fetch(`${url}/v1/sandboxes`, {
      method: 'POST',
      headers: { authorization: `Bearer ${adminKey}`, 'content-type': 'application/json' },
      body: JSON.stringify({ image: 'busybox:latest', memoryLimitMb: 256, labels }),
    });
    assert.equal(res.status, 201);
    extra.push(((await res.json()) as { id: string }).id);
  }
  try {
    // A fresh load: no filter from the steps before.
    await page.goto(`${url}/ui/#/sandboxes`);
    await page.reload();
    await page.waitForFunction(
      `document.querySelectorAll('table.sandboxes tbody tr').length >= 3`,
      {
        timeout: STEP_TIMEOUT_MS,
      },
    );
    await mkdir(dirname(path), { recursive: true });
    await page.setViewport({ width: 1280, height: 340 });
    await page.screenshot({ path });
    await page.setViewport({ width: 1280, height: 800 });
  } finally {
    for (const id of extra) await api(`/v1/sandboxes/${encodeURIComponent(id)}`, 'DELETE');
  }
}

test('signing in with #key= keeps the key out of the address and the server', async () => {
  const page = await browser!.newPage();
  const seen: string[] = [];
  page.on('request', (r) => seen.push(r.url()));
  await page.goto(`${url}/ui/#key=${encodeURIComponent(adminKey)}`);
  await page.waitForSelector('header nav', { timeout: STEP_TIMEOUT_MS });
  assert.equal(page.url(), `${url}/ui/#/sandboxes`);
  assert.equal(await page.evaluate('sessionStorage.getItem("dsec.apiKey")'), adminKey);
  // What goes on the wire is the URL without its fragment: no request carries the key in it
  // (the key travels only in Authorization headers).
  assert.ok(seen.length > 1);
  for (const u of seen) assert.ok(!u.split('#')[0]!.includes(adminKey), u);
  await page.waitForFunction(
    'document.querySelector("header .me")?.textContent?.includes("admin")',
    {
      timeout: STEP_TIMEOUT_MS,
    },
  );
  await page.close();
});

test('the sign-in form refuses a wrong key and accepts the right one', async () => {
  const context = await browser!.createBrowserContext();
  const page = await context.newPage();
  await page.goto(`${url}/ui/`);
  await page.waitForSelector('form.signin input[name=key]', { timeout: STEP_TIMEOUT_MS });
  await page.type('input[name=key]', 'dsk_not_a_real_key_0000');
  await page.click('form.signin button[type=submit]');
  await page.waitForSelector('form.signin .error', { timeout: STEP_TIMEOUT_MS });
  await page.$eval('input[name=key]', (el) => ((el as unknown as { value: string }).value = ''));
  await page.type('input[name=key]', adminKey);
  await page.click('form.signin button[type=submit]');
  await page.waitForSelector('header nav', { timeout: STEP_TIMEOUT_MS });
  await context.close();
});

test('create a sandbox in the UI, run a command in its terminal, find it in the list, stop it', async () => {
  const page = await browser!.newPage();
  const label = `ui-${process.pid}-${Date.now()}`;
  await page.goto(`${url}/ui/#key=${encodeURIComponent(adminKey)}`);
  await page.waitForSelector('.toolbar button', { timeout: STEP_TIMEOUT_MS });
  await page.click('.toolbar button');
  await page.waitForSelector('form.create select[name=image] option', { timeout: STEP_TIMEOUT_MS });
  await page.type('form.create input[name=labels]', `test=${label}`);
  await page.click('form.create button[type=submit]');
  await page.waitForFunction('location.hash.startsWith("#/sandboxes/")', {
    timeout: STEP_TIMEOUT_MS,
  });
  sandboxId = decodeURIComponent(
    ((await page.evaluate('location.hash')) as string).slice('#/sandboxes/'.length),
  );
  assert.match(sandboxId, /\S/);

  await page.waitForSelector('[data-terminal-status=connected]', { timeout: STEP_TIMEOUT_MS });
  await page.waitForSelector('.xterm-helper-textarea', { timeout: STEP_TIMEOUT_MS });
  await page.focus('.xterm-helper-textarea');
  // The shell picks the number; the line that is only `dsec-ui-<digits>` is its output, not the echo of the typed command.
  await page.keyboard.type('echo dsec-ui-$RANDOM\n');
  await page.waitForFunction(
    `[...document.querySelectorAll('.xterm-rows > div')].some((r) => /^dsec-ui-\\d+$/.test(r.textContent.trim()))`,
    { timeout: STEP_TIMEOUT_MS },
  );
  const rows = await terminalRows(page);
  const out = rows.find((r) => /^dsec-ui-\d+$/.test(r.trim()));
  assert.ok(out, rows.join('\n'));
  assert.ok(
    rows.some((r) => r.includes('echo dsec-ui-$RANDOM')),
    'the typed command is echoed',
  );

  // The list, filtered by the label the UI set.
  await page.goto(`${url}/ui/#/sandboxes`);
  await page.type('input[aria-label=labels]', `test=${label}`);
  await page.keyboard.press('Tab');
  const row = `tr[data-id="${sandboxId}"]`;
  await page.waitForSelector(`${row} .state-running`, { timeout: STEP_TIMEOUT_MS });
  // The list re-renders as it polls: wait for the filtered table to settle on this one row
  // (counting once raced a re-render that had not filled the table yet).
  await page.waitForFunction(
    `(() => { const trs = document.querySelectorAll('table.sandboxes tbody tr');
      return trs.length === 1 && trs[0].dataset.id === ${JSON.stringify(sandboxId)}; })()`,
    { timeout: STEP_TIMEOUT_MS },
  );
  const screenshot = process.env.DSEC_UI_SCREENSHOT;
  if (screenshot?.endsWith('.png')) await takeScreenshot(page, screenshot as `${string}.png`);

  // Found and clicked in one step inside the page: the list re-renders as it polls, and a
  // button found first and clicked afterwards may already have been replaced.
  await page.waitForFunction(
    `(() => { const b = document.querySelector('${row} button.danger'); if (b) b.click(); return !!b; })()`,
    { timeout: STEP_TIMEOUT_MS },
  );
  // The list shows live sandboxes only: a stopped one leaves it.
  await page.waitForFunction(`!document.querySelector('${row}')`, { timeout: STEP_TIMEOUT_MS });
  const info = await api<{ state: string; spec: { labels: Record<string, string> } }>(
    `/v1/sandboxes/${encodeURIComponent(sandboxId)}`,
  );
  assert.equal(info.state, 'stopped');
  assert.deepEqual(info.spec.labels, { test: label });
  await page.close();
});

test('the nodes, projects and images pages show the fleet', async () => {
  const page = await browser!.newPage();
  await page.goto(`${url}/ui/#key=${encodeURIComponent(adminKey)}`);
  await page.waitForSelector('header nav', { timeout: STEP_TIMEOUT_MS });
  const edges = await api<{ edges: { edgeId: string }[] }>('/v1/edges');
  await page.goto(`${url}/ui/#/nodes`);
  await page.waitForFunction(
    `document.querySelector('main table tbody')?.textContent.includes(${JSON.stringify(edges.edges[0]?.edgeId)})`,
    { timeout: STEP_TIMEOUT_MS },
  );
  assert.ok(await page.$('main .meter'));
  await page.goto(`${url}/ui/#/projects`);
  await page.waitForSelector('.tree .project', { timeout: STEP_TIMEOUT_MS });
  await page.goto(`${url}/ui/#/images`);
  await page.waitForFunction(
    `document.querySelector('main table tbody')?.textContent.includes('busybox')`,
    {
      timeout: STEP_TIMEOUT_MS,
    },
  );
  await page.close();
});

// @dsec/sdk as a user outside the repository gets it: `npm pack`, install the
// tarball into a fresh project in a temp dir, import it, and run
// examples/sdk-outside against an apiserver on 127.0.0.1.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { cp, mkdtemp, readFile, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';

const run = promisify(execFile);
const SDK_DIR = fileURLToPath(new URL('../..', import.meta.url));
const EXAMPLE_DIR = fileURLToPath(new URL('../../../../examples/sdk-outside', import.meta.url));

let dir: string;
let server: TestServer;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-sdk-outside-'));
  server = await startTestServer();
});
after(async () => {
  await server.close();
  await rm(dir, { recursive: true, force: true });
});

test('npm pack builds a standalone tarball that installs and runs outside the repository', async () => {
  // prepack builds dist/ with tsup; the tarball holds only dist/ and package.json.
  const packed = await run('npm', ['pack', '--json', '--pack-destination', dir], {
    cwd: SDK_DIR,
    maxBuffer: 16 << 20,
  });
  // npm's JSON follows the prepack build's output, which may contain brackets of its own.
  const [info] = JSON.parse(packed.stdout.slice(packed.stdout.search(/^\[$/m))) as {
    filename: string;
    files: { path: string }[];
  }[];
  assert.ok(info);
  assert.deepEqual(info.files.map((f) => f.path).sort(), [
    'dist/index.d.ts',
    'dist/index.js',
    'dist/index.js.map',
    'package.json',
  ]);
  const manifest = JSON.parse(await readFile(join(SDK_DIR, 'package.json'), 'utf8')) as {
    dependencies?: Record<string, string>;
    private?: boolean;
  };
  assert.equal(manifest.private, undefined, 'publishable');
  assert.deepEqual(manifest.dependencies ?? {}, {}, 'no runtime dependency to install');
  // Nothing of the workspace is imported at run time: only Node's own modules.
  const js = await readFile(join(SDK_DIR, 'dist/index.js'), 'utf8');
  const imports = [...js.matchAll(/^import .* from ['"]([^'"]+)['"]/gm)].map((m) => m[1]);
  assert.ok(imports.length > 0);
  assert.deepEqual(
    imports.filter((m) => !m?.startsWith('node:')),
    [],
  );
  const dts = await readFile(join(SDK_DIR, 'dist/index.d.ts'), 'utf8');
  assert.doesNotMatch(dts, /from ['"]@dsec\//);

  // A project outside the repository, depending on the tarball (examples/sdk-outside).
  const project = join(dir, 'project');
  await cp(EXAMPLE_DIR, project, { recursive: true });
  await cp(join(dir, info.filename), join(project, info.filename));
  await run('npm', ['install', '--offline', '--no-audit', '--no-fund', '--ignore-scripts'], {
    cwd: project,
  });
  assert.deepEqual(await readdir(join(project, 'node_modules', '@dsec')), ['sdk']);
  const imported = await run(
    process.execPath,
    [
      '-e',
      "import('@dsec/sdk').then((m) => console.log(typeof m.DSecClient, typeof m.DsecError, m.DEFAULT_URL))",
    ],
    { cwd: project },
  );
  assert.equal(imported.stdout, 'function function http://127.0.0.1:7420\n');

  const example = await run(process.execPath, ['index.mjs'], {
    cwd: project,
    env: { ...process.env, DSEC_URL: server.url, DSEC_API_KEY: server.key },
  });
  assert.match(example.stdout, /^key \S+ of project \S+\n/);
  // FakeEdge's commands echo their command line.
  assert.match(example.stdout, /exit 0: echo hello from outside\n/);
  assert.match(example.stdout, /echo streamed\n/);
  assert.match(example.stdout, /read back: written from outside\nstopped\n$/);
  assert.equal((await server.api.app.inject({ method: 'GET', url: '/healthz' })).statusCode, 200);
});

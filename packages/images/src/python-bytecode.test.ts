import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { compilePythonBytecode } from './python-bytecode.js';

// The host's Debian interpreter stands in for a toolkit's (a link to it, as the tree's python3.X).
const HOST_PYTHON = ['/usr/bin/python3.11', '/usr/bin/python3.12', '/usr/bin/python3.13'].find(
  (p) => existsSync(p),
);
const VERSION = HOST_PYTHON ? /python(3\.\d+)$/.exec(HOST_PYTHON)![1]! : '';

async function tree(withInterpreter: boolean): Promise<string> {
  const root = await mkdtemp(join(tmpdir(), 'dsec-pyc-'));
  await mkdir(join(root, 'usr', 'lib', `python${VERSION}`), { recursive: true });
  await mkdir(join(root, 'usr', 'lib', 'python3', 'dist-packages', 'pkg'), { recursive: true });
  await mkdir(join(root, 'usr', 'bin'), { recursive: true });
  await writeFile(join(root, 'usr', 'lib', `python${VERSION}`, 'mod.py'), 'X = 1\n');
  // Python 2 syntax, as some packages ship in test data: left as source, not an error.
  await writeFile(join(root, 'usr', 'lib', `python${VERSION}`, 'old.py'), 'print "x"\n');
  await writeFile(join(root, 'usr', 'lib', 'python3', 'dist-packages', 'pkg', '__init__.py'), '');
  if (withInterpreter) await symlink(HOST_PYTHON!, join(root, 'usr', 'bin', `python${VERSION}`));
  return root;
}

void test(
  'compiles the stdlib and dist-packages to checked-hash bytecode with sandbox paths',
  { skip: HOST_PYTHON ? false : 'no python3.1x on this host' },
  async () => {
    const root = await tree(true);
    try {
      const r = await compilePythonBytecode(root);
      assert.deepEqual(r, { versions: [VERSION] });
      const tag = `cpython-${VERSION.replace('.', '')}`;
      const pyc = join(root, 'usr', 'lib', `python${VERSION}`, '__pycache__', `mod.${tag}.pyc`);
      const header = await readFile(pyc);
      // PEP 552 flags word: bit 0 hash-based, bit 1 check the source against the hash.
      assert.equal(header.readUInt32LE(4), 3);
      const filename = execFileSync(HOST_PYTHON!, [
        '-I',
        '-c',
        'import marshal,sys; print(marshal.loads(open(sys.argv[1],"rb").read()[16:]).co_filename)',
        pyc,
      ])
        .toString()
        .trim();
      assert.equal(filename, `/usr/lib/python${VERSION}/mod.py`);
      assert.ok(
        existsSync(
          join(root, 'usr/lib/python3/dist-packages/pkg/__pycache__', `__init__.${tag}.pyc`),
        ),
      );
      assert.ok(
        !existsSync(join(root, 'usr', 'lib', `python${VERSION}`, '__pycache__', `old.${tag}.pyc`)),
      );
    } finally {
      await rm(root, { recursive: true, force: true });
    }
  },
);

void test('a tree without its own interpreter is left as it is', async () => {
  const root = await tree(false);
  try {
    assert.deepEqual(await compilePythonBytecode(root), { versions: [] });
    assert.ok(!existsSync(join(root, 'usr', 'lib', `python${VERSION}`, '__pycache__')));
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

void test('an interpreter that cannot run here is reported, not thrown', async () => {
  const root = await tree(false);
  try {
    const fake = join(root, 'usr', 'bin', `python${VERSION || '3.11'}`);
    await mkdir(join(root, 'usr', 'lib', `python${VERSION || '3.11'}`), { recursive: true });
    await writeFile(fake, 'not an executable\n', { mode: 0o644 });
    const r = await compilePythonBytecode(root);
    assert.deepEqual(r.versions, []);
    assert.match(r.skipped ?? '', /does not run on this host/);
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

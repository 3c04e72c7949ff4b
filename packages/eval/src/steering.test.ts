import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import {
  LEAVE_OUT_RULES,
  gradingScope,
  leaveOut,
  normalizeRelative,
  pytestConfigChange,
  type Change,
  type TreeEntry,
} from './steering.js';

const file = (content: string, mode = 0o644): TreeEntry => ({
  type: 'file',
  mode,
  content: Buffer.from(content),
});

const BASE_FILES = new Set([
  'pyproject.toml',
  'setup.cfg',
  'package.json',
  'pkg/__init__.py',
  'pkg/core.py',
  'src/lib.py',
  'tests/test_core.py',
  'tests/run.sh',
]);
const BASE_DIRS = new Set(['pkg', 'src', 'tests']);

function scope(testCommand = 'python3 -m pytest -rA tests', testPaths = ['tests/test_new.py']) {
  return gradingScope({
    testPaths,
    testCommand,
    baseKind: (p) => (BASE_FILES.has(p) ? 'file' : BASE_DIRS.has(p) ? 'dir' : undefined),
    isPackage: (dir) => BASE_FILES.has(dir === '' ? '__init__.py' : `${dir}/__init__.py`),
    baseFiles: BASE_FILES,
  });
}

function added(path: string, content = 'x\n'): Change {
  return { path, base: undefined, next: file(content) };
}

function ruleOf(change: Change, s = scope()): string | undefined {
  return leaveOut(change, s)?.rule;
}

test('every steering file an attacker reaches for is left out, by the rule that names it', () => {
  const cases: [string, string][] = [
    ['tests/test_new.py', 'test-file'],
    ['tests', 'test-file'],
    ['tests/test_new.py/x', 'test-file'],
    ['tests/helpers.py', 'test-command-path'],
    ['pytest/__init__.py', 'test-command-path'],
    ['python3', 'test-command-path'],
    ['pkg/test_other.py', 'python-test-file'],
    ['pkg/other_test.py', 'python-test-file'],
    ['app/tests.py', 'python-test-file'],
    ['web/__snapshots__/app.test.js.snap', 'test-snapshot'],
    ['ui/render.snap', 'test-snapshot'],
    ['.pytest_cache/v/cache/lastfailed', 'runner-cache'],
    ['.hypothesis/examples/x', 'runner-cache'],
    ['.tox/py311/bin/python', 'runner-cache'],
    ['web/app.test.mjs', 'js-test-file'],
    ['web/test/helper.js', 'js-test-file'],
    ['web/__tests__/a.ts', 'js-test-file'],
    ['pkg/__pycache__/core.cpython-311.pyc', 'python-bytecode'],
    ['pkg/core.pyc', 'python-bytecode'],
    ['conftest.py', 'pytest-conftest'],
    ['pkg/deep/conftest.py', 'pytest-conftest'],
    ['pytest.ini', 'pytest-ini'],
    ['sub/.pytest.ini', 'pytest-ini'],
    ['pytest.toml', 'pytest-ini'],
    ['sub/pyproject.toml', 'pytest-config-section'],
    ['tox.ini', 'pytest-config-section'],
    ['sitecustomize.py', 'python-startup'],
    ['src/usercustomize.py', 'python-startup'],
    ['anything.pth', 'python-startup'],
    ['pkg.egg-info/entry_points.txt', 'python-metadata'],
    ['x-1.0.dist-info/METADATA', 'python-metadata'],
    ['pkg_steer.EGG-INFO/entry_points.txt', 'python-metadata'],
    ['pkg_steer-0.1.Dist-Info/entry_points.txt', 'python-metadata'],
    ['__editable___pkg_finder.py', 'python-metadata'],
    ['pytest.py', 'python-shadowing'],
    ['_pytest/__init__.py', 'python-shadowing'],
    ['pluggy.py', 'python-shadowing'],
    ['json.py', 'python-shadowing'],
    ['src/json.py', 'python-shadowing'],
    ['unittest/__init__.py', 'python-shadowing'],
    ['_socket.cpython-311-x86_64-linux-gnu.so', 'python-shadowing'],
    ['node_modules/.bin/node', 'node-modules'],
    ['web/node_modules/x/index.js', 'node-modules'],
    ['.npmrc', 'package-manager-config'],
    ['web/.yarnrc.yml', 'package-manager-config'],
    ['.yarn/plugins/x.cjs', 'package-manager-config'],
    ['jest.config.js', 'js-runner-config'],
    ['vitest.config.mts', 'js-runner-config'],
    ['.mocharc.yml', 'js-runner-config'],
    ['babel.config.json', 'js-runner-config'],
    ['tsconfig.build.json', 'js-runner-config'],
  ];
  for (const [path, rule] of cases) {
    assert.equal(ruleOf(added(path)), rule, path);
  }
});

test('ordinary source changes are carried: edits, new modules inside packages, docs, data', () => {
  const carried = [
    added('pkg/new_module.py'),
    added('pkg/json.py'), // inside a package: `pkg.json`, not the standard library's
    added('docs/usage.md'),
    added('src/lib/helper.mjs'),
    added('data/fixture.bin'),
    added('testing_notes.txt'),
    { path: 'pkg/core.py', base: file('a = 1\n'), next: file('a = 2\n') },
    { path: 'src/lib.py', base: file('x\n'), next: undefined },
  ];
  for (const c of carried) assert.equal(leaveOut(c, scope()), undefined, c.path);
});

test('a new package or extension module beside a base module of the same name is shadowing; a new module is not', () => {
  for (const p of [
    'pkg/core/__init__.py',
    'pkg/core.cpython-311-x86_64-linux-gnu.so',
    'pkg/core.abi3.so',
  ]) {
    assert.equal(ruleOf(added(p)), 'python-shadowing', p);
  }
  for (const p of ['pkg/core2/__init__.py', 'pkg/core.v2.py', 'pkg/core/data.json']) {
    assert.equal(ruleOf(added(p)), undefined, p);
  }
});

test('a new top-level copy of a package the repository keeps elsewhere (a src layout) is shadowing', () => {
  // `python -m pytest` puts the working directory first on sys.path, before the editable src/.
  assert.equal(ruleOf(added('lib.py')), 'python-shadowing');
  assert.equal(ruleOf(added('lib/__init__.py')), 'python-shadowing');
  assert.equal(ruleOf(added('src/lib2.py')), undefined);
  assert.equal(ruleOf(added('pkg/lib.py')), undefined); // pkg.lib, inside a package
});

test('an existing top-level module may change; only new ones are taken as shadowing', () => {
  const c: Change = { path: 'src/lib.py', base: file('a\n'), next: file('b\n') };
  assert.equal(ruleOf(c), undefined);
});

test('the test command protects the files it names, test directories, and absent paths; not source directories', () => {
  const s = scope('coverage run -m pytest --cov=src src tests/run.sh pkg::test_x');
  assert.deepEqual([...s.commandPaths].sort(), ['coverage', 'pytest', 'run', 'tests/run.sh']);
  assert.equal(ruleOf(added('src/new.py'), s), undefined);
  assert.equal(
    ruleOf({ path: 'tests/run.sh', base: file('a'), next: file('b') }, s),
    'test-command-path',
  );
  const npm = scope('npm test');
  assert.ok(npm.commandPaths.has('test'));
  assert.equal(ruleOf(added('test/fixture.json'), npm), 'test-command-path');
});

test('beside the tests: a test command that names files still keeps their directories out', () => {
  const s = scope('python3 -m pytest -rA tests/test_core.py', ['tests/test_new.py']);
  // What pytest imports before the test modules, and what would shadow the code for them.
  for (const p of [
    'tests/__init__.py',
    'tests/pkg/core.py',
    'tests/pkg/__init__.py',
    'tests/helpers.py',
  ]) {
    assert.equal(ruleOf(added(p), s), 'test-directory', p);
  }
  assert.equal(ruleOf(added('pkg/helpers.py'), s), undefined);
  const deep = scope('pytest', [
    'astropy/io/tests/test_a.py',
    'testfixtures/tests/test_b.py',
    'tests/unit/test_models/test_c.py',
    'sympy/testing/tests/test_d.py',
    'web/foo_test.go',
  ]);
  assert.deepEqual([...deep.testDirs].sort(), [
    'astropy/io/tests',
    'sympy/testing/tests',
    'testfixtures/tests',
    'tests',
    'tests/unit/test_models',
  ]);
  // The code beside a test directory stays the fix's.
  for (const p of [
    'astropy/io/fits.py',
    'testfixtures/core.py',
    'sympy/testing/runtests.py',
    'web/foo.go',
  ]) {
    assert.equal(ruleOf(added(p), deep), undefined, p);
  }
});

test('make and tox files are left out only when the test command runs them', () => {
  assert.equal(ruleOf(added('Makefile')), undefined);
  assert.equal(ruleOf(added('Makefile'), scope('make test')), 'make-file');
  assert.equal(ruleOf(added('rules.mk'), scope('make check')), 'make-file');
  assert.equal(ruleOf(added('noxfile.py'), scope('nox -s tests')), 'tox-nox');
});

test('pyproject.toml and setup.cfg: ordinary edits pass, anything that can reach pytest does not', () => {
  const base =
    '[project]\nname = "x"\nversion = "1"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n';
  const same = (after: string) => pytestConfigChange(base, after);
  assert.equal(same(base.replace('version = "1"', 'version = "2"')), false);
  assert.equal(same(base + '\n[tool.black]\nline-length = 100\n'), false);
  for (const after of [
    base + 'addopts = "-p evil"\n',
    base.replace('testpaths = ["tests"]', 'testpaths = ["other"]'),
    base.replace('[project]', 'tool.pytest.ini_options.addopts = "-p evil"\n[project]'),
    base.replace('version = "1"', 'version = "1"\nx = { pytest = 1 }'),
    base.replace('name = "x"', 'name = "x"\n[tool."\\u0070ytest".ini_options]'),
    base.replace('name = "x"', 'description = """'),
    base.replace('name = "x"', "description = '''"),
    base.replace('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n', ''),
  ]) {
    assert.notEqual(same(after), false, after);
  }
  const cfg = '[metadata]\nname = x\n\n[tool:pytest]\naddopts = -q\n';
  assert.equal(pytestConfigChange(cfg, cfg.replace('name = x', 'name = y')), false);
  assert.notEqual(pytestConfigChange(cfg, cfg + '    -p evil\n'), false);
  // Through the rule: adding or removing the file is left out whatever it holds.
  assert.equal(ruleOf(added('setup.cfg', '[metadata]\n')), 'pytest-config-section');
  assert.equal(
    ruleOf({ path: 'pyproject.toml', base: file(base), next: undefined }),
    'pytest-config-section',
  );
  assert.equal(
    ruleOf({ path: 'pyproject.toml', base: file(base), next: file(base + '[tool.ruff]\n') }),
    'pytest-config-section',
  );
});

test('package.json: a change to a runner field is left out, others are carried', () => {
  const base = JSON.stringify({ name: 'x', version: '1.0.0', scripts: { test: 'node --test' } });
  const change = (next: unknown): Change => ({
    path: 'package.json',
    base: file(base),
    next: file(typeof next === 'string' ? next : JSON.stringify(next)),
  });
  assert.equal(
    ruleOf(change({ name: 'x', version: '1.0.1', scripts: { test: 'node --test' } })),
    undefined,
  );
  assert.equal(
    ruleOf(change({ name: 'x', version: '1.0.0', scripts: { test: 'echo ok' } })),
    'package-json-runner',
  );
  assert.equal(
    ruleOf(change({ name: 'x', version: '1.0.0', scripts: { test: 'node --test' }, jest: {} })),
    'package-json-runner',
  );
  assert.equal(ruleOf(change('{ not json')), 'package-json-runner');
  assert.equal(
    ruleOf(added('web/package.json', JSON.stringify({ scripts: { test: 'x' } }))),
    'package-json-runner',
  );
  assert.equal(ruleOf(added('web/package.json', JSON.stringify({ name: 'web' }))), undefined);
});

test('normalizeRelative refuses what would leave the repository', () => {
  assert.equal(normalizeRelative('./a//b/'), 'a/b');
  assert.equal(normalizeRelative('a/../b'), undefined);
  assert.equal(normalizeRelative('/etc'), undefined);
  assert.equal(normalizeRelative('a\0b'), undefined);
});

test('every rule is in the table of docs/security.md, and the table has no other', () => {
  const doc = readFileSync(new URL('../../../docs/security.md', import.meta.url), 'utf8');
  const start = doc.indexOf('### What a patch never carries');
  assert.ok(start >= 0, 'docs/security.md has no "What a patch never carries" table');
  const table = doc.slice(start, doc.indexOf('\n### ', start + 1));
  const listed = [...table.matchAll(/^\| `([a-z-]+)` \|/gm)].map((m) => m[1]);
  assert.deepEqual(
    listed,
    LEAVE_OUT_RULES.map((r) => r.id),
  );
});

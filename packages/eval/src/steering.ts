import { PYTHON_STDLIB_MODULES } from './python-modules.js';

/** One side of a repository path: a regular file (its permission bits and bytes) or a symlink. */
export type TreeEntry =
  { type: 'file'; mode: number; content: Buffer } | { type: 'symlink'; target: string };

/**
 * What the agent did to one path of the repository: `base` is the path in a
 * fresh sandbox of the task's environment, `next` in the agent's sandbox
 * (undefined: absent there). Paths are relative to the workdir, `/`-separated,
 * normalised (no `.`, `..` or empty segment).
 */
export interface Change {
  path: string;
  base: TreeEntry | undefined;
  next: TreeEntry | undefined;
}

/** What the rules need to know about the task besides the change itself. */
export interface GradingScope {
  /** Files `test_patch` touches (the grader writes them from the base commit and `test_patch`). */
  testPaths: ReadonlySet<string>;
  /** Repository paths the test command names (`tests`, `tests/run.sh`, `pytest`…). */
  commandPaths: ReadonlySet<string>;
  /** Every word of the test command (`make`, `npm`, `tox`… decide some rules). */
  commandWords: ReadonlySet<string>;
  /** Directories that hold the tests rather than the code (see `testDirectoriesOf`). */
  testDirs: ReadonlySet<string>;
  /** Whether a directory of the repository (`''` for its root) holds an `__init__.py` in the base tree. */
  isPackage(dir: string): boolean;
  /** Whether the base tree has this file. */
  isBaseFile(path: string): boolean;
  /** Modules and packages of the base tree outside any package (`src/pkg/` → `pkg`), by name: where they are. */
  rootModules: ReadonlyMap<string, ReadonlySet<string>>;
}

/**
 * A class of files that steer the test runner or the interpreter rather than
 * fix the code: the grader never carries a change to one of them from the
 * agent's sandbox into the grading sandbox. `test` gives the reason a change
 * is left out, or false.
 */
export interface LeaveOutRule {
  /** Stable ID, recorded in the result line. */
  id: string;
  /** The paths it covers, as docs/security.md lists them. */
  paths: string;
  /** Why such a file can change a test's outcome without a fix. */
  why: string;
  test(change: Change, scope: GradingScope): string | false;
}

/** The test runners' own Python packages: a repository module of one of these names replaces it. */
export const PYTHON_RUNNER_MODULES: ReadonlySet<string> = new Set([
  'pytest',
  '_pytest',
  'pluggy',
  'py',
  'iniconfig',
  'packaging',
  'attr',
  'attrs',
  'more_itertools',
  'pkg_resources',
  'setuptools',
  '_distutils_hack',
  'exceptiongroup',
  'tomli',
  'importlib_metadata',
  'zipp',
  'typing_extensions',
  'coverage',
  'pytest_cov',
  'xdist',
  'hypothesis',
  'nose',
  'nose2',
  'mock',
]);

/** package.json fields that configure how tests run (npm scripts and the runners that read package.json). */
export const PACKAGE_JSON_RUNNER_KEYS = [
  'scripts',
  'jest',
  'mocha',
  'ava',
  'c8',
  'nyc',
  'babel',
  'tap',
  'vitest',
  'xo',
  'config',
] as const;

const JS_EXTENSIONS = new Set(['js', 'mjs', 'cjs', 'ts', 'mts', 'cts', 'jsx', 'tsx']);

/** `a/b/c.py` → `c.py`. */
function baseName(path: string): string {
  const i = path.lastIndexOf('/');
  return i < 0 ? path : path.slice(i + 1);
}

/** `a/b/c.py` → `a/b`; `c.py` → ``. */
function dirName(path: string): string {
  const i = path.lastIndexOf('/');
  return i < 0 ? '' : path.slice(0, i);
}

/** `path` is `root` or lies under it. */
function within(path: string, root: string): boolean {
  return path === root || path.startsWith(root + '/');
}

function extensionOf(name: string): string {
  const i = name.lastIndexOf('.');
  return i <= 0 ? '' : name.slice(i + 1);
}

/** Whether `name` (a file name) is a test file by node's `--test` defaults or jest/vitest's. */
function isJsTestName(name: string): boolean {
  const ext = extensionOf(name);
  if (!JS_EXTENSIONS.has(ext)) return false;
  const stem = name.slice(0, name.length - ext.length - 1);
  return (
    stem === 'test' ||
    stem.startsWith('test-') ||
    stem.endsWith('.test') ||
    stem.endsWith('-test') ||
    stem.endsWith('_test') ||
    stem.endsWith('.spec') ||
    stem.endsWith('-spec') ||
    stem.endsWith('_spec')
  );
}

/** The module name and the directory it would be imported from, for `x.py`, `x.*.so`, `x/__init__.py`. */
function pythonModuleOf(path: string): { name: string; dir: string } | undefined {
  const name = baseName(path);
  if (name === '__init__.py' || name === '__init__.pyc') {
    const pkg = dirName(path);
    if (pkg === '') return undefined;
    return { name: baseName(pkg), dir: dirName(pkg) };
  }
  const dot = name.indexOf('.');
  if (dot <= 0) return undefined;
  const ext = extensionOf(name);
  if (ext !== 'py' && ext !== 'so' && ext !== 'pyd' && ext !== 'pyc') return undefined;
  return { name: name.slice(0, dot), dir: dirName(path) };
}

function text(entry: TreeEntry | undefined): string | undefined {
  return entry?.type === 'file' ? entry.content.toString('utf8') : undefined;
}

/**
 * Why a change of pyproject.toml, setup.cfg or tox.ini could reach pytest's
 * configuration, or false. Deliberately conservative, since neither TOML nor
 * INI is parsed here: the file is split into sections at every line that
 * starts with `[`; the sections that mention pytest must be the same before
 * and after, and no added or removed line may mention pytest or hold a
 * backslash or a triple quote (an escaped key, or a multi-line string that
 * would swallow a section header). A new section is fine when it does not
 * mention pytest: moving base lines under it changes the sections they were
 * in, which the first check sees when those mention pytest.
 */
export function pytestConfigChange(before: string, after: string): string | false {
  const sections = (t: string) => {
    const out: string[][] = [[]];
    for (const line of t.split('\n')) {
      if (line.trimStart().startsWith('[')) out.push([]);
      out[out.length - 1]!.push(line);
    }
    return out
      .map((s) => s.join('\n'))
      .filter((s) => s.toLowerCase().includes('pytest'))
      .join('\n');
  };
  if (sections(before) !== sections(after)) return 'it changes a section that configures pytest';
  const counts = new Map<string, number>();
  for (const line of before.split('\n')) counts.set(line, (counts.get(line) ?? 0) + 1);
  for (const line of after.split('\n')) counts.set(line, (counts.get(line) ?? 0) - 1);
  for (const [line, n] of counts) {
    if (n === 0) continue;
    const t = line.trim();
    if (
      t.toLowerCase().includes('pytest') ||
      t.includes('\\') ||
      t.includes('"""') ||
      t.includes("'''")
    ) {
      return `a changed line could reach pytest's configuration: ${JSON.stringify(t.slice(0, 80))}`;
    }
  }
  return false;
}

function packageJsonRunnerChange(
  before: string | undefined,
  after: string | undefined,
): string | false {
  const parse = (t: string | undefined): Record<string, unknown> | undefined | null => {
    if (t === undefined) return undefined;
    try {
      const v = JSON.parse(t) as unknown;
      return typeof v === 'object' && v !== null && !Array.isArray(v)
        ? (v as Record<string, unknown>)
        : null;
    } catch {
      return null;
    }
  };
  const a = parse(before);
  const b = parse(after);
  if (b === null) return 'the new package.json is not a JSON object';
  for (const key of PACKAGE_JSON_RUNNER_KEYS) {
    if (JSON.stringify(a?.[key]) !== JSON.stringify(b?.[key])) return `it changes "${key}"`;
  }
  return false;
}

/**
 * Every class of file the grader leaves out of the agent's patch, in the
 * order they are tried (the first that matches names the reason). This is
 * the one list; docs/security.md shows it as a table and a test keeps the two
 * in step. Outside the repository nothing is carried at all: site-packages,
 * `/usr/local/bin`, `/etc`, home directories and every process stay in the
 * agent's sandbox.
 */
export const LEAVE_OUT_RULES: readonly LeaveOutRule[] = [
  {
    id: 'test-file',
    paths: 'files `test_patch` touches, and their ancestors and descendants',
    why: 'the grader writes them itself from the base commit and `test_patch`',
    test: (c, s) => {
      for (const t of s.testPaths) {
        if (within(c.path, t) || within(t, c.path)) return `test_patch touches ${t}`;
      }
      return false;
    },
  },
  {
    id: 'test-command-path',
    paths:
      'paths the test command names (`tests`, `tests/run.sh`, `pytest`, `python3`…) and all below them',
    why: 'the runner, its scripts and the tests it collects are the task’s, not the fix’s',
    test: (c, s) => {
      for (const p of s.commandPaths) if (within(c.path, p)) return `the test command names ${p}`;
      return false;
    },
  },
  {
    id: 'test-directory',
    paths:
      'everything under a directory above a test file (of `test_patch` or the test command) named `test`, `tests` or `__tests__`, or the nearest one above it whose name holds `test`',
    why: 'pytest imports the test packages’ `__init__.py` and puts the tests’ directory first on `sys.path`; helpers beside the tests are the task’s, not the fix’s',
    test: (c, s) => {
      for (const d of s.testDirs) if (within(c.path, d)) return `beside the tests, under ${d}`;
      return false;
    },
  },
  {
    id: 'python-test-file',
    paths: '`test_*.py`, `*_test.py`, `tests.py` anywhere',
    why: 'pytest and Django collect them: code the task did not ship would run as tests',
    test: (c) => {
      const n = baseName(c.path);
      return (n.startsWith('test_') && n.endsWith('.py')) ||
        n.endsWith('_test.py') ||
        n === 'tests.py'
        ? 'a test file the Python test runners collect'
        : false;
    },
  },
  {
    id: 'test-snapshot',
    paths: '`__snapshots__/` anywhere, `*.snap`',
    why: 'snapshot tests (jest, vitest, syrupy) pass when the output matches the stored snapshot',
    test: (c) =>
      c.path.split('/').includes('__snapshots__') || c.path.endsWith('.snap')
        ? 'a stored test snapshot'
        : false,
  },
  {
    id: 'js-test-file',
    paths:
      '`*.test.*`, `*-test.*`, `*_test.*`, `test-*.*`, `test.*`, `*.spec.*` (JS/TS), and JS/TS files under `test/`, `tests/`, `__tests__/`',
    why: '`node --test`, jest and vitest collect them',
    test: (c) => {
      const n = baseName(c.path);
      if (isJsTestName(n)) return 'a test file the JS test runners collect';
      const segs = c.path.split('/').slice(0, -1);
      if (
        JS_EXTENSIONS.has(extensionOf(n)) &&
        segs.some((d) => d === 'test' || d === 'tests' || d === '__tests__')
      ) {
        return 'under a test directory the JS test runners collect';
      }
      return false;
    },
  },
  {
    id: 'python-bytecode',
    paths: '`__pycache__/` anywhere, `*.pyc`, `*.pyo`',
    why: 'Python imports bytecode in place of (or without) its source; pytest caches rewritten tests there',
    test: (c) =>
      c.path.split('/').includes('__pycache__') ||
      c.path.endsWith('.pyc') ||
      c.path.endsWith('.pyo')
        ? 'bytecode'
        : false,
  },
  {
    id: 'runner-cache',
    paths: '`.pytest_cache/`, `.hypothesis/`, `.tox/`, `.nox/` anywhere',
    why: 'the runners’ own state: last failures, example databases, environments',
    test: (c) =>
      c.path
        .split('/')
        .some((s) => s === '.pytest_cache' || s === '.hypothesis' || s === '.tox' || s === '.nox')
        ? 'a test runner’s cache'
        : false,
  },
  {
    id: 'pytest-conftest',
    paths: '`conftest.py` anywhere',
    why: 'pytest loads every conftest.py above and beside the tests: hooks can rewrite any outcome',
    test: (c) => (baseName(c.path) === 'conftest.py' ? 'a pytest conftest' : false),
  },
  {
    id: 'pytest-ini',
    paths: '`pytest.ini`, `.pytest.ini`, `pytest.toml`, `.pytest.toml` anywhere',
    why: 'pytest configuration: `addopts`, plugins, collection, the root directory',
    test: (c) =>
      ['pytest.ini', '.pytest.ini', 'pytest.toml', '.pytest.toml'].includes(baseName(c.path))
        ? 'a pytest configuration file'
        : false,
  },
  {
    id: 'pytest-config-section',
    paths:
      '`pyproject.toml`, `setup.cfg`, `tox.ini`: added, removed, or changed where a change can reach `[tool.pytest.ini_options]`, `[tool:pytest]`, `[pytest]`',
    why: 'pytest reads its configuration (and its root directory) from these',
    test: (c) => {
      if (!['pyproject.toml', 'setup.cfg', 'tox.ini'].includes(baseName(c.path))) return false;
      const before = text(c.base);
      const after = text(c.next);
      if (before === undefined || after === undefined) {
        return 'adding, removing or replacing a file pytest reads its configuration from';
      }
      return pytestConfigChange(before, after);
    },
  },
  {
    id: 'python-startup',
    paths: '`sitecustomize.py`, `usercustomize.py`, `*.pth` anywhere',
    why: 'the interpreter runs them at start-up, before any test',
    test: (c) => {
      const n = baseName(c.path);
      return n === 'sitecustomize.py' || n === 'usercustomize.py' || n.endsWith('.pth')
        ? 'an interpreter start-up hook'
        : false;
    },
  },
  {
    id: 'python-metadata',
    paths: '`*.egg-info/`, `*.dist-info/`, `*.egg-link`, `__editable__*` anywhere',
    why: 'distribution metadata: entry points load pytest plugins (`pytest11`), editable-install finders redirect imports',
    test: (c) => {
      // importlib.metadata lower-cases names before it compares them: `X.EGG-INFO` counts too.
      const segs = c.path.toLowerCase().split('/');
      const n = segs[segs.length - 1]!;
      return segs.some((s) => s.endsWith('.egg-info') || s.endsWith('.dist-info')) ||
        n.endsWith('.egg-link') ||
        n.startsWith('__editable__')
        ? 'installed-distribution metadata'
        : false;
    },
  },
  {
    id: 'python-shadowing',
    paths:
      'a new module or package outside any package named like one of the repository’s own elsewhere (`pkg/` beside `src/pkg/`), the standard library or a test-runner package (`pytest.py`, `_pytest/`, `pluggy/`, `json.py`…); a new package or extension module beside a module of the base tree of the same name (`calc/__init__.py`, `calc.*.so` beside `calc.py`)',
    why: 'the working directory comes first on `sys.path`, and a package or an extension module is imported before a `.py` of the same name: it would be imported instead of the real one',
    test: (c, s) => {
      if (c.base !== undefined) return false;
      const m = pythonModuleOf(c.path);
      if (!m) return false;
      const beside = `${m.dir === '' ? '' : `${m.dir}/`}${m.name}.py`;
      const ext = extensionOf(c.path);
      const shadows = baseName(c.path) === '__init__.py' || ext === 'so' || ext === 'pyd';
      if (shadows && s.isBaseFile(beside)) {
        return `imported instead of ${beside}, which stays as it was`;
      }
      if (s.isPackage(m.dir)) return false;
      const elsewhere = [...(s.rootModules.get(m.name) ?? [])].find((d) => d !== m.dir);
      if (elsewhere !== undefined) {
        return `shadows the repository's own ${m.name} (in ${elsewhere === '' ? 'the root' : elsewhere})`;
      }
      if (PYTHON_RUNNER_MODULES.has(m.name)) return `shadows the test runner's ${m.name}`;
      if (PYTHON_STDLIB_MODULES.has(m.name)) return `shadows the standard library's ${m.name}`;
      return false;
    },
  },
  {
    id: 'node-modules',
    paths: '`node_modules/` anywhere',
    why: 'module resolution prefers it; npm puts `node_modules/.bin` first on the PATH of scripts',
    test: (c) =>
      c.path.split('/').includes('node_modules') ? 'installed packages and .bin shims' : false,
  },
  {
    id: 'package-manager-config',
    paths: '`.npmrc`, `.yarnrc`, `.yarnrc.yml`, `.pnpmfile.cjs`, `bunfig.toml`, `.yarn/` anywhere',
    why: 'npm and its kin read options from them (`node-options` becomes every script’s NODE_OPTIONS)',
    test: (c) =>
      ['.npmrc', '.yarnrc', '.yarnrc.yml', '.pnpmfile.cjs', 'bunfig.toml'].includes(
        baseName(c.path),
      ) || c.path.split('/').includes('.yarn')
        ? 'package-manager configuration'
        : false,
  },
  {
    id: 'package-json-runner',
    paths: `\`package.json\` anywhere, when it changes ${PACKAGE_JSON_RUNNER_KEYS.map((k) => `\`${k}\``).join(', ')}`,
    why: '`npm test` runs `scripts.test`; jest, mocha, ava, c8, nyc and vitest read their options there',
    test: (c) =>
      baseName(c.path) === 'package.json'
        ? packageJsonRunnerChange(text(c.base), text(c.next))
        : false,
  },
  {
    id: 'js-runner-config',
    paths:
      'jest/vitest/vite/ava/karma/playwright/cypress/babel configs, `.mocharc*`, `.babelrc*`, `.nycrc*`, `.c8rc*`, `.swcrc`, `.taprc`, `tsconfig*.json`, `jsconfig.json`',
    why: 'test-runner and transpiler configuration: setup files, module maps, transforms',
    test: (c) => {
      const n = baseName(c.path);
      const stem = n.split('.')[0]!;
      const configs = [
        'jest',
        'vitest',
        'vite',
        'ava',
        'karma',
        'playwright',
        'cypress',
        'babel',
        'wdio',
      ];
      if (
        configs.includes(stem) &&
        (n.startsWith(`${stem}.config.`) ||
          n.startsWith(`${stem}.conf.`) ||
          n.startsWith(`${stem}.workspace.`))
      ) {
        return 'test-runner configuration';
      }
      if (
        ['.mocharc', '.babelrc', '.nycrc', '.c8rc', '.swcrc', '.taprc'].some(
          (p) => n === p || n.startsWith(`${p}.`),
        )
      ) {
        return 'test-runner configuration';
      }
      if (
        n === 'mocha.opts' ||
        n === 'jsconfig.json' ||
        (n.startsWith('tsconfig') && n.endsWith('.json'))
      ) {
        return 'compiler configuration the test runners read';
      }
      return false;
    },
  },
  {
    id: 'make-file',
    paths:
      '`Makefile`, `makefile`, `GNUmakefile`, `*.mk` anywhere, when the test command runs make',
    why: 'the targets the test command runs',
    test: (c, s) => {
      if (!s.commandWords.has('make') && !s.commandWords.has('gmake')) return false;
      const n = baseName(c.path);
      return ['Makefile', 'makefile', 'GNUmakefile'].includes(n) || n.endsWith('.mk')
        ? 'a makefile the test command runs'
        : false;
    },
  },
  {
    id: 'tox-nox',
    paths: '`tox.ini`, `noxfile.py` anywhere, when the test command runs tox or nox',
    why: 'their sessions are the test command',
    test: (c, s) => {
      const n = baseName(c.path);
      if (s.commandWords.has('tox') && n === 'tox.ini')
        return 'the tox configuration the test command runs';
      if (s.commandWords.has('nox') && n === 'noxfile.py')
        return 'the nox sessions the test command runs';
      return false;
    },
  },
];

/** The rule that leaves a change out, with its reason, or undefined when the change is carried over. */
export function leaveOut(
  change: Change,
  scope: GradingScope,
): { rule: string; reason: string } | undefined {
  for (const r of LEAVE_OUT_RULES) {
    const reason = r.test(change, scope);
    if (reason !== false) return { rule: r.id, reason };
  }
  return undefined;
}

/**
 * The scope of a task's grading: the test files, and the paths and words of
 * its test command. A word is taken as a path when it does not start with
 * `-` or `/` and holds no `=` (`path::node` keeps the path part). A named
 * path that is a file in the base tree, or absent from it (`pytest`,
 * `python3`: a file put there would be what the command runs), is protected
 * with all below it; a named directory only when its name says tests
 * (`tests`, `test`, `testing`…), so that `pytest src/pkg` does not keep the
 * fix itself out.
 */
export function gradingScope(options: {
  testPaths: Iterable<string>;
  testCommand: string;
  /** What the path is in the base tree. */
  baseKind: (path: string) => 'file' | 'dir' | undefined;
  isPackage: (dir: string) => boolean;
  /** Every file of the base tree. */
  baseFiles?: Iterable<string> | undefined;
}): GradingScope {
  const baseKind = options.baseKind;
  const rootModules = new Map<string, Set<string>>();
  for (const f of options.baseFiles ?? []) {
    const m = pythonModuleOf(f);
    if (!m || options.isPackage(m.dir)) continue;
    const dirs = rootModules.get(m.name) ?? new Set<string>();
    dirs.add(m.dir);
    rootModules.set(m.name, dirs);
  }
  const words = new Set<string>();
  let word = '';
  for (const ch of options.testCommand) {
    if (' \t\n;&|()<>`\'"$'.includes(ch)) {
      if (word) words.add(word);
      word = '';
    } else word += ch;
  }
  if (word) words.add(word);
  const commandPaths = new Set<string>();
  for (const w of words) {
    if (w.startsWith('-') || w.includes('=') || w.startsWith('/')) continue;
    const p = normalizeRelative(w.split('::')[0]!);
    if (p === undefined || p === '') continue;
    if (options.baseKind(p) !== 'dir' || baseName(p).toLowerCase().includes('test'))
      commandPaths.add(p);
  }
  const testPaths = new Set(options.testPaths);
  return {
    testPaths,
    commandPaths,
    commandWords: words,
    testDirs: testDirectoriesOf([...testPaths, ...commandPaths]),
    isPackage: options.isPackage,
    isBaseFile: (p) => baseKind(p) === 'file',
    rootModules,
  };
}

/**
 * The directories that hold the tests of `paths` (test files): above each,
 * every directory named `test`, `tests` or `__tests__`, and the nearest one
 * whose name holds `test` (`astropy/io/tests`, `testing`, `sympy/testing/tests`).
 * The nearest, not the farthest: `testfixtures/tests` keeps `testfixtures`, the
 * code, out of it. What lies there is the tests' (helpers, `__init__.py`,
 * modules that would shadow the code for them), never the fix's.
 */
export function testDirectoriesOf(paths: Iterable<string>): Set<string> {
  const out = new Set<string>();
  for (const p of paths) {
    let nearest = true;
    for (let d = dirName(p); d !== ''; d = dirName(d)) {
      const n = baseName(d).toLowerCase();
      if (n === 'test' || n === 'tests' || n === '__tests__' || (nearest && n.includes('test'))) {
        out.add(d);
      }
      if (n.includes('test')) nearest = false;
    }
  }
  return out;
}

/** `./a//b/` → `a/b`; undefined for anything with `..`, a NUL or a leading `/`. */
export function normalizeRelative(path: string): string | undefined {
  if (path.startsWith('/') || path.includes('\0')) return undefined;
  const out: string[] = [];
  for (const s of path.split('/')) {
    if (s === '' || s === '.') continue;
    if (s === '..') return undefined;
    out.push(s);
  }
  return out.join('/');
}

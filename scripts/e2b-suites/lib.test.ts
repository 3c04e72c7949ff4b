/**
 * Tests of scripts/e2b-suites/lib.ts and of the two files the suites' processes load
 * (loopback-dns.mjs, pytest_dsec_suites.py). Run with
 * `node --conditions=dsec-source --import tsx --test scripts/e2b-suites/lib.test.ts`.
 * Nothing here resolves or reaches a name off the machine: the lookup tests run in a network
 * namespace of their own (`unshare --net`, root) and are skipped without one.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { after, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import {
  checkExclusionsExist,
  globMatch,
  jsTestNeedsServer,
  leakedExclusions,
  parseExclusions,
  pyExcluded,
  pyFileNeedsServer,
  readJsResults,
  readPyResults,
  summarize,
  type TestResult,
} from './lib.js';

const HERE = dirname(fileURLToPath(import.meta.url));
const work = mkdtempSync(join(tmpdir(), 'e2b-suites-lib-'));
after(() => rmSync(work, { recursive: true, force: true }));

describe('exclude.txt', () => {
  test('the shipped file parses, and every entry has a reason of a known kind', () => {
    const entries = parseExclusions(readFileSync(join(HERE, 'exclude.txt'), 'utf8'));
    assert.ok(entries.length >= 10);
    for (const e of entries) assert.match(e.reason, /^(internet|cloud|browser): \S/);
    // The tests that curl public addresses are among them.
    const targets = entries.map((e) => `${e.suite} ${e.target}`);
    assert.ok(targets.includes('js tests/sandbox/network.test.ts'));
    assert.ok(targets.includes('js tests/sandbox/internetAccess.test.ts'));
    assert.ok(targets.includes('py tests/sync/sandbox_sync/test_internet_access.py'));
  });

  test('bad lines are refused with their line number', () => {
    assert.throws(() => parseExclusions('js tests/a.test.ts\n'), /exclude\.txt:1:/);
    assert.throws(() => parseExclusions('# c\nrb tests/a.rb -- internet: x\n'), /exclude\.txt:2:/);
    assert.throws(() => parseExclusions('js tests/a.test.ts -- because: x\n'), /exclude\.txt:1:/);
    // vitest cannot deselect one test from outside its file
    assert.throws(
      () => parseExclusions('js tests/a.test.ts::one -- internet: x\n'),
      /a js entry is a file or a glob/,
    );
  });

  test('paths leaving the SDK directory are refused', () => {
    assert.throws(() => parseExclusions('py /etc/passwd -- cloud: x\n'), /relative to the SDK/);
    assert.throws(
      () => parseExclusions('py tests/../../x.py -- cloud: x\n'),
      /relative to the SDK/,
    );
    assert.throws(() => parseExclusions('js ../tests/** -- cloud: x\n'), /relative to the SDK/);
  });

  test('an entry naming no file of the tree is refused before a run (a typo would let it run)', () => {
    const dir = join(work, 'tree');
    mkdirSync(join(dir, 'tests/sandbox'), { recursive: true });
    writeFileSync(join(dir, 'tests/sandbox/network.test.ts'), '');
    const ok = parseExclusions('js tests/sandbox/network.test.ts -- internet: x\n');
    checkExclusionsExist('js', dir, ok);
    const glob = parseExclusions('js tests/** -- browser: x\n');
    checkExclusionsExist('js', dir, glob);
    const typo = parseExclusions('js tests/sandbox/netwrok.test.ts -- internet: x\n');
    assert.throws(() => checkExclusionsExist('js', dir, typo), /names no file/);
    const py = parseExclusions('py tests/sandbox/network.test.ts::t -- internet: x\n');
    checkExclusionsExist('py', dir, py);
  });

  test('globs and pytest IDs match as documented', () => {
    assert.ok(globMatch('tests/runtimes/**', 'tests/runtimes/browser/run.test.tsx'));
    assert.ok(globMatch('tests/*.test.ts', 'tests/a.test.ts'));
    assert.ok(!globMatch('tests/*.test.ts', 'tests/x/a.test.ts'));
    assert.ok(!globMatch('tests/a.test.ts', 'tests/aXtest.ts'), 'a dot is a dot');
    const e = parseExclusions('py tests/t.py -- internet: x\npy tests/u.py::one -- internet: y\n');
    assert.ok(pyExcluded('tests/t.py::anything', e));
    assert.ok(pyExcluded('tests/u.py::one', e));
    assert.ok(pyExcluded('tests/u.py::one[param]', e));
    assert.ok(!pyExcluded('tests/u.py::one_more', e));
    assert.ok(!pyExcluded('tests/t.pyc::x', e));
  });
});

describe('which tests need a server', () => {
  test('JS: fixtures and real calls do, mocked tests do not', () => {
    assert.ok(jsTestNeedsServer("sandboxTest('x', async ({ sandbox }) => {", false));
    assert.ok(jsTestNeedsServer("  buildTemplateTest.skipIf(isDebug)('t', async () => {", true));
    assert.ok(jsTestNeedsServer("test('c', async () => {\n  await Sandbox.create(t)\n})", false));
    assert.ok(
      !jsTestNeedsServer(
        "test('d', async () => {\n  vi.stubGlobal('fetch', f)\n  await Sandbox.connect('x')",
        false,
      ),
    );
    assert.ok(
      !jsTestNeedsServer("test('e', async () => {\n  await Template.exists('a')\n})", true),
    );
    assert.ok(
      !jsTestNeedsServer("test('f', () => {\n  expect(stripAnsi('x')).toBe('x')\n})", false),
    );
  });

  test('Python: sandbox fixtures and calls do; a file without them does not', () => {
    assert.ok(pyFileNeedsServer('def test_x(sandbox: Sandbox):\n    pass\n'));
    assert.ok(pyFileNeedsServer('async def test_y(async_sandbox):\n    pass\n'));
    assert.ok(pyFileNeedsServer('def test_z(template):\n    s = Sandbox.create(template)\n'));
    assert.ok(
      !pyFileNeedsServer('from e2b.sandbox.commands import X\n\ndef test_decode():\n    X()\n'),
    );
    assert.ok(!pyFileNeedsServer('def test_m(sandbox, monkeypatch):\n    pass\n'));
  });
});

describe('reports', () => {
  test("vitest's JSON report: outcomes, first error lines, per-test server needs, load failures", () => {
    const dir = join(work, 'js');
    mkdirSync(join(dir, 'tests'), { recursive: true });
    const file = join(dir, 'tests/mixed.test.ts');
    writeFileSync(
      file,
      [
        "import { http } from 'msw'", // 1
        "test('unit', () => {", // 2
        '  expect(1).toBe(1)', // 3
        '})', // 4
        "sandboxTest('real', async ({ sandbox }) => {", // 5
        "  await sandbox.files.write('a', 'b')", // 6
        '})', // 7
      ].join('\n'),
    );
    writeFileSync(join(dir, 'tests/broken.test.ts'), "sandboxTest('x', async ({ sandbox }) => {})");
    const report = join(dir, 'report.json');
    writeFileSync(
      report,
      JSON.stringify({
        testResults: [
          {
            name: file,
            status: 'failed',
            assertionResults: [
              {
                ancestorTitles: [],
                title: 'unit',
                status: 'passed',
                location: { line: 2, column: 1 },
              },
              {
                ancestorTitles: ['group'],
                title: 'real',
                status: 'failed',
                failureMessages: [
                  '\u001b[31m\n  AssertionError: expected 1 to be 2\u001b[39m\n    at x',
                ],
                location: { line: 5, column: 1 },
              },
              {
                ancestorTitles: [],
                title: 'later',
                status: 'pending',
                location: { line: 5, column: 1 },
              },
            ],
          },
          {
            name: join(dir, 'tests/broken.test.ts'),
            status: 'failed',
            message: 'SyntaxError: Unexpected token\nmore',
            assertionResults: [],
          },
        ],
      }),
    );
    const rs = readJsResults(report, dir);
    assert.deepEqual(
      rs.map((r) => [r.file, r.name, r.outcome, r.error, r.needsServer]),
      [
        ['tests/mixed.test.ts', 'unit', 'passed', '', false],
        [
          'tests/mixed.test.ts',
          'group > real',
          'failed',
          'AssertionError: expected 1 to be 2',
          true,
        ],
        ['tests/mixed.test.ts', 'later', 'skipped', '', true],
        ['tests/broken.test.ts', '(file)', 'failed', 'SyntaxError: Unexpected token', true],
      ],
    );
  });

  test("the plugin's outcomes: a failure wins over a later teardown record, ids split into file and test", () => {
    const dir = join(work, 'py');
    mkdirSync(join(dir, 'tests'), { recursive: true });
    writeFileSync(join(dir, 'tests/test_a.py'), 'def test_one(sandbox):\n    pass\n');
    const report = join(dir, 'report.jsonl');
    writeFileSync(
      report,
      [
        {
          id: 'tests/test_a.py::test_one',
          when: 'call',
          outcome: 'failed',
          error: 'assert 1 == 2',
        },
        { id: 'tests/test_a.py::test_one', when: 'teardown', outcome: 'failed', error: 'later' },
        { id: 'tests/test_a.py::test_two[x]', when: 'call', outcome: 'passed', error: '' },
        { id: 'tests/test_a.py::test_three', when: 'setup', outcome: 'skipped', error: '' },
      ]
        .map((r) => JSON.stringify(r))
        .join('\n'),
    );
    const rs = readPyResults(report, dir);
    assert.deepEqual(
      rs.map((r) => [r.name, r.outcome, r.error, r.needsServer]),
      [
        ['test_one', 'failed', 'assert 1 == 2', true],
        ['test_two[x]', 'passed', '', true],
        ['test_three', 'skipped', '', true],
      ],
    );
  });

  test('summary: the pass rate counts only tests that need a server, skipped ones left out', () => {
    const r = (outcome: TestResult['outcome'], needsServer: boolean): TestResult => ({
      suite: 'js',
      file: 'f',
      name: 'n',
      outcome,
      error: '',
      needsServer,
    });
    const s = summarize(
      'js',
      [
        r('passed', true),
        r('passed', true),
        r('failed', true),
        r('skipped', true),
        r('failed', false),
      ],
      1,
      parseExclusions('js tests/a.test.ts -- internet: x\npy tests/b.py -- internet: y\n'),
    );
    assert.equal(s.passed, 2);
    assert.equal(s.failed, 2);
    assert.equal(s.skipped, 1);
    assert.deepEqual(s.server, { passed: 2, failed: 1, skipped: 1, passRate: 2 / 3 });
    assert.deepEqual(s.excluded, ['tests/a.test.ts -- internet: x']);
    assert.equal(summarize('py', [], null, []).server.passRate, null);
  });

  test('an excluded test found in a report is reported as leaked', () => {
    const ex = parseExclusions(
      'js tests/sandbox/network.test.ts -- internet: x\npy tests/t.py::a -- internet: y\n',
    );
    const base = { outcome: 'passed' as const, error: '', needsServer: true };
    const leaked = leakedExclusions(
      [
        { ...base, suite: 'js', file: 'tests/sandbox/network.test.ts', name: 'allow 1.1.1.1' },
        { ...base, suite: 'js', file: 'tests/sandbox/kill.test.ts', name: 'kill' },
        { ...base, suite: 'py', file: 'tests/t.py', name: 'a' },
        { ...base, suite: 'py', file: 'tests/t.py', name: 'b' },
      ],
      ex,
    );
    assert.deepEqual(leaked, [
      'js tests/sandbox/network.test.ts > allow 1.1.1.1',
      'py tests/t.py > a',
    ]);
  });
});

/** Whether this process may make network namespaces (root with util-linux's unshare). */
const canUnshare = spawnSync('unshare', ['--net', '--', 'true'], { stdio: 'ignore' }).status === 0;

describe('name lookups in the suites’ processes (in a network namespace of their own)', () => {
  test(
    'loopback-dns.mjs: the domain and its subdomains are 127.0.0.1, other names fail without a query',
    { skip: !canUnshare && 'needs root and unshare --net' },
    () => {
      const script = `
        import dns from 'node:dns';
        const out = {};
        for (const name of ['api.e2b.test', '49983-sbabc.E2B.test.', 'e2b.test', 'localhost', 'example.com', 'e2b.test.evil.org']) {
          try { out[name] = (await dns.promises.lookup(name)).address; } catch (e) { out[name] = e.code; }
        }
        out.all = await new Promise((r) => dns.lookup('api.e2b.test', { all: true }, (e, a) => r(e ? e.code : a)));
        out.literal = (await dns.promises.lookup('127.0.0.1')).address;
        console.log(JSON.stringify(out));`;
      const r = spawnSync(
        'unshare',
        [
          '--net',
          '--',
          process.execPath,
          '--import',
          join(HERE, 'loopback-dns.mjs'),
          '--input-type=module',
          '-e',
          script,
        ],
        { env: { PATH: process.env.PATH, DSEC_E2B_SUITES_DOMAIN: 'e2b.test' }, encoding: 'utf8' },
      );
      assert.equal(r.status, 0, r.stderr);
      assert.deepEqual(JSON.parse(r.stdout), {
        'api.e2b.test': '127.0.0.1',
        '49983-sbabc.E2B.test.': '127.0.0.1',
        'e2b.test': '127.0.0.1',
        localhost: '127.0.0.1',
        'example.com': 'ENOTFOUND',
        'e2b.test.evil.org': 'ENOTFOUND',
        all: [{ address: '127.0.0.1', family: 4 }],
        literal: '127.0.0.1',
      });
    },
  );

  test('loopback-dns.mjs refuses to load without a domain', () => {
    const r = spawnSync(process.execPath, ['--import', join(HERE, 'loopback-dns.mjs'), '-e', '0'], {
      env: { PATH: process.env.PATH },
      encoding: 'utf8',
    });
    assert.notEqual(r.status, 0);
    assert.match(r.stderr, /DSEC_E2B_SUITES_DOMAIN is not set/);
  });

  const hasPytest =
    spawnSync('/usr/bin/python3', ['-m', 'pytest', '--version'], { stdio: 'ignore' }).status === 0;
  test(
    'pytest_dsec_suites.py: deselects excluded tests before they run, reports outcomes, resolves loopback only',
    {
      skip:
        (!canUnshare || !hasPytest) && 'needs root, unshare --net and /usr/bin/python3 -m pytest',
    },
    () => {
      const dir = join(work, 'pyplugin');
      mkdirSync(join(dir, 'tests'), { recursive: true });
      const marker = join(dir, 'ran-excluded');
      writeFileSync(
        join(dir, 'tests/test_s.py'),
        [
          'import socket',
          'def test_domain():',
          "    assert socket.getaddrinfo('api.e2b.test', 443)[0][4][0] == '127.0.0.1'",
          'def test_public():',
          "    socket.getaddrinfo('example.com', 443)",
          'def test_excluded():',
          `    open(${JSON.stringify(marker)}, 'w').write('ran')`,
          '',
        ].join('\n'),
      );
      writeFileSync(
        join(dir, 'tests/test_gone.py'),
        `def test_x():\n    open(${JSON.stringify(marker)}, 'w').write('ran')\n`,
      );
      writeFileSync(
        join(dir, 'exclude.txt'),
        'js tests/x.test.ts -- internet: ignored here\npy tests/test_s.py::test_excluded -- internet: x\npy tests/test_gone.py -- internet: y\n',
      );
      const report = join(dir, 'report.jsonl');
      const r = spawnSync(
        'unshare',
        [
          '--net',
          '--',
          '/usr/bin/python3',
          '-m',
          'pytest',
          '-p',
          'pytest_dsec_suites',
          '-p',
          'no:cacheprovider',
          '-q',
          'tests',
        ],
        {
          cwd: dir,
          encoding: 'utf8',
          env: {
            PATH: process.env.PATH,
            PYTHONPATH: HERE,
            PYTHONDONTWRITEBYTECODE: '1',
            DSEC_E2B_SUITES_DOMAIN: 'e2b.test',
            DSEC_E2B_SUITES_EXCLUDE: join(dir, 'exclude.txt'),
            DSEC_E2B_SUITES_REPORT: report,
          },
        },
      );
      assert.equal(r.status, 1, r.stdout + r.stderr); // test_public fails
      assert.match(r.stdout, /1 failed, 1 passed, 2 deselected/);
      assert.throws(() => readFileSync(marker), /ENOENT/);
      const rows = readFileSync(report, 'utf8')
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l) as { id: string; outcome: string; error: string });
      assert.deepEqual(
        rows.map((x) => [x.id, x.outcome]),
        [
          ['tests/test_s.py::test_domain', 'passed'],
          ['tests/test_s.py::test_public', 'failed'],
        ],
      );
      assert.match(rows[1]!.error, /resolves loopback only/);
      assert.deepEqual(readFileSync(`${report}.deselected`, 'utf8').trim().split('\n').sort(), [
        'tests/test_gone.py::test_x',
        'tests/test_s.py::test_excluded',
      ]);
    },
  );
});

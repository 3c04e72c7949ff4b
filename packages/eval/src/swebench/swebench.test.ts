import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { loadSwebenchDataset, testDirectives } from './dataset.js';
import { swebenchEvalScript, swebenchVerdict, testOutputOf } from './grade.js';
import { swebenchImageRef } from '../task-images.js';
import { patchFiles } from './patch-files.js';
import { loadSpecs, specFor } from './specs.js';

const dir = mkdtempSync(join(tmpdir(), 'swebench-test-'));

const TEST_PATCH = [
  'diff --git a/tests/test_calc.py b/tests/test_calc.py',
  '--- a/tests/test_calc.py',
  '+++ b/tests/test_calc.py',
  '@@ -1 +1,2 @@',
  ' x = 1',
  '+y = 2',
  'diff --git a/tests/data/new.json b/tests/data/new.json',
  'new file mode 100644',
  '--- /dev/null',
  '+++ b/tests/data/new.json',
  '@@ -0,0 +1 @@',
  '+{}',
  'diff --git a/tests/fixture.png b/tests/fixture.png',
  'new file mode 100644',
  'index 0000000..1111111',
  'GIT binary patch',
  'literal 3',
  'Kc${NkU|;|M00aO5',
  '',
  'literal 0',
  'HcmV?d00001',
  '',
].join('\n');

/** One instance exactly in SWE-bench's published shape (the lists JSON-encoded strings). */
function instance(id: string, repo: string, version: string) {
  return {
    repo,
    instance_id: id,
    base_commit: '0123456789abcdef0123456789abcdef01234567',
    patch: 'diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a\n+b\n',
    test_patch: TEST_PATCH,
    problem_statement: 'It is broken.',
    hints_text: '',
    created_at: '2023-01-01T00:00:00Z',
    version,
    FAIL_TO_PASS: JSON.stringify(['tests/test_calc.py::test_new']),
    PASS_TO_PASS: JSON.stringify(['tests/test_calc.py::test_old[a']),
    environment_setup_commit: 'fedcba9876543210fedcba9876543210fedcba98',
  };
}

const TEMPLATE = 'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.{id}:latest';

test('a dataset as published, JSON array or JSONL, loads unedited; a missing spec fails that instance alone', async () => {
  const specs = await loadSpecs();
  const rows = [
    instance('psf__requests-1963', 'psf/requests', '2.3'),
    instance('django__django-11099', 'django/django', '3.0'),
    instance('psf__requests-9999', 'psf/requests', '99.0'),
  ];
  const asJson = join(dir, 'ds.json');
  const asJsonl = join(dir, 'ds.jsonl');
  writeFileSync(asJson, JSON.stringify(rows, null, 2));
  writeFileSync(asJsonl, rows.map((r) => JSON.stringify(r)).join('\n') + '\n');
  for (const file of [asJson, asJsonl]) {
    const ds = await loadSwebenchDataset(file, {
      specs,
      image: (id) => swebenchImageRef(TEMPLATE, id),
    });
    assert.deepEqual(
      ds.tasks.map((t) => t.instance_id),
      ['psf__requests-1963', 'django__django-11099'],
    );
    assert.deepEqual(ds.errors, [
      {
        instance_id: 'psf__requests-9999',
        code: 'invalid_argument',
        reason: 'no_spec',
        message:
          'the spec table has no entry for psf/requests version 99.0: add it with --specs FILE (docs/eval.md)',
      },
    ]);
    const [requests, django] = ds.tasks;
    assert.deepEqual(requests!.FAIL_TO_PASS, ['tests/test_calc.py::test_new']);
    assert.deepEqual(requests!.PASS_TO_PASS, ['tests/test_calc.py::test_old[a']);
    assert.equal(
      requests!.environment.image,
      'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.psf_1776_requests-1963:latest',
    );
    assert.equal(requests!.workdir, '/testbed');
    assert.equal(requests!.repo_dir, undefined);
    assert.equal(requests!.hints_text, '', 'the dataset’s other fields are kept');
    // Directives: test files without SWE-bench's non-test suffixes (.json, .png: a binary hunk).
    assert.deepEqual(requests!.swebench.directives, ['tests/test_calc.py']);
    assert.equal(
      requests!.test_command,
      'pytest -rA tests/test_calc.py',
      "psf/requests 2.3's test_cmd and the directives",
    );
    assert.deepEqual(requests!.swebench.modifiedFiles, ['tests/test_calc.py']);
    assert.deepEqual(requests!.swebench.newFiles, ['tests/data/new.json', 'tests/fixture.png']);
    assert.equal(requests!.swebench.spec.parser, 'pytest-options');
    assert.match(django!.test_command, /^\.\/tests\/runtests\.py --verbosity 2 .* test_calc$/);
    assert.equal(django!.swebench.spec.parser, 'django');
  }
});

test('a file that is not a dataset names the entry and the field', async () => {
  const specs = await loadSpecs();
  const cases: [string, RegExp][] = [
    ['[{"instance_id": "a__b-1"}]', /\[0\]: repo: Required/],
    [
      JSON.stringify([{ ...instance('a__b-1', 'psf/requests', '2.3'), version: 2.3 }]),
      /version: Expected string/,
    ],
    [
      JSON.stringify([{ ...instance('a__b-1', 'psf/requests', '2.3'), FAIL_TO_PASS: '[' }]),
      /FAIL_TO_PASS: not a JSON-encoded list/,
    ],
    [
      [instance('a__b-1', 'psf/requests', '2.3'), instance('a__b-1', 'psf/requests', '2.3')]
        .map((r) => JSON.stringify(r))
        .join('\n'),
      /:2: instance_id a__b-1 repeats/,
    ],
    ['{"instance_id": ', /:1: not JSON/],
  ];
  for (const [text, message] of cases) {
    const file = join(dir, 'bad.jsonl');
    writeFileSync(file, text);
    await assert.rejects(
      loadSwebenchDataset(file, { specs, image: (id) => swebenchImageRef(TEMPLATE, id) }),
      (err: unknown) => isDsecError(err, 'invalid_argument') && message.test(err.message),
    );
  }
});

test('Django directives are module names; other repositories keep paths', () => {
  const paths = ['tests/admin_views/tests.py', 'tests/a/b/c.py', 'docs/x.txt', 'tests/cfg.yaml'];
  assert.deepEqual(testDirectives(paths, 'django-modules'), ['admin_views.tests', 'a.b.c']);
  assert.deepEqual(testDirectives(paths, 'paths'), [
    'tests/admin_views/tests.py',
    'tests/a/b/c.py',
  ]);
});

test('patchFiles reads headers only: binary hunks, creations, deletions, renames', () => {
  const files = patchFiles(
    TEST_PATCH +
      'diff --git a/old name.py b/new name.py\nsimilarity index 90%\nrename from old name.py\nrename to new name.py\n' +
      'diff --git a/gone.py b/gone.py\ndeleted file mode 100644\n--- a/gone.py\n+++ /dev/null\n',
  );
  assert.deepEqual(
    files.map((f) => [f.oldPath, f.path, f.created, f.deleted]),
    [
      ['tests/test_calc.py', 'tests/test_calc.py', false, false],
      ['tests/data/new.json', 'tests/data/new.json', true, false],
      ['tests/fixture.png', 'tests/fixture.png', true, false],
      ['old name.py', 'new name.py', false, false],
      ['gone.py', 'gone.py', false, true],
    ],
  );
});

test('the spec table: the shipped one validates; --specs merges over it; errors name file and key', async () => {
  const shipped = await loadSpecs();
  assert.ok(Object.keys(shipped.repos).length >= 18);
  const django = specFor(shipped, 'django/django', '3.0')!;
  assert.equal(django.activate, 'source /opt/miniconda3/bin/activate && conda activate testbed');
  assert.ok(django.evalCommands.some((c) => c.includes('LANG=en_US.UTF-8')));
  assert.equal(specFor(shipped, 'django/django', 'nope'), undefined);
  assert.equal(specFor(shipped, 'toString', '1'), undefined);

  const overlay = join(dir, 'specs.json');
  writeFileSync(
    overlay,
    JSON.stringify({
      $schema_version: 1,
      repos: {
        'django/django': { versions: { '9.9': { test_cmd: './tests/runtests.py -v 2' } } },
        'me/calc': {
          parser: 'pytest',
          directives: 'paths',
          activate: '. /opt/venv/bin/activate',
          versions: { '0.1': { test_cmd: 'pytest -rA' } },
        },
      },
    }),
  );
  const merged = await loadSpecs(overlay);
  assert.equal(specFor(merged, 'django/django', '9.9')!.parser, 'django');
  assert.ok(specFor(merged, 'django/django', '3.0'), 'the shipped versions stay');
  assert.equal(specFor(merged, 'me/calc', '0.1')!.activate, '. /opt/venv/bin/activate');

  const bad: [unknown, RegExp][] = [
    [
      { $schema_version: 1, repos: { 'a/b': { versions: { '1': { test_cmd: 'x' } } } } },
      /repos\.a\/b: a repository the shipped table lacks/,
    ],
    [
      {
        $schema_version: 1,
        repos: { 'django/django': { versions: { '1': { test_cmd: 'x', tset: 1 } } } },
      },
      /repos\.django\/django\.versions\.1: Unrecognized key/,
    ],
    [
      {
        $schema_version: 1,
        repos: { 'a/b': { parser: 'nose', directives: 'paths', versions: {} } },
      },
      /repos\.a\/b\.parser/,
    ],
    [{ $schema_version: 2, repos: {} }, /\$schema_version/],
  ];
  for (const [table, message] of bad) {
    writeFileSync(overlay, JSON.stringify(table));
    await assert.rejects(
      loadSpecs(overlay),
      (err: unknown) =>
        isDsecError(err, 'invalid_argument') &&
        err.message.startsWith(`${overlay}: `) &&
        message.test(err.message),
    );
  }
});

test("the evaluation script: SWE-bench's steps, files reset and test_patch applied in the sandbox", async () => {
  const specs = await loadSpecs();
  const file = join(dir, 'one.json');
  writeFileSync(file, JSON.stringify([instance('django__django-1', 'django/django', '3.0')]));
  const [task] = (
    await loadSwebenchDataset(file, { specs, image: (id) => swebenchImageRef(TEMPLATE, id) })
  ).tasks;
  const script = swebenchEvalScript(task!);
  const lines = script.trimEnd().split('\n');
  const at = (re: RegExp) => lines.findIndex((l) => re.test(l));
  assert.equal(lines[0], 'exec 2>&1');
  assert.ok(at(/^source \/opt\/miniconda3\/bin\/activate && conda activate testbed$/) > 0);
  assert.ok(at(/^export PYTHONDONTWRITEBYTECODE=1$/) > 0);
  assert.ok(at(/locale-gen/) > 0, "the spec's eval_commands");
  assert.ok(at(/^python -m pip install -e \.$/) > 0, "the spec's install");
  const reset = at(
    /^git checkout 0123456789abcdef0123456789abcdef01234567 -- tests\/test_calc\.py$/,
  );
  const rm = at(/^rm -f -- tests\/data\/new\.json tests\/fixture\.png$/);
  const apply = at(/^git apply -v "\$dsec_test_patch"/);
  const start = at(/^: '>>>>> Start Test Output'$/);
  const run = at(/^\.\/tests\/runtests\.py /);
  const end = at(/^: '>>>>> End Test Output'$/);
  assert.ok(0 < reset && reset < rm && rm < apply && apply < start && start < run && run < end);
  assert.equal(lines.at(-1), 'exit $dsec_rc');
});

test('the verdict: only the marked output counts; missing tests fail; a failing run without failures is no pass', async () => {
  const specs = await loadSpecs();
  const file = join(dir, 'two.json');
  writeFileSync(file, JSON.stringify([instance('psf__requests-1', 'pytest-dev/pytest', '7.0')]));
  const [task] = (
    await loadSwebenchDataset(file, { specs, image: (id) => swebenchImageRef(TEMPLATE, id) })
  ).tasks;
  const log = (body: string) =>
    `PASSED tests/test_calc.py::test_new\n+ : '>>>>> Start Test Output'\n${body}\n+ : '>>>>> End Test Output'\n`;
  const both = 'PASSED tests/test_calc.py::test_new\nPASSED tests/test_calc.py::test_old[a b]';
  assert.equal(testOutputOf(log(both))?.includes('test_old'), true);
  assert.equal(swebenchVerdict(task!, log(both), { exitCode: 0, timedOut: false }).reward, 1);
  // The line before the start marker does not count: test_old is missing.
  const one = swebenchVerdict(task!, log('PASSED tests/test_calc.py::test_new'), {
    exitCode: 0,
    timedOut: false,
  });
  assert.deepEqual([one.reward, one.failing], [0, ['tests/test_calc.py::test_old[a']]);
  assert.equal(swebenchVerdict(task!, log(both), { exitCode: 1, timedOut: false }).reward, 0);
  assert.equal(swebenchVerdict(task!, log(both), { exitCode: 0, timedOut: true }).reward, 0);
  assert.equal(
    swebenchVerdict(task!, both, { exitCode: 0, timedOut: false }).reward,
    0,
    'no markers',
  );
  const xfail = `${both.replace('PASSED tests/test_calc.py::test_new', 'XFAIL tests/test_calc.py::test_new')}\nFAILED tests/other.py::x - e`;
  assert.equal(swebenchVerdict(task!, log(xfail), { exitCode: 1, timedOut: false }).reward, 1);
  const skipped = both.replace(
    'PASSED tests/test_calc.py::test_new',
    'SKIPPED tests/test_calc.py::test_new',
  );
  assert.equal(swebenchVerdict(task!, log(skipped), { exitCode: 0, timedOut: false }).reward, 0);
});

test('attack: file names in a dataset’s test_patch reach bash as data, never as code', async () => {
  const work = mkdtempSync(join(tmpdir(), 'swebench-quote-'));
  const evil = [
    'tests/$(touch pwned-subst).py',
    "tests/a'b;touch pwned-semi;'.py",
    'tests/`touch pwned-tick`.py',
    'tests/-rf --no-preserve-root.py',
  ];
  const patch = evil
    .map((p) => `diff --git a/${p} b/${p}\n--- a/${p}\n+++ b/${p}\n@@ -1 +1 @@\n-a\n+b\n`)
    .join('');
  const specsFile = join(work, 'specs.json');
  writeFileSync(
    specsFile,
    JSON.stringify({
      $schema_version: 1,
      repos: {
        'evil/repo': {
          parser: 'pytest',
          directives: 'paths',
          activate: 'true',
          versions: { '1': { test_cmd: 'pytest' } },
        },
      },
    }),
  );
  const file = join(work, 'ds.json');
  writeFileSync(
    file,
    JSON.stringify([{ ...instance('evil__repo-1', 'evil/repo', '1'), test_patch: patch }]),
  );
  const [task] = (
    await loadSwebenchDataset(file, {
      specs: await loadSpecs(specsFile),
      image: (id) => swebenchImageRef(TEMPLATE, id),
    })
  ).tasks;
  // Every program the script calls records its arguments instead of acting.
  const prelude = [
    'log() { printf "%s|" "$@" >> calls.log; printf "\\n" >> calls.log; }',
    'git() { log git "$@"; }',
    'pytest() { log pytest "$@"; }',
    'rm() { log rm "$@"; }',
    'cd() { :; }',
  ].join('\n');
  const script = swebenchEvalScript({ ...task!, workdir: work }).replace(
    'set -uxo pipefail',
    `set -uxo pipefail\n${prelude}`,
  );
  const r = spawnSync('/bin/bash', ['-c', script], { cwd: work, input: patch, encoding: 'utf8' });
  assert.equal(r.status, 0, r.stdout + r.stderr);
  assert.deepEqual(
    readdirSync(work).filter((f) => f.startsWith('pwned')),
    [],
    'nothing in a file name ran',
  );
  const calls = readFileSync(join(work, 'calls.log'), 'utf8').split('\n');
  const pytest = calls.find((l) => l.startsWith('pytest|'))!;
  assert.equal(pytest, `pytest|${evil.join('|')}|`);
  const checkout = calls.find((l) => l.startsWith('git|checkout|'))!;
  assert.equal(checkout, `git|checkout|${task!.base_commit}|--|${evil.join('|')}|`);
});

test('attack: a spec table cannot pollute prototypes or answer for keys it does not own', async () => {
  const overlay = join(dir, 'proto.json');
  writeFileSync(
    overlay,
    '{"$schema_version":1,"repos":{"django/django":{"versions":{"__proto__":{"test_cmd":"evil"},"constructor":{"test_cmd":"c"}}}}}',
  );
  const table = await loadSpecs(overlay);
  assert.equal(({} as Record<string, unknown>).test_cmd, undefined);
  assert.equal(specFor(table, 'django/django', 'toString'), undefined);
  assert.equal(specFor(table, 'django/django', 'hasOwnProperty'), undefined);
  assert.equal(specFor(table, 'django/django', 'constructor')?.testCmd, 'c');
  writeFileSync(overlay, '{"$schema_version":1,"repos":{"__proto__":{"versions":{}}}}');
  await assert.rejects(loadSpecs(overlay), (err: unknown) => isDsecError(err, 'invalid_argument'));
});

test('attack: an instance_id cannot steer its image to another repository or registry', async () => {
  const specs = await loadSpecs();
  for (const id of ['a/../../evil', 'evil:tag', 'a@sha256', '..', 'x..y', '-x']) {
    const file = join(dir, 'id.json');
    writeFileSync(file, JSON.stringify([instance(id, 'psf/requests', '2.3')]));
    await assert.rejects(
      loadSwebenchDataset(file, { specs, image: (i) => swebenchImageRef(TEMPLATE, i) }),
      (err: unknown) => isDsecError(err, 'invalid_argument') && /instance_id/.test(err.message),
      id,
    );
  }
});

test('attack: a test_patch too large for the grader fails its instance at load, before any sandbox or agent time', async () => {
  const specs = await loadSpecs();
  const big = instance('psf__requests-1964', 'psf/requests', '2.3');
  // Past what the grader's stdin takes: found only after the agent's whole run, before.
  big.test_patch = `${TEST_PATCH}${'+x\n'.repeat(400 * 1024)}`;
  const file = join(dir, 'big.jsonl');
  writeFileSync(
    file,
    [instance('psf__requests-1963', 'psf/requests', '2.3'), big]
      .map((r) => JSON.stringify(r))
      .join('\n'),
  );
  const ds = await loadSwebenchDataset(file, {
    specs,
    image: (id) => swebenchImageRef(TEMPLATE, id),
  });
  assert.deepEqual(
    ds.tasks.map((t) => t.instance_id),
    ['psf__requests-1963'],
  );
  assert.equal(ds.errors.length, 1);
  assert.equal(ds.errors[0]!.instance_id, 'psf__requests-1964');
  assert.equal(ds.errors[0]!.code, 'payload_too_large');
  assert.equal(ds.errors[0]!.reason, 'test_patch_too_large');
  assert.match(ds.errors[0]!.message, /test_patch/);
});

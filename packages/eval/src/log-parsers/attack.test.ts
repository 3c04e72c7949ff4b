import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { patchFiles } from '../swebench/patch-files.js';
import {
  djangoInterrupted,
  parseDjango,
  parsePytestOptions,
  parseSympy,
  sympyFailureHeaders,
} from './python.js';

/*
 * Attack: the log a grader parses is written by the code under test (the
 * agent's patch), and a test_patch by the dataset's author; both are parsed
 * on the host, in the process that drives the whole batch. A regular
 * expression that backtracks over a crafted line blocks that process (every
 * task in flight stalls) for hours. Each input below took the parsers as
 * they were minutes to hours (quadratic: a 40 kB line of spaces already took
 * sympy's parser 2.6 s); parsed in linear time they take milliseconds, and
 * the generous per-test limit only catches a hang, it measures nothing.
 */
const HANG = { timeout: 300_000 };
const MIB = 1024 * 1024;

test('attack: sympy failure headers over a line of spaces are parsed in linear time', HANG, () => {
  assert.deepEqual(parseSympy(' '.repeat(2 * MIB)), {});
  assert.deepEqual(parseSympy(`${'_ '.repeat(MIB)}x`), {});
});

test('attack: Django interruption rules over crafted lines are parsed in linear time', HANG, () => {
  const testing = 'x ... Testing against Django installed in \n'.repeat((8 * MIB) / 43);
  assert.deepEqual(parseDjango(testing), {});
  const ise = 'a ... Internal Server Error: /'.repeat((4 * MIB) / 30);
  assert.deepEqual(parseDjango(ise), {});
  const check = 'a ... System check identified no issues (0 silenced) '.repeat((4 * MIB) / 54);
  assert.deepEqual(parseDjango(check), {});
});

test('attack: a pytest-options ID of brackets is parsed in linear time', HANG, () => {
  const id = '['.repeat(2 * MIB);
  assert.deepEqual(parsePytestOptions(`PASSED ${id}`), { [id]: 'PASSED' });
});

test('attack: a test_patch header line with many " b/" is read in linear time', HANG, () => {
  assert.deepEqual(patchFiles(`diff --git a/${' b/'.repeat((2 * MIB) / 3)}\r`), []);
  const line = `diff --git a/x${' b/'.repeat((2 * MIB) / 3)}y`;
  assert.equal(patchFiles(line).length, 1);
});

// Small random texts over the characters the rules look at.
function fuzz(seed: number, alphabet: string[], count: number, maxLen: number): string[] {
  let s = seed;
  const rnd = (n: number) => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return (s >>> 8) % n;
  };
  return Array.from({ length: count }, () =>
    Array.from({ length: rnd(maxLen) }, () => alphabet[rnd(alphabet.length)]).join(''),
  );
}

/** SWE-bench's own regular expressions, run by Python's `re` (the reference's engine). */
function pythonFindall(pattern: string, flags: string, texts: string[]): string[][][] {
  const program = [
    'import json, re, sys',
    'p = re.compile(sys.argv[1], re.MULTILINE if "m" in sys.argv[2] else 0)',
    'out = []',
    'for t in json.load(sys.stdin):',
    '    out.append([list(m) if isinstance(m, tuple) else [m] for m in p.findall(t)])',
    'print(json.dumps(out))',
  ].join('\n');
  const stdout = execFileSync('/usr/bin/python3', ['-c', program, pattern, flags], {
    input: JSON.stringify(texts),
    maxBuffer: 64 * MIB,
  });
  return JSON.parse(stdout.toString()) as string[][][];
}

test('sympy headers: the same IDs as SWE-bench’s regex under Python’s re', () => {
  const texts = fuzz(7, ['_', ' ', '.py:', 'a', '\n', '\r', '.', 'py'], 3000, 14);
  const ref = pythonFindall('(_*) (.*)\\.py:(.*) (_*)', '', texts);
  assert.ok(ref.filter((r) => r.length > 0).length > 100, 'the texts exercise the rule');
  for (const [i, text] of texts.entries()) {
    const want = ref[i]!.map((m) => `${m[1]!}.py:${m[2]!}`);
    assert.deepEqual(sympyFailureHeaders(text), want, JSON.stringify(text));
  }
});

test('Django interruption rules: the same IDs as SWE-bench’s regexes under Python’s re', () => {
  const rules = [
    [
      '^(.*?)\\s\\.\\.\\.\\sTesting against Django installed in ((?s:.*?)) silenced\\)\\.\\nok$',
      [
        ' ... Testing against Django installed in ',
        ' silenced).',
        ' silenced).\nok',
        '\n... Testing against Django installed in ',
      ],
    ],
    [
      '^(.*?)\\s\\.\\.\\.\\sInternal Server Error: \\/(.*)\\/\\nok$',
      [' ... Internal Server Error: /', '/\nok', '/', '...\nInternal Server Error: /'],
    ],
    [
      '^(.*?)\\s\\.\\.\\.\\sSystem check identified no issues \\(0 silenced\\)\\nok$',
      [
        ' ... System check identified no issues (0 silenced)',
        ' ... System check identified no issues (0 silenced)\nok',
        '\n... System check identified no issues (0 silenced)',
      ],
    ],
  ] as const;
  for (const [n, [pattern, pieces]] of rules.entries()) {
    const texts = fuzz(
      11 + n,
      [...pieces, 'ok', '\n', '\nok', '...', ' ', 'x', '\t', '\r'],
      8000,
      8,
    );
    const ref = pythonFindall(pattern, 'm', texts);
    const hits = ref.filter((r) => r.length > 0).length;
    assert.ok(hits > 100, `the texts exercise rule ${n}`);
    for (const [i, text] of texts.entries()) {
      const want = ref[i]!.map((m) => m[0]!);
      assert.deepEqual(djangoInterrupted(text, n), want, JSON.stringify(text));
    }
  }
});

test('pytest-options and patchFiles: the same as the regular expressions they replace', () => {
  for (const id of fuzz(5, ['[', ']', '/', 'a', '*', '//'], 3000, 10)) {
    const m = /^(.*?)\[(.*)\]/.exec(id);
    const got = Object.keys(parsePytestOptions(`PASSED ${id}`));
    if (id === '') continue;
    if (!m) assert.deepEqual(got, [id]);
    else {
      let option = m[2]!;
      if (option.startsWith('/') && !option.startsWith('//') && !option.includes('*')) {
        option = '/' + option.split('/').at(-1)!;
      }
      assert.deepEqual(got, [`${m[1]!}[${option}]`], id);
    }
  }
  for (const rest of fuzz(9, [' b/', 'b/', ' ', 'a', '\r', '\u2028', '/'], 3000, 8)) {
    const line = `diff --git a/${rest}`;
    const m = /^diff --git a\/(.*) b\/(.*)$/.exec(line);
    const got = patchFiles(line);
    assert.deepEqual(
      got.map((f) => [f.oldPath, f.path]),
      m ? [[m[1], m[2]]] : [],
      JSON.stringify(line),
    );
  }
});

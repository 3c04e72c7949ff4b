/**
 * SWE-bench's log parsers for its Python repositories, reimplemented from
 * the behaviour of `swebench/harness/log_parsers/python.py` at
 * SWE-bench/SWE-bench@25c52357b750af7e636daa54d03fce9861b3f3e6 (the version
 * whose IDs the published Lite/Verified datasets hold; docs/eval.md). A
 * parser maps a test log to `{ testId: status }` with SWE-bench's statuses;
 * the IDs are exactly the ones the datasets' FAIL_TO_PASS / PASS_TO_PASS
 * name, quirks included (a pytest ID is cut at its first space; a FAILED
 * line's ` - ` is folded first), because a score only matches the reference
 * harness's when the keys do.
 */

/** SWE-bench's test statuses (`TestStatus`). */
export type SwebenchStatus = 'PASSED' | 'FAILED' | 'SKIPPED' | 'ERROR' | 'XFAIL';

export type StatusMap = Record<string, SwebenchStatus>;

const STATUSES: readonly SwebenchStatus[] = ['FAILED', 'PASSED', 'SKIPPED', 'ERROR', 'XFAIL'];

/** The parsers the spec table may name. */
export const LOG_PARSER_NAMES = [
  'pytest',
  'pytest-options',
  'pytest-v2',
  'django',
  'seaborn',
  'sympy',
  'matplotlib',
] as const;
export type LogParserName = (typeof LOG_PARSER_NAMES)[number];

/** Python's `str.split()`: runs of whitespace, no empty fields. */
function words(line: string): string[] {
  return line.split(/\s+/).filter((w) => w !== '');
}

function startsWithStatus(line: string): SwebenchStatus | undefined {
  return STATUSES.find((s) => line.startsWith(s));
}

/** `SKIPPED [3] path:line: reason` is pytest's grouped skip summary: `[3]` is a count, not a test. */
function isSkipCount(status: string, id: string): boolean {
  return status === 'SKIPPED' && /^\[\d+\]$/.test(id);
}

/**
 * Every line that starts with a status word; FAILED lines have ` - ` folded
 * to a space; the ID is the second whitespace-separated word (so an ID with a
 * space is cut there, as the datasets hold it). The status is the line's
 * first word, verbatim, so `PASSED` in `PASSEDX …` is not one: such a line
 * would carry a status SWE-bench's table has no entry for, and it is dropped.
 */
export function parsePytest(log: string, rewrite: (line: string) => string = (l) => l): StatusMap {
  const map: StatusMap = {};
  for (const raw of log.split('\n')) {
    const line = rewrite(raw);
    if (startsWithStatus(line) === undefined) continue;
    const folded = line.startsWith('FAILED') ? line.split(' - ').join(' ') : line;
    const w = words(folded);
    if (w.length <= 1) continue;
    if (isSkipCount(w[0]!, w[1]!)) continue;
    const status = asStatus(w[0]!);
    if (status) map[w[1]!] = status;
  }
  return map;
}

/**
 * pytest with options (requests, pylint, pydicom): as `parsePytest`, then a
 * parametrised ID whose parameter is an absolute path (`test_x[/tmp/a/b.py]`)
 * keeps only the path's last part (`test_x[/b.py]`), which differs per
 * machine; `//…` and glob parameters stay.
 */
export function parsePytestOptions(log: string): StatusMap {
  const map: StatusMap = {};
  for (const [id, status] of Object.entries(parsePytest(log))) {
    const m = /^(.*?)\[(.*)\]/.exec(id);
    let name = id;
    if (m) {
      let option = m[2]!;
      if (option.startsWith('/') && !option.startsWith('//') && !option.includes('*')) {
        option = '/' + option.split('/').at(-1)!;
      }
      name = `${m[1]!}[${option}]`;
    }
    map[name] = status;
  }
  return map;
}

// Control characters 1–31 (tab and newline included), removed from each line.
const CONTROL = /[\x01-\x1f]/g;

/**
 * pytest, later versions (astropy, scikit-learn, sphinx): colour codes
 * (`[32m`) and control characters are removed first; a line starting with a
 * status is read as by `parsePytest`; otherwise a line ending with one (the
 * verbose `path::test PASSED` form of `-v`/classic console output) gives
 * its first word as the ID and its second as the status.
 */
export function parsePytestV2(log: string): StatusMap {
  const map: StatusMap = {};
  for (const raw of log.split('\n')) {
    const line = raw.replace(/\[(\d+)m/g, '').replace(CONTROL, '');
    if (startsWithStatus(line) !== undefined) {
      const folded = line.startsWith('FAILED') ? line.split(' - ').join(' ') : line;
      const w = words(folded);
      if (w.length >= 2 && !isSkipCount(w[0]!, w[1]!)) {
        const status = asStatus(w[0]!);
        if (status) map[w[1]!] = status;
      }
    } else if (STATUSES.some((s) => line.endsWith(s))) {
      const w = words(line);
      if (w.length >= 2) {
        const status = asStatus(w[1]!);
        if (status) map[w[0]!] = status;
      }
    }
  }
  return map;
}

/** matplotlib: `MouseButton.LEFT`/`RIGHT` in IDs read as `1`/`3` (their values), then `parsePytest`. */
export function parseMatplotlib(log: string): StatusMap {
  return parsePytest(log, (l) =>
    l.replaceAll('MouseButton.LEFT', '1').replaceAll('MouseButton.RIGHT', '3'),
  );
}

/**
 * seaborn: `FAILED id` lines, verbose `id PASSED [ n%]` lines (the ID is the
 * first word when the second is PASSED), and `PASSED id` summary lines.
 */
export function parseSeaborn(log: string): StatusMap {
  const map: StatusMap = {};
  for (const line of log.split('\n')) {
    const w = words(line);
    if (w.length < 2) continue;
    if (line.startsWith('FAILED')) map[w[1]!] = 'FAILED';
    else if (line.includes(' PASSED ')) {
      if (w[1] === 'PASSED') map[w[0]!] = 'PASSED';
    } else if (line.startsWith('PASSED')) map[w[1]!] = 'PASSED';
  }
  return map;
}

/**
 * sympy's `bin/test`: `test_x ok`, `test_x F`, `test_x E` lines (stripped),
 * and `____ sympy/a/b.py:test_x ____` failure headers, which mark
 * `sympy/a/b.py:test_x` failed (a later `ok` line of the same name wins, as
 * the lines are read after the headers).
 */
export function parseSympy(log: string): StatusMap {
  const map: StatusMap = {};
  for (const m of log.matchAll(/(_*) (.*)\.py:(.*) (_*)/g)) {
    map[`${m[2]!}.py:${m[3]!}`] = 'FAILED';
  }
  for (const raw of log.split('\n')) {
    const line = raw.trim();
    if (!line.startsWith('test_')) continue;
    const first = words(line)[0]!;
    if (line.endsWith(' E')) map[first] = 'ERROR';
    if (line.endsWith(' F')) map[first] = 'FAILED';
    if (line.endsWith(' ok')) map[first] = 'PASSED';
  }
  return map;
}

const DJANGO_PASS_SUFFIXES = [' ... ok', ' ... OK', ' ...  OK'];

/**
 * Django's `runtests.py --verbosity 2`: `test_x (module.Class) ... ok`
 * lines (the ID is everything before ` ... `), `... skipped`, `... FAIL`,
 * `... ERROR`, `FAIL: id`/`ERROR: id` headers, and the quirks of output that
 * interrupts a test's line: an `ok` alone on a later line passes the last
 * test that printed ` ... `; three known interruptions (`Testing against
 * Django installed in … silenced).`, `Internal Server Error: /…/`, `System
 * check identified no issues (0 silenced)`) followed by `ok` on the next
 * line pass the test before them; the `--version is equivalent to version`
 * help text counts as that test passed; and django__django-7188's
 * `Applying sites.0002_alter_domain_unique...test_no_migrations` line.
 */
export function parseDjango(log: string): StatusMap {
  const map: StatusMap = {};
  let prev: string | undefined;
  for (const raw of log.split('\n')) {
    let line = raw.trim();
    if (line.includes('--version is equivalent to version')) {
      map['--version is equivalent to version'] = 'PASSED';
    }
    if (line.includes(' ... ')) prev = line.split(' ... ')[0];
    for (const suffix of DJANGO_PASS_SUFFIXES) {
      if (!line.endsWith(suffix)) continue;
      if (line.startsWith('Applying sites.0002_alter_domain_unique...test_no_migrations')) {
        line = line.slice(line.indexOf('...') + 3).trim();
      }
      map[line.slice(0, line.lastIndexOf(suffix))] = 'PASSED';
      break;
    }
    if (line.includes(' ... skipped')) map[line.split(' ... skipped')[0]!] = 'SKIPPED';
    if (line.endsWith(' ... FAIL')) map[line.split(' ... FAIL')[0]!] = 'FAILED';
    if (line.startsWith('FAIL:')) {
      const id = words(line)[1];
      if (id !== undefined) map[id] = 'FAILED';
    }
    if (line.endsWith(' ... ERROR')) map[line.split(' ... ERROR')[0]!] = 'ERROR';
    if (line.startsWith('ERROR:')) {
      const id = words(line)[1];
      if (id !== undefined) map[id] = 'ERROR';
    }
    if (line.startsWith('ok') && prev !== undefined) map[prev] = 'PASSED';
  }
  const interrupted = [
    /^(.*?)\s\.\.\.\sTesting against Django installed in ([\s\S]*?) silenced\)\.\nok$/gm,
    /^(.*?)\s\.\.\.\sInternal Server Error: \/(.*)\/\nok$/gm,
    /^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$/gm,
  ];
  for (const re of interrupted) {
    for (const m of log.matchAll(re)) map[m[1]!] = 'PASSED';
  }
  return map;
}

function asStatus(word: string): SwebenchStatus | undefined {
  return (STATUSES as readonly string[]).includes(word) ? (word as SwebenchStatus) : undefined;
}

const PARSERS: Record<LogParserName, (log: string) => StatusMap> = {
  pytest: (l) => parsePytest(l),
  'pytest-options': parsePytestOptions,
  'pytest-v2': parsePytestV2,
  django: parseDjango,
  seaborn: parseSeaborn,
  sympy: parseSympy,
  matplotlib: parseMatplotlib,
};

/** Runs the named parser over a log. */
export function parseLog(parser: LogParserName, log: string): StatusMap {
  return PARSERS[parser](log);
}

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
    // `^(.*?)\[(.*)\]` without its backtracking (an ID of brackets took minutes):
    // group 1 ends at the first `[`, group 2 at the last `]` after it.
    const open = id.indexOf('[');
    const close = id.lastIndexOf(']');
    let name = id;
    if (open >= 0 && close > open) {
      let option = id.slice(open + 1, close);
      if (option.startsWith('/') && !option.startsWith('//') && !option.includes('*')) {
        option = '/' + option.split('/').at(-1)!;
      }
      name = `${id.slice(0, open)}[${option}]`;
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
  for (const id of sympyFailureHeaders(log)) map[id] = 'FAILED';
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

/**
 * What SWE-bench's `re.findall(r"(_*) (.*)\.py:(.*) (_*)", log)` finds, as
 * `path.py:test`, in linear time: run by a backtracking engine, that regex
 * tries every space of a line against the rest of the line (hours over one
 * long line of spaces the code under test prints). Python's `.` stops at
 * `\n` only, so a match lies within one line, and there is at most one per
 * line: it starts at the line's first space (with the underscores before
 * it), group 2 runs to the last `.py:` that a space still follows, group 3
 * to the line's last space.
 */
export function sympyFailureHeaders(log: string): string[] {
  const out: string[] = [];
  for (const line of log.split('\n')) {
    const first = line.indexOf(' ');
    if (first < 0) continue;
    const last = line.lastIndexOf(' ');
    if (last < 4) continue;
    const py = line.lastIndexOf('.py:', last - 4);
    if (py < first + 1) continue;
    out.push(`${line.slice(first + 1, py)}.py:${line.slice(py + 4, last)}`);
  }
  return out;
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
  for (const id of djangoInterrupted(log)) map[id] = 'PASSED';
  return map;
}

const TESTING_AGAINST = /\s\.\.\.\sTesting against Django installed in /;
const SERVER_ERROR = /\s\.\.\.\sInternal Server Error: \//;
const SYSTEM_CHECK = /\s\.\.\.\sSystem check identified no issues \(0 silenced\)/;
const SILENCED_OK = ' silenced).\nok';

/**
 * The tests SWE-bench's three interruption rules pass, in order: its
 * `re.findall` over the log with `re.MULTILINE` of
 * `^(.*?)\s\.\.\.\sTesting against Django installed in ((?s:.*?)) silenced\)\.\nok$`,
 * `^(.*?)\s\.\.\.\sInternal Server Error: \/(.*)\/\nok$` and
 * `^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$`
 * (group 1 of each match), with Python's line semantics (`.` and `^`/`$`
 * know `\n` only), found in linear time. A backtracking engine runs those
 * regexes in time quadratic in what the code under test prints (each
 * `... Testing against` without a later ` silenced).` line rescans the rest
 * of the log; each `... Internal Server Error: /` the rest of its line): a
 * crafted log held the host's grader for an hour. Here each line start is
 * tried once, with the next intro and the next terminator remembered, so no
 * part of the log is scanned twice. `only`: just that rule (0, 1, 2; tests).
 */
export function djangoInterrupted(log: string, only?: number): string[] {
  const okAt = (i: number): boolean =>
    log.startsWith('ok', i) && (i + 2 === log.length || log[i + 2] === '\n');
  const nextTerm = finder(log, (from) => {
    for (let i = log.indexOf(SILENCED_OK, from); i >= 0; i = log.indexOf(SILENCED_OK, i + 1)) {
      const end = i + SILENCED_OK.length;
      if (end === log.length || log[end] === '\n') return end;
    }
    return -1;
  });
  const nextNewline = finder(log, (from) => log.indexOf('\n', from));
  const rules: [RegExp, (introEnd: number) => number][] = [
    [TESTING_AGAINST, (e) => nextTerm(e)],
    [
      SERVER_ERROR,
      (e) => {
        const nl = nextNewline(e);
        return nl > e && log[nl - 1] === '/' && okAt(nl + 1) ? nl + 3 : -1;
      },
    ],
    [SYSTEM_CHECK, (e) => (log[e] === '\n' && okAt(e + 1) ? e + 3 : -1)],
  ];
  const out: string[] = [];
  for (const [n, [intro, tail]] of rules.entries()) {
    if (only !== undefined && n !== only) continue;
    const search = new RegExp(intro.source, 'g');
    const sticky = new RegExp(intro.source, 'y');
    const nextIntro = finder(log, (from) => {
      search.lastIndex = from;
      const m = search.exec(log);
      return m ? m.index : -1;
    });
    const introLength = (at: number): number => {
      sticky.lastIndex = at;
      return sticky.exec(log)![0].length;
    };
    let start = 0;
    while (start <= log.length) {
      const nl = nextNewline(start);
      const lineEnd = nl < 0 ? log.length : nl;
      let end = -1;
      // Group 1 (`.*?`) stays on the line; the intro's first `\s` may be its newline.
      for (let at = nextIntro(start); at >= 0 && at <= lineEnd; at = nextIntro(at + 1)) {
        end = tail(at + introLength(at));
        if (end >= 0) {
          out.push(log.slice(start, at));
          break;
        }
      }
      // The next try is at the first line start after the match (or after this line).
      const from = end >= 0 ? nextNewline(end) : nl;
      if (from < 0) break;
      start = from + 1;
    }
  }
  return out;
}

/**
 * `search(from)` (the first hit at or after `from`, or -1) remembered: asked
 * again from a point between the last `from` and its hit, the hit is the
 * same, so calls with growing `from` cost one scan of the text in all.
 */
function finder(text: string, search: (from: number) => number): (from: number) => number {
  let askedFrom = Infinity;
  let hit = -1;
  return (from) => {
    if (from >= askedFrom && (hit < 0 || from <= hit)) return hit;
    askedFrom = from;
    hit = search(from);
    return hit;
  };
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

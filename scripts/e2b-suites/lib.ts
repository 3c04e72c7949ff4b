/**
 * The parts of scripts/e2b-suites.ts that read and judge (no process, mount or network):
 * the pinned commits, exclude.txt, which tests need a server, the suites' reports, the summary
 * and the check that no excluded test ran. Tested by lib.test.ts beside it.
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join, relative } from 'node:path';

/** The E2B commit whose JS SDK suite runs (e2b 2.45.0, 2026-08-21). */
export const JS_COMMIT = 'b8029973aa7da5f741f7bb1a9f833b38a0885438';
/** Tag `@e2b/python-sdk@2.0.2`: the last python-sdk whose dependencies Debian 13 packages. */
export const PY_COMMIT = '67070bb9ea4072157d93a90310ea4a06be101e15';
export const PY_VERSION = '2.0.2';
/** Never resolves anywhere (RFC 6761 `.test`); answered as loopback inside the run only. */
export const DOMAIN = 'e2b.test';
export type Outcome = 'passed' | 'failed' | 'skipped';
export interface TestResult {
  suite: 'js' | 'py';
  file: string;
  name: string;
  outcome: Outcome;
  error: string;
  needsServer: boolean;
}
export interface SuiteSummary {
  suite: 'js' | 'py';
  commit: string;
  version: string;
  ran: boolean;
  exitCode: number | null;
  passed: number;
  failed: number;
  skipped: number;
  server: { passed: number; failed: number; skipped: number; passRate: number | null };
  excluded: string[];
}

export interface Exclusion {
  suite: 'js' | 'py';
  target: string;
  reason: string;
}

/** Parses exclude.txt: `SUITE PATH[::TEST] -- REASON`, `#` comments; throws on a bad line. */
export function parseExclusions(text: string): Exclusion[] {
  const out: Exclusion[] = [];
  for (const [i, raw] of text.split('\n').entries()) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue;
    const m = /^(js|py) (\S(?:.*\S)?) -- (internet|cloud|browser): (.+)$/.exec(line);
    if (!m)
      throw new Error(
        `exclude.txt:${i + 1}: want "js|py PATH[::TEST] -- internet|cloud|browser: REASON"`,
      );
    const [, suite, target, kind, why] = m;
    if (suite === 'js' && target!.includes('::'))
      throw new Error(
        `exclude.txt:${i + 1}: a js entry is a file or a glob (vitest cannot deselect a test)`,
      );
    if (target!.startsWith('/') || target!.split('/').includes('..'))
      throw new Error(`exclude.txt:${i + 1}: a path relative to the SDK's directory`);
    out.push({ suite: suite as 'js' | 'py', target: target!, reason: `${kind}: ${why}` });
  }
  return out;
}

/** A minimal glob (`**`, `*`) as vitest reads the js entries. */
export function globMatch(pattern: string, path: string): boolean {
  const re = pattern
    .split('**')
    .map((part) =>
      part
        .split('*')
        .map((s) => s.replace(/[.+?^${}()|[\]\\]/g, '\\$&'))
        .join('[^/]*'),
    )
    .join('.*');
  return new RegExp(`^${re}$`).test(path);
}

/** The files under `dir` (relative), for checking that each exclusion names something real. */
export function listFiles(dir: string, sub = ''): string[] {
  const out: string[] = [];
  for (const e of readdirSync(join(dir, sub), { withFileTypes: true })) {
    if (e.name === 'node_modules' || e.name.startsWith('.')) continue;
    const rel = sub ? `${sub}/${e.name}` : e.name;
    if (e.isDirectory()) out.push(...listFiles(dir, rel));
    else if (e.isFile()) out.push(rel);
  }
  return out;
}

/**
 * Throws unless every exclusion of `suite` names a file of the exported tree: a misspelt entry
 * would otherwise let the test it means run.
 */
export function checkExclusionsExist(suite: 'js' | 'py', dir: string, entries: Exclusion[]): void {
  const files = listFiles(dir);
  for (const e of entries.filter((x) => x.suite === suite)) {
    const file = e.target.split('::')[0]!;
    const hit = suite === 'js' ? files.some((f) => globMatch(file, f)) : files.includes(file);
    if (!hit) throw new Error(`exclude.txt: ${suite} ${e.target} names no file of ${dir}`);
  }
}

export function pyExcluded(id: string, entries: Exclusion[]): boolean {
  return entries.some(
    (e) =>
      e.suite === 'py' &&
      (id === e.target || id.startsWith(`${e.target}::`) || id.startsWith(`${e.target}[`)),
  );
}

// ---------------------------------------------------------------------------
// Which tests need a server
// ---------------------------------------------------------------------------

export const JS_FIXTURE_RE = /^\s*(sandboxTest|buildTemplateTest)\b/;
export const JS_MOCK_RE =
  /vi\.(do)?[mM]ock\(|vi\.stubGlobal\(|vi\.fn\(|vi\.spyOn\(|server\.use\(|HttpResponse|mockResolvedValue|mockImplementation/;
export const JS_SERVER_RE =
  /Sandbox\.(create|connect|list|kill|getInfo|getMetrics|betaCreate|pause|resume|createSnapshot|listSnapshots|deleteSnapshot)\(|Template\.(build|exists|buildInBackground|getBuildStatus|assignTags|removeTags|getTags)\(|buildTemplate\(|\{\s*sandbox\s*[,}]/;

/**
 * Whether the JS test whose source block is `block` (from its own line to the next test's) needs
 * a server: it uses the suite's sandbox or template fixture, or it calls the SDK's API in its own
 * body and mocks nothing (no msw server in its file, no `vi` mock or stub, no mocked response).
 * E2B keeps mocked unit tests beside real ones in some files, so this is decided per test.
 */
export function jsTestNeedsServer(block: string, fileUsesMsw: boolean): boolean {
  if (JS_FIXTURE_RE.test(block)) return true;
  if (fileUsesMsw || JS_MOCK_RE.test(block)) return false;
  return JS_SERVER_RE.test(block);
}

/**
 * Whether a Python test file needs a server: E2B's python-sdk 2.0.2 suite has one file per topic,
 * each creating sandboxes (the `sandbox` fixtures, `Sandbox.create`), and no mocked transports
 * besides the decoder test in tests/bugs.
 */
export function pyFileNeedsServer(source: string): boolean {
  if (/unittest\.mock|monkeypatch|respx|httpx\.MockTransport/.test(source)) return false;
  // A test taking the `sandbox` / `async_sandbox` fixture, or creating or finding sandboxes itself.
  return /def test_\w+\([^)]*\b(async_)?sandbox\b|\b(Async)?Sandbox\.(create|connect|list|kill|get_info)\b/.test(
    source,
  );
}

export interface VitestReport {
  testResults?: {
    name: string;
    status: string;
    message?: string;
    assertionResults: {
      ancestorTitles: string[];
      title: string;
      status: string;
      failureMessages?: string[];
      location?: { line: number; column: number };
    }[];
  }[];
}

export function firstLine(text: string | undefined): string {
  for (const line of (text ?? '').split('\n')) {
    const clean = line.replace(/\x1b\[[0-9;]*m/g, '').trim();
    if (clean) return clean.slice(0, 500);
  }
  return '';
}

export function readJsResults(report: string, jsDir: string): TestResult[] {
  if (!existsSync(report)) return [];
  const data = JSON.parse(readFileSync(report, 'utf8')) as VitestReport;
  const out: TestResult[] = [];
  for (const f of data.testResults ?? []) {
    const file = relative(jsDir, f.name);
    const lines = readFileSync(f.name, 'utf8').split('\n');
    const fileUsesMsw = lines.some((l) => /from 'msw|setupServer\(/.test(l));
    const starts = [
      ...new Set(f.assertionResults.map((t) => t.location?.line).filter((n) => n !== undefined)),
    ].sort((x, y) => x - y);
    const needs = (line: number | undefined): boolean => {
      // Without a location (a file that failed to load), the whole file is the block.
      if (line === undefined) return jsTestNeedsServer(lines.join('\n'), fileUsesMsw);
      const next = starts.find((n) => n > line) ?? lines.length + 1;
      return jsTestNeedsServer(lines.slice(line - 1, next - 1).join('\n'), fileUsesMsw);
    };
    if (f.assertionResults.length === 0 && f.status === 'failed') {
      out.push({
        suite: 'js',
        file,
        name: '(file)',
        outcome: 'failed',
        error: firstLine(f.message),
        needsServer: needs(undefined),
      });
      continue;
    }
    for (const t of f.assertionResults) {
      const outcome: Outcome =
        t.status === 'passed' ? 'passed' : t.status === 'failed' ? 'failed' : 'skipped';
      out.push({
        suite: 'js',
        file,
        name: [...t.ancestorTitles, t.title].join(' > '),
        outcome,
        error: outcome === 'failed' ? firstLine(t.failureMessages?.[0]) : '',
        needsServer: needs(t.location?.line),
      });
    }
  }
  return out;
}

export function readPyResults(report: string, pyDir: string): TestResult[] {
  if (!existsSync(report)) return [];
  const byId = new Map<string, { outcome: Outcome; error: string }>();
  for (const line of readFileSync(report, 'utf8').split('\n')) {
    if (!line.trim()) continue;
    const r = JSON.parse(line) as { id: string; outcome: string; error: string };
    const prev = byId.get(r.id);
    if (prev?.outcome === 'failed') continue; // a teardown error after a failure keeps the first
    const outcome: Outcome =
      r.outcome === 'passed' ? 'passed' : r.outcome === 'failed' ? 'failed' : 'skipped';
    if (prev && outcome === 'passed') continue;
    byId.set(r.id, { outcome, error: r.error });
  }
  const sources = new Map<string, boolean>();
  return [...byId].map(([id, r]) => {
    const file = id.split('::')[0]!;
    let needs = sources.get(file);
    if (needs === undefined) {
      needs = pyFileNeedsServer(readFileSync(join(pyDir, file), 'utf8'));
      sources.set(file, needs);
    }
    return {
      suite: 'py' as const,
      file,
      name: id.slice(file.length + 2),
      ...r,
      needsServer: needs,
    };
  });
}

export function summarize(
  suite: 'js' | 'py',
  results: TestResult[],
  code: number | null,
  excluded: Exclusion[],
): SuiteSummary {
  const count = (rs: TestResult[], o: Outcome): number => rs.filter((r) => r.outcome === o).length;
  const server = results.filter((r) => r.needsServer);
  const sp = count(server, 'passed');
  const sf = count(server, 'failed');
  return {
    suite,
    commit: suite === 'js' ? JS_COMMIT : PY_COMMIT,
    version: suite === 'js' ? 'e2b 2.45.0 (js-sdk)' : `e2b ${PY_VERSION} (python-sdk)`,
    ran: results.length > 0,
    exitCode: code,
    passed: count(results, 'passed'),
    failed: count(results, 'failed'),
    skipped: count(results, 'skipped'),
    server: {
      passed: sp,
      failed: sf,
      skipped: count(server, 'skipped'),
      passRate: sp + sf > 0 ? sp / (sp + sf) : null,
    },
    excluded: excluded.filter((e) => e.suite === suite).map((e) => `${e.target} -- ${e.reason}`),
  };
}

/** Every test a report holds that exclude.txt names: each is a failure of this harness. */
export function leakedExclusions(results: TestResult[], exclusions: Exclusion[]): string[] {
  return results
    .filter((r) =>
      r.suite === 'js'
        ? exclusions.some((e) => e.suite === 'js' && globMatch(e.target, r.file))
        : pyExcluded(`${r.file}::${r.name}`, exclusions),
    )
    .map((r) => `${r.suite} ${r.file} > ${r.name}`);
}

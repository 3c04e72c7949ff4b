import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { delimiter, join, resolve } from 'node:path';
import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { prepareFnCallImages } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { FNCALL_PROGRAM } from './fncall.js';
import { removeCgroupParent } from './host-leftovers.js';
import { summarize } from './stats.js';

/**
 * `dsec bench sandboxfusion` (issue 26.3): SandboxFusion's `/run_code` on a
 * single node in this process.
 *
 * - `python`: `print(sum(map(int, input().split())))` calls at a fixed
 *   concurrency through `POST /sandboxfusion/run_code`, against the same
 *   calls through FnCall's native route (`client.fncall.run`), in
 *   interleaved rounds; target: at least 0.9 × the native rate.
 * - `cpp`, `go`: a compile-and-run call of a small program, one at a time,
 *   against the same compile and run bare on this host (a fresh directory,
 *   and for go a fresh build cache, per call, as in the sandbox); target: at
 *   most 1.3 × the bare time per call. A toolchain missing on the host leaves
 *   that bare side out (the report says so).
 */

export const SANDBOXFUSION_TARGETS = { pythonOverNative: 0.9, compiledOverBare: 1.3 } as const;

const ROUNDS = 4;

const CPP_PROGRAM = `#include <iostream>
#include <vector>
#include <algorithm>
int main() {
  int n; std::cin >> n;
  std::vector<long> v(n);
  for (int i = 0; i < n; i++) v[i] = (i * 7919L) % 1000;
  std::sort(v.begin(), v.end());
  long s = 0; for (long x : v) s += x;
  std::cout << s << std::endl;
}
`;

const GO_PROGRAM = `package main

import "fmt"

func main() {
	var n int
	fmt.Scan(&n)
	s := 0
	for i := 0; i < n; i++ {
		s += (i * 7919) % 1000
	}
	fmt.Println(s)
}
`;

/** The answer both programs give for `n`. */
function expectedSum(n: number): string {
  let s = 0;
  for (let i = 0; i < n; i++) s += (i * 7919) % 1000;
  return `${s}\n`;
}

export interface SandboxFusionBenchOptions {
  /** Measured python calls per side. Default 2000. */
  calls: number;
  concurrency: number;
  /** Compile-and-run calls per compiled language and side. Default 20. */
  compiledCalls: number;
  warmup?: number | undefined;
  cacheDir: string;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface RatePhase {
  calls: number;
  concurrency: number;
  callsPerSecond: number;
  p50Ms: number;
  p99Ms: number;
  failures: number;
  firstError?: string | undefined;
}

export interface TimePhase {
  calls: number;
  meanMs: number;
  p50Ms: number;
  failures: number;
  firstError?: string | undefined;
}

export interface SandboxFusionBenchReport {
  benchmark: 'sandboxfusion';
  results: {
    python: { sandboxfusion: RatePhase; native: RatePhase; ratio: number | null };
    cpp: { sandboxfusion: TimePhase; bare: TimePhase | null; ratio: number | null };
    go: { sandboxfusion: TimePhase; bare: TimePhase | null; ratio: number | null };
  };
  targets: typeof SANDBOXFUSION_TARGETS & { met: boolean };
  notes: string[];
  machine: Record<string, unknown>;
}

interface Meter {
  calls: number;
  seconds: number;
  latencies: number[];
  failures: number;
  firstError?: string | undefined;
}
const meter = (): Meter => ({ calls: 0, seconds: 0, latencies: [], failures: 0 });

async function slice(
  m: Meter,
  n: number,
  concurrency: number,
  one: (i: number) => Promise<string>,
  expected: (i: number) => string,
  tick: () => void,
  signal?: AbortSignal,
): Promise<void> {
  let next = 0;
  const t0 = process.hrtime.bigint();
  const worker = async () => {
    while (next < n) {
      if (signal?.aborted) throw new Error('benchmark aborted');
      const i = next++;
      const start = process.hrtime.bigint();
      try {
        const out = await one(i);
        if (out !== expected(i)) throw new Error(`answered ${JSON.stringify(out.slice(0, 200))}`);
        m.latencies.push(Number(process.hrtime.bigint() - start) / 1e6);
      } catch (err) {
        m.failures++;
        m.firstError ??= err instanceof Error ? err.message : String(err);
      }
      tick();
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, n) }, worker));
  m.seconds += Number(process.hrtime.bigint() - t0) / 1e9;
  m.calls += n;
}

function ratePhase(m: Meter, concurrency: number): RatePhase {
  const s = summarize(m.latencies);
  return {
    calls: m.calls,
    concurrency,
    callsPerSecond: m.seconds > 0 ? Math.round(((m.calls - m.failures) / m.seconds) * 10) / 10 : 0,
    p50Ms: s.p50Ms,
    p99Ms: s.p99Ms,
    failures: m.failures,
    ...(m.firstError !== undefined ? { firstError: m.firstError } : {}),
  };
}

function timePhase(m: Meter): TimePhase {
  const s = summarize(m.latencies);
  const mean = m.latencies.reduce((a, b) => a + b, 0) / Math.max(1, m.latencies.length);
  return {
    calls: m.calls,
    meanMs: Math.round(mean * 10) / 10,
    p50Ms: s.p50Ms,
    failures: m.failures,
    ...(m.firstError !== undefined ? { firstError: m.firstError } : {}),
  };
}

/** Runs argv in `cwd` with `stdin`; resolves with stdout, rejects on a non-zero exit. */
function runTool(
  argv: string[],
  cwd: string,
  stdin: string,
  env?: NodeJS.ProcessEnv,
): Promise<string> {
  return new Promise((res, rej) => {
    const child = spawn(argv[0]!, argv.slice(1), {
      cwd,
      env: env ?? process.env,
      stdio: ['pipe', 'pipe', 'pipe'],
    });
    let out = '';
    let err = '';
    child.stdout.setEncoding('utf8').on('data', (c: string) => (out += c));
    child.stderr.setEncoding('utf8').on('data', (c: string) => (err += c));
    child.on('error', rej);
    child.on('close', (code) =>
      code === 0 ? res(out) : rej(new Error(`${argv[0]} exit ${code}: ${err.slice(-200)}`)),
    );
    child.stdin.end(stdin);
  });
}

/** Whether `tool` is on PATH. */
function onPath(tool: string): boolean {
  return (process.env['PATH'] ?? '').split(delimiter).some((d) => d && existsSync(join(d, tool)));
}

/** A bare compile and run on this host, in a fresh directory (and build cache). */
async function bareCompiled(lang: 'cpp' | 'go', stdin: string): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-bench-sf-bare-'));
  try {
    if (lang === 'cpp') {
      await writeFile(join(dir, 'main.cpp'), CPP_PROGRAM);
      await runTool(['g++', '-std=c++17', 'main.cpp', '-o', 'test', '-lpthread'], dir, '');
      return await runTool(['./test'], dir, stdin);
    }
    await writeFile(join(dir, 'main.go'), GO_PROGRAM);
    const env = {
      ...process.env,
      GOCACHE: join(dir, 'cache'),
      GOPATH: join(dir, 'gopath'),
      GO111MODULE: 'off',
      CGO_ENABLED: '0',
    };
    await runTool(['go', 'build', '-o', 'out', 'main.go'], dir, '', env);
    return await runTool(['./out'], dir, stdin, env);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

export async function benchSandboxFusion(
  options: SandboxFusionBenchOptions,
): Promise<SandboxFusionBenchReport> {
  const { calls, concurrency, compiledCalls, signal } = options;
  const warmup = options.warmup ?? 500;
  const total = warmup + calls * 2 + compiledCalls * 4 + 2;
  let done = 0;
  const tick = () => options.onProgress?.(++done, total);
  const notes: string[] = [];
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-sf-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-sf-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const storeDir = resolve(options.cacheDir, 'images');
    await prepareFnCallImages(new DirImageStore(storeDir), {
      cacheDir: join(options.cacheDir, 'cache'),
      images: ['fncall-node', 'fncall-sf-gcc', 'fncall-sf-go'],
      signal,
    });
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      cgroupParent,
      imageStore: storeDir,
    });
    cleanups.unshift(async () => {
      await node.close({ stopSandboxes: true });
      await removeCgroupParent(cgroupParent);
    });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey, maxSockets: 512 });
    cleanups.unshift(async () => client.close());

    const runCode = async (body: Record<string, unknown>): Promise<string> => {
      const res = await fetch(`${node.url}/sandboxfusion/run_code`, {
        method: 'POST',
        headers: { authorization: `Bearer ${node.adminKey}`, 'content-type': 'application/json' },
        body: JSON.stringify(body),
        ...(signal ? { signal } : {}),
      });
      const text = await res.text();
      if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${text.slice(0, 200)}`);
      const r = JSON.parse(text) as {
        status: string;
        message: string;
        run_result?: { stdout?: string };
      };
      if (r.status !== 'Success') throw new Error(`${r.status}: ${text.slice(0, 300)}`);
      return r.run_result?.stdout ?? '';
    };
    const input = (i: number) => `${(i * 7919) % 100_003} ${(i * 104_729) % 1_000_003}\n`;
    const sum = (i: number) => `${((i * 7919) % 100_003) + ((i * 104_729) % 1_000_003)}\n`;
    const sf = (i: number) =>
      runCode({ language: 'python', code: FNCALL_PROGRAM, stdin: input(i) });
    const native = async (i: number) => {
      const r = await client.fncall.run({
        language: 'python',
        code: FNCALL_PROGRAM,
        stdin: input(i),
      });
      if (r.outcome !== 'ok' || r.exitCode !== 0)
        throw new Error(`${r.outcome}: ${r.stderr.slice(-200)}`);
      return r.stdout;
    };
    // Warm-up: both pools (sf-base and python) start and fill.
    await slice(meter(), Math.ceil(warmup / 2), concurrency, native, sum, tick, signal);
    await slice(meter(), Math.floor(warmup / 2), concurrency, sf, sum, tick, signal);

    const m = { sf: meter(), native: meter() };
    for (let round = 0; round < ROUNDS; round++) {
      const n = Math.floor((calls * (round + 1)) / ROUNDS) - Math.floor((calls * round) / ROUNDS);
      const order = round % 2 === 0 ? (['sf', 'native'] as const) : (['native', 'sf'] as const);
      for (const side of order)
        await slice(m[side], n, concurrency, side === 'sf' ? sf : native, sum, tick, signal);
    }
    const sfPhase = ratePhase(m.sf, concurrency);
    const nativePhase = ratePhase(m.native, concurrency);
    const pyRatio =
      nativePhase.callsPerSecond > 0
        ? Math.round((sfPhase.callsPerSecond / nativePhase.callsPerSecond) * 100) / 100
        : null;

    const compiled = async (lang: 'cpp' | 'go') => {
      const code = lang === 'cpp' ? CPP_PROGRAM : GO_PROGRAM;
      const n = 100_000;
      const hasTool = onPath(lang === 'cpp' ? 'g++' : 'go');
      if (!hasTool)
        notes.push(`${lang}: no ${lang === 'cpp' ? 'g++' : 'go'} on this host: no bare side`);
      // One unmeasured call each: the pool's first worker starts.
      await runCode({ language: lang, code, stdin: `${n}\n`, compile_timeout: 120 }).catch(
        () => '',
      );
      tick();
      const side = { sf: meter(), bare: meter() };
      for (let i = 0; i < compiledCalls; i++) {
        await slice(
          side.sf,
          1,
          1,
          () => runCode({ language: lang, code, stdin: `${n}\n`, compile_timeout: 120 }),
          () => expectedSum(n),
          tick,
          signal,
        );
        if (hasTool)
          await slice(
            side.bare,
            1,
            1,
            () => bareCompiled(lang, `${n}\n`),
            () => expectedSum(n),
            tick,
            signal,
          );
        else tick();
      }
      const sfT = timePhase(side.sf);
      const bareT = hasTool ? timePhase(side.bare) : null;
      return {
        sandboxfusion: sfT,
        bare: bareT,
        ratio:
          bareT && bareT.meanMs > 0 ? Math.round((sfT.meanMs / bareT.meanMs) * 100) / 100 : null,
      };
    };
    const cpp = await compiled('cpp');
    const go = await compiled('go');
    if (concurrency !== 32 || calls !== 2000)
      notes.push(
        `shrunk run: ${calls} python calls at concurrency ${concurrency} (the issue's is 2000 at 32)`,
      );
    const met =
      sfPhase.failures === 0 &&
      cpp.sandboxfusion.failures === 0 &&
      go.sandboxfusion.failures === 0 &&
      (pyRatio ?? 0) >= SANDBOXFUSION_TARGETS.pythonOverNative &&
      cpp.ratio !== null &&
      cpp.ratio <= SANDBOXFUSION_TARGETS.compiledOverBare &&
      go.ratio !== null &&
      go.ratio <= SANDBOXFUSION_TARGETS.compiledOverBare;
    return {
      benchmark: 'sandboxfusion',
      results: { python: { sandboxfusion: sfPhase, native: nativePhase, ratio: pyRatio }, cpp, go },
      targets: { ...SANDBOXFUSION_TARGETS, met },
      notes,
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/** `dsec bench sandboxfusion`: registered by `commands/bench.ts`. */
export function registerSandboxFusionBench(bench: Command): void {
  bench
    .command('sandboxfusion')
    .description(
      "SandboxFusion's /run_code: python calls vs FnCall's native route; C++ and Go compile-and-run vs bare on the host",
    )
    .option('--calls <n>', 'measured python calls per side', parseInteger, 2000)
    .option('--concurrency <n>', 'python calls in flight at once', parseInteger, 32)
    .option(
      '--compiled-calls <n>',
      'compile-and-run calls per compiled language and side',
      parseInteger,
      20,
    )
    .option('--warmup <n>', 'unmeasured python calls first', parseInteger, 500)
    .option(
      '--cache-dir <dir>',
      'runtime images and their downloads, kept between runs (default <state-dir>/fncall-bench)',
    )
    .action(
      async (
        opts: {
          calls: number;
          concurrency: number;
          compiledCalls: number;
          warmup: number;
          cacheDir?: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const progress = createProgress({
          label: 'bench sandboxfusion',
          total: opts.warmup + opts.calls * 2 + opts.compiledCalls * 4 + 2,
          enabled: !ctx.json,
        });
        const report = await benchSandboxFusion({
          calls: opts.calls,
          concurrency: opts.concurrency,
          compiledCalls: opts.compiledCalls,
          warmup: opts.warmup,
          cacheDir: opts.cacheDir ?? join(ctx.options.stateDir, 'fncall-bench'),
          onProgress: (d) => progress.update(d),
          signal: ctx.signal,
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const py = report.results.python;
        ctx.out(
          `python  sandboxfusion ${py.sandboxfusion.callsPerSecond} calls/s, native ${py.native.callsPerSecond} calls/s, ratio ${py.ratio}`,
        );
        for (const lang of ['cpp', 'go'] as const) {
          const r = report.results[lang];
          ctx.out(
            `${lang.padEnd(7)} sandboxfusion ${r.sandboxfusion.meanMs} ms/call, bare ${r.bare?.meanMs ?? '-'} ms/call, ratio ${r.ratio ?? '-'}`,
          );
        }
        for (const note of report.notes) ctx.out(`note: ${note}`);
        ctx.out(
          `targets: python >= ${report.targets.pythonOverNative}x native, compiled <= ${report.targets.compiledOverBare}x bare: ${report.targets.met ? 'met' : 'not met'}`,
        );
      },
    );
}

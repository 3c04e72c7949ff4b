import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { prepareFnCallImages } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { removeCgroupParent } from './host-leftovers.js';
import { summarize } from './stats.js';

/**
 * `dsec bench fncall` (issue 14): short stateless Python calls —
 * `print(sum(map(int, input().split())))` on one line of input — at a fixed
 * concurrency, three ways, each checked for the right answer:
 *
 * - `fncall`: `client.fncall.run` through the full path (TypeScript SDK →
 *   apiserver → edge → warm pool) on a single node in this process;
 * - `sandboxPerCall`: a DSec sandbox per call on the same node (create,
 *   exec `python3 -c`, remove), what a user does without FnCall;
 * - `bare`: `python3 -c` spawned on this host per call, no isolation at all.
 *
 * The systems run in interleaved rounds (each on a quarter of the calls,
 * the first one rotating), so load from elsewhere falls on all alike. Rates
 * are calls answered right per second of the system's own wall-clock time;
 * latencies are per call as the client saw them. The sandbox-per-call
 * phase may run fewer calls than the others (it is two orders of magnitude
 * slower); its rate is measured over the calls it ran, which the report says.
 */

/** Rounds that interleave the systems. */
const ROUNDS = 4;

export const FNCALL_PROGRAM = 'print(sum(map(int, input().split())))';

/** Targets of issue 14 on the 2-core reference machine. */
export const FNCALL_TARGETS = {
  callsPerSecond: 200,
  overSandboxPerCall: 20,
  overBare: 1.5,
} as const;

export interface FnCallBenchOptions {
  /** Measured calls of the fncall and bare phases. Default 2000. */
  calls: number;
  /** Calls in flight at once. Default 32. */
  concurrency: number;
  /** Calls of the sandbox-per-call phase (default min(calls, 200)). */
  sandboxCalls?: number | undefined;
  /**
   * Unmeasured fncall calls first, so pools are warm and V8 has compiled the
   * hot path (its compiler threads would otherwise compete with the zygotes
   * for the cores in the measured phase): the state of a FnCall service that
   * has been up a while. Default 1,000.
   */
  warmup?: number | undefined;
  /** The interpreter of the bare phase (default /usr/bin/python3 where present, else python3 on PATH). */
  python?: string | undefined;
  /** The runtime images (`images/`) and their downloads (`cache/`), kept between runs. */
  cacheDir: string;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface FnCallPhase {
  calls: number;
  concurrency: number;
  callsPerSecond: number;
  p50Ms: number;
  p99Ms: number;
  /** Calls that failed or answered wrongly. */
  failures: number;
  firstError?: string | undefined;
}

export interface FnCallBenchReport {
  benchmark: 'fncall';
  cycle: string;
  results: {
    fncall: FnCallPhase;
    sandboxPerCall: FnCallPhase;
    bare: FnCallPhase;
    /** The same calls as one `client.fncall.map` (batch endpoint): rate and failures only. */
    fncallMap: Pick<
      FnCallPhase,
      'calls' | 'concurrency' | 'callsPerSecond' | 'failures' | 'firstError'
    >;
  };
  /** fncall's rate ÷ each other's rate (above 1: FnCall is faster). */
  ratios: { sandboxPerCall: number | null; bare: number | null };
  targets: typeof FNCALL_TARGETS & { met: boolean };
  notes: string[];
  machine: Record<string, unknown>;
}

/** One call's input and its right answer. */
interface Case {
  stdin: string;
  expected: string;
}

function cases(n: number): Case[] {
  return Array.from({ length: n }, (_, i) => {
    const a = (i * 7919) % 100_003;
    const b = (i * 104_729) % 1_000_003;
    return { stdin: `${a} ${b}\n`, expected: `${a + b}\n` };
  });
}

/** What one system measured over its slices. */
interface Meter {
  calls: number;
  seconds: number;
  latencies: number[];
  failures: number;
  firstError?: string | undefined;
}

const meter = (): Meter => ({ calls: 0, seconds: 0, latencies: [], failures: 0 });

/** Runs `one` over `items` with `concurrency` in flight, adding each call and the slice's time to `m`. */
async function slice(
  m: Meter,
  items: Case[],
  concurrency: number,
  one: (c: Case) => Promise<string>,
  tick: () => void,
  signal?: AbortSignal,
): Promise<void> {
  let next = 0;
  const t0 = process.hrtime.bigint();
  const worker = async () => {
    while (next < items.length) {
      if (signal?.aborted) throw new Error('benchmark aborted');
      const c = items[next++]!;
      const start = process.hrtime.bigint();
      try {
        const out = await one(c);
        if (out !== c.expected) throw new Error(`answered ${JSON.stringify(out.slice(0, 200))}`);
        m.latencies.push(Number(process.hrtime.bigint() - start) / 1e6);
      } catch (err) {
        m.failures++;
        m.firstError ??= err instanceof Error ? err.message : String(err);
      }
      tick();
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, items.length) }, worker));
  m.seconds += Number(process.hrtime.bigint() - t0) / 1e9;
  m.calls += items.length;
}

function phaseOf(m: Meter, concurrency: number): FnCallPhase {
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

/** `python -c PROGRAM` with `stdin`; resolves with its stdout, rejects on a non-zero exit. */
function bareCall(python: string, stdin: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn(python, ['-c', FNCALL_PROGRAM], { stdio: ['pipe', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout.setEncoding('utf8').on('data', (c: string) => (out += c));
    child.stderr.setEncoding('utf8').on('data', (c: string) => (err += c));
    child.on('error', reject);
    child.on('close', (code) =>
      code === 0 ? resolve(out) : reject(new Error(`exit ${code}: ${err.slice(-200)}`)),
    );
    child.stdin.end(stdin);
  });
}

export async function benchFnCall(options: FnCallBenchOptions): Promise<FnCallBenchReport> {
  const { calls, concurrency, signal } = options;
  const warmup = options.warmup ?? 1000;
  const sandboxCalls = options.sandboxCalls ?? Math.min(calls, 200);
  const python =
    options.python ?? (existsSync('/usr/bin/python3') ? '/usr/bin/python3' : 'python3');
  const total = warmup + calls * 3 + sandboxCalls;
  let done = 0;
  const tick = () => options.onProgress?.(++done, total);
  const notes: string[] = [];

  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-fncall-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-fncall-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    // The runtime images live in a store kept between runs: building them the first time takes
    // minutes (debootstrap); the node reads its layers from that store.
    const storeDir = resolve(options.cacheDir, 'images');
    const { layers } = await prepareFnCallImages(new DirImageStore(storeDir), {
      cacheDir: join(options.cacheDir, 'cache'),
      signal,
    });
    // The python runtime's image, which the sandbox-per-call phase creates sandboxes from.
    const pythonImage = layers.find((l) => l.kind === 'base')?.name ?? 'fncall-base';
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
    const fncall = async (c: Case) => {
      const r = await client.fncall.run({
        language: 'python',
        code: FNCALL_PROGRAM,
        stdin: c.stdin,
      });
      if (r.outcome !== 'ok' || r.exitCode !== 0) {
        throw new Error(`${r.outcome} exit ${r.exitCode}: ${(r.reason ?? r.stderr).slice(-200)}`);
      }
      return r.stdout;
    };

    // Warm-up: the pools start and fill; not measured.
    await slice(meter(), cases(warmup), concurrency, fncall, tick, signal);

    const inputs = cases(calls);
    const m = { fncall: meter(), bare: meter(), fncallMap: meter(), sandboxPerCall: meter() };
    const sandboxInputs = inputs.slice(0, sandboxCalls);
    if (sandboxCalls < calls) {
      notes.push(
        `sandboxPerCall ran ${sandboxCalls} of ${calls} calls (--sandbox-calls); its rate is measured over those`,
      );
    }
    const systems: Record<keyof typeof m, (part: (items: Case[]) => Case[]) => Promise<void>> = {
      fncall: (part) => slice(m.fncall, part(inputs), concurrency, fncall, tick, signal),
      bare: (part) =>
        slice(m.bare, part(inputs), concurrency, (c) => bareCall(python, c.stdin), tick, signal),
      // The batch route: one map over the slice; it has a rate, not per-call latencies.
      fncallMap: async (part) => {
        const items = part(inputs);
        const t0 = process.hrtime.bigint();
        for await (const item of client.fncall.map(
          items.map((c) => ({ language: 'python', code: FNCALL_PROGRAM, stdin: c.stdin })),
          { concurrency, signal },
        )) {
          if (item.error || item.result.stdout !== items[item.index]!.expected) {
            m.fncallMap.failures++;
            m.fncallMap.firstError ??=
              item.error?.message ??
              `answered ${JSON.stringify(item.result?.stdout.slice(0, 200))}`;
          }
          tick();
        }
        m.fncallMap.seconds += Number(process.hrtime.bigint() - t0) / 1e9;
        m.fncallMap.calls += items.length;
      },
      sandboxPerCall: (part) =>
        slice(
          m.sandboxPerCall,
          part(sandboxInputs),
          concurrency,
          async (c) => {
            const sb = await client.runContainer({
              image: pythonImage,
              memoryLimitMb: 256,
              cpuCoresLimit: 1,
              ttlSeconds: 600,
            });
            try {
              const r = await sb.exec(['python3', '-c', FNCALL_PROGRAM], { stdin: c.stdin });
              if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}: ${r.stderr.slice(-200)}`);
              return r.stdout;
            } finally {
              await sb.stop();
            }
          },
          tick,
          signal,
        ),
    };
    // Rounds interleave the systems (rotating which goes first), each on its share of the calls,
    // so load from elsewhere on the machine falls on all of them alike.
    const names = Object.keys(systems) as (keyof typeof m)[];
    for (let round = 0; round < ROUNDS; round++) {
      const part = (items: Case[]) =>
        items.slice(
          Math.floor((items.length * round) / ROUNDS),
          Math.floor((items.length * (round + 1)) / ROUNDS),
        );
      for (let k = 0; k < names.length; k++)
        await systems[names[(round + k) % names.length]!](part);
    }
    const fncallPhase = phaseOf(m.fncall, concurrency);
    const barePhase = phaseOf(m.bare, concurrency);
    const sandboxPhase = phaseOf(m.sandboxPerCall, concurrency);
    const mapPhase = phaseOf(m.fncallMap, concurrency);

    const rate = (a: FnCallPhase, b: FnCallPhase) =>
      b.callsPerSecond > 0 ? Math.round((a.callsPerSecond / b.callsPerSecond) * 100) / 100 : null;
    const ratios = {
      sandboxPerCall: rate(fncallPhase, sandboxPhase),
      bare: rate(fncallPhase, barePhase),
    };
    if (concurrency !== 32 || calls !== 2000) {
      notes.push(
        `shrunk run: ${calls} calls at concurrency ${concurrency} (the issue's is 2000 at 32)`,
      );
    }
    return {
      benchmark: 'fncall',
      cycle: `python ${JSON.stringify(FNCALL_PROGRAM)} on one line of input, ${concurrency} calls in flight`,
      results: {
        fncall: fncallPhase,
        sandboxPerCall: sandboxPhase,
        bare: barePhase,
        fncallMap: {
          calls: mapPhase.calls,
          concurrency,
          callsPerSecond: mapPhase.callsPerSecond,
          failures: mapPhase.failures,
          ...(mapPhase.firstError !== undefined ? { firstError: mapPhase.firstError } : {}),
        },
      },
      ratios,
      targets: {
        ...FNCALL_TARGETS,
        met:
          fncallPhase.failures === 0 &&
          fncallPhase.callsPerSecond >= FNCALL_TARGETS.callsPerSecond &&
          (ratios.sandboxPerCall ?? 0) >= FNCALL_TARGETS.overSandboxPerCall &&
          (ratios.bare ?? 0) >= FNCALL_TARGETS.overBare,
      },
      notes,
      machine: { ...(await describeMachine()), python },
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/** `dsec bench fncall`: registered by `commands/bench.ts`. */
export function registerFnCallBench(bench: Command): void {
  bench
    .command('fncall')
    .description(
      'short Python calls through FnCall warm pools (SDK → apiserver → edge) vs a sandbox per call vs bare `python3 -c`',
    )
    .option('--calls <n>', 'measured calls of the fncall and bare phases', parseInteger, 2000)
    .option('--concurrency <n>', 'calls in flight at once', parseInteger, 32)
    .option(
      '--sandbox-calls <n>',
      'calls of the sandbox-per-call phase (default min(calls, 200))',
      parseInteger,
    )
    .option('--warmup <n>', 'unmeasured fncall calls first', parseInteger, 1000)
    .option(
      '--cache-dir <dir>',
      'runtime images and their downloads, kept between runs (default <state-dir>/fncall-bench)',
    )
    .action(
      async (
        opts: {
          calls: number;
          concurrency: number;
          sandboxCalls?: number;
          warmup: number;
          cacheDir?: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const sandboxCalls = opts.sandboxCalls ?? Math.min(opts.calls, 200);
        const progress = createProgress({
          label: 'bench fncall',
          total: opts.warmup + opts.calls * 3 + sandboxCalls,
          enabled: !ctx.json,
        });
        const report = await benchFnCall({
          calls: opts.calls,
          concurrency: opts.concurrency,
          sandboxCalls,
          warmup: opts.warmup,
          cacheDir: opts.cacheDir ?? join(ctx.options.stateDir, 'fncall-bench'),
          onProgress: (done) => progress.update(done),
          signal: ctx.signal,
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        for (const [name, p] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(15)} ${String(p.callsPerSecond).padStart(8)} calls/s` +
              ('p99Ms' in p
                ? `   p50 ${p.p50Ms.toFixed(1)} ms   p99 ${p.p99Ms.toFixed(1)} ms`
                : '') +
              `   ${p.failures} failures of ${p.calls}`,
          );
        }
        ctx.out(`ratios (fncall's rate ÷ each): ${JSON.stringify(report.ratios)}`);
        for (const note of report.notes) ctx.out(`note: ${note}`);
        const t = report.targets;
        ctx.out(
          `targets: >= ${t.callsPerSecond} calls/s, >= ${t.overSandboxPerCall}x sandbox per call, ` +
            `>= ${t.overBare}x bare, no failures: ${t.met ? 'met' : 'not met'}`,
        );
      },
    );
}

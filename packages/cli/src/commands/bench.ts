import type { Command } from 'commander';
import { DsecError } from '@dsec/core';
import { benchBurst } from '../bench/burst.js';
import { benchChurn } from '../bench/churn.js';
import { benchCluster } from '../bench/cluster.js';
import { benchCreate } from '../bench/create.js';
import { benchDensity } from '../bench/density.js';
import { benchExec } from '../bench/exec.js';
import { benchFork } from '../bench/fork.js';
import { benchSnapshot } from '../bench/snapshot.js';
import { benchLayers } from '../bench/layers.js';
import { benchOndemand } from '../bench/ondemand.js';
import { benchPause } from '../bench/pause.js';
import { benchPlacement, PLACEMENT_STRATEGIES } from '../bench/placement.js';
import { benchQos } from '../bench/qos.js';
import { benchBounds, FLOOD_KINDS, type FloodKind } from '../bench/bounds.js';
import { registerEnvsBench } from '../bench/envs.js';
import { registerEvalBench } from '../bench/eval.js';
import { registerFnCallBench } from '../bench/fncall.js';
import { registerFuzzBench } from '../bench/fuzz.js';
import { registerSandboxFusionBench } from '../bench/sandboxfusion.js';
import { registerRegistryBench } from '../bench/registry.js';
import { registerBuildBench } from '../bench/build.js';
import { registerMicrovmBench } from '../bench/microvm.js';
import { benchSdk } from '../bench/sdk.js';
import type { LatencySummary } from '../bench/stats.js';
import { contextOf, type CliContext } from '../context.js';
import { addAdmissionOptions, admissionConfig, type AdmissionFlags } from './up-admission.js';
import { createProgress } from '../progress.js';

/**
 * `dsec bench NAME`: side-by-side benchmarks against a peer, in one run,
 * interleaved. Prints a table, or with `--json` one object with `results`
 * and `ratios` (ours ÷ peer; below 1 means DSec is better).
 */
export function register(program: Command): void {
  const bench = program
    .command('bench')
    .description('measure DSec against peers (runc, podman) side by side');
  bench
    .command('exec')
    .description(
      "`true` in a warm session through the full path vs the runtime's exec and `nsenter` into the same sandbox; stdout throughput; `echo` throughput under load",
    )
    .option('--iterations <n>', 'measured round trips per system', '200')
    .option(
      '--warmup <n>',
      'unmeasured round trips first (a long-running server has compiled its hot paths)',
      '1000',
    )
    .option(
      '--block <n>',
      'consecutive round trips of one system per turn (1: every call follows another system)',
      '10',
    )
    .option('--stream-mib <n>', 'MiB of stdout streamed for the throughput run', '512')
    .option('--load-execs <n>', '`echo` commands in the load run', '5000')
    .option('--load-warmup <n>', 'unmeasured `echo` commands before the load run', '2000')
    .option('--load-concurrency <n>', 'commands in flight at once in the load run', '64')
    .option('--load-sandboxes <n>', 'sandboxes the load run spreads over', '16')
    .action(
      async (
        opts: {
          iterations: string;
          warmup: string;
          block: string;
          streamMib: string;
          loadExecs: string;
          loadWarmup: string;
          loadConcurrency: string;
          loadSandboxes: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const report = await runBench(
          ctx,
          'exec',
          Number(opts.iterations) + Number(opts.warmup),
          (onProgress) =>
            benchExec({
              iterations: Number(opts.iterations),
              warmup: Number(opts.warmup),
              block: Number(opts.block),
              streamBytes: Number(opts.streamMib) * 1024 * 1024,
              loadExecs: Number(opts.loadExecs),
              loadWarmup: Number(opts.loadWarmup),
              loadConcurrency: Number(opts.loadConcurrency),
              loadSandboxes: Number(opts.loadSandboxes),
              onProgress,
              signal: ctx.signal,
            }),
        );
        if (!report) return;
        printLatencies(ctx, report);
        ctx.out(
          `stdout throughput: ${report.throughput.mbPerSecond} MB/s raw, ${report.throughput.ndjsonMbPerSecond} MB/s framed (NDJSON)`,
        );
        const load = report.results.load;
        ctx.out(
          `under load (${load.concurrency} in flight over ${load.sandboxes} sandboxes): ${load.execsPerSecond} execs/s, p99 ${load.p99Ms} ms, ${load.failures} failures`,
        );
      },
    );
  bench
    .command('cluster')
    .description(
      'create → exec `true` → destroy through 2 apiservers and N local edge processes vs a single-process `dsec up`',
    )
    .option('--iterations <n>', 'measured cycles per system', '30')
    .option('--warmup <n>', 'unmeasured cycles first', '3')
    .option('--edges <n>', 'edge processes of the cluster', '3')
    .action(
      async (opts: { iterations: string; warmup: string; edges: string }, command: Command) => {
        const ctx = contextOf(command);
        const report = await runBench(
          ctx,
          'cluster',
          Number(opts.iterations) + Number(opts.warmup),
          (onProgress) =>
            benchCluster({
              iterations: Number(opts.iterations),
              warmup: Number(opts.warmup),
              edges: Number(opts.edges),
              onProgress,
              ...(ctx.signal ? { signal: ctx.signal } : {}),
            }),
        );
        if (report) printLatencies(ctx, report);
      },
    );
  bench
    .command('sdk')
    .description(
      'exec `true` on one sandbox through the TypeScript SDK, the Python SDK, the unmodified e2b SDK (E2B API) and each Python framework provider (inspect_ai, swerex, verifiers, tinker, harbor)',
    )
    .option('--iterations <n>', 'measured round trips per client', '200')
    .option('--warmup <n>', 'unmeasured round trips first', '20')
    .option('--python <path>', 'Python interpreter with httpx', '/usr/bin/python3')
    .option('--rounds <n>', 'repeat the whole measurement; each round and the median reported', '1')
    .action(
      async (
        opts: { iterations: string; warmup: string; python: string; rounds: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const report = await runBench(
          ctx,
          'sdk',
          (Number(opts.iterations) + Number(opts.warmup)) * Math.max(1, Number(opts.rounds)),
          (onProgress) =>
            benchSdk({
              iterations: Number(opts.iterations),
              warmup: Number(opts.warmup),
              rounds: Number(opts.rounds),
              python: opts.python,
              onProgress,
              signal: ctx.signal,
            }),
        );
        if (report) printLatencies(ctx, report);
      },
    );
  bench
    .command('create')
    .description(
      'create → exec `true` → destroy through the full path vs bare `runc run` and `podman run --rm`',
    )
    .option('--iterations <n>', 'measured cycles per system', '30')
    .option('--warmup <n>', 'unmeasured cycles first', '3')
    .action(async (opts: { iterations: string; warmup: string }, command: Command) => {
      const ctx = contextOf(command);
      const report = await runBench(
        ctx,
        'create',
        Number(opts.iterations) + Number(opts.warmup),
        (onProgress) =>
          benchCreate({
            iterations: Number(opts.iterations),
            warmup: Number(opts.warmup),
            onProgress,
            signal: ctx.signal,
          }),
      );
      if (report) printLatencies(ctx, report);
    });
  bench
    .command('burst')
    .description(
      'N concurrent creates (default network policy) vs bare `runc run -d` of the same rootfs at the same concurrency',
    )
    .option('--count <n>', 'creates per system', '1000')
    .option('--concurrency <n>', 'creates in flight at once (both systems)', '1000')
    .action(async (opts: { count: string; concurrency: string }, command: Command) => {
      const ctx = contextOf(command);
      const count = Number(opts.count);
      const report = await runBench(ctx, 'burst', 3 * count, (onProgress) =>
        benchBurst({
          count,
          concurrency: Number(opts.concurrency),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      const { dsec, runc } = report.results;
      for (const [name, s] of [
        ['dsec', dsec],
        ['runc', runc],
      ] as const) {
        ctx.out(
          `${name.padEnd(6)} ${s.createsPerSecond.toFixed(1).padStart(7)} creates/s   p50 ${s.p50Ms.toFixed(0).padStart(6)} ms   p99 ${s.p99Ms.toFixed(0).padStart(6)} ms   failures ${s.failures}`,
        );
      }
      ctx.out(
        `dsec removals ${dsec.removals.perSecond.toFixed(1)}/s, failures ${dsec.removals.failures}; left on the host: ${JSON.stringify(dsec.left)}`,
      );
      ctx.out(`ratios (dsec ÷ runc, creates/s): ${JSON.stringify(report.ratios)}`);
    });
  bench
    .command('churn')
    .description(
      'create → exec → destroy in a loop at full speed (default network policy); counts what is left on the host',
    )
    .option('--seconds <n>', 'how long to churn', '60')
    .option('--concurrency <n>', 'loops running at once', '8')
    .action(async (opts: { seconds: string; concurrency: string }, command: Command) => {
      const ctx = contextOf(command);
      const seconds = Number(opts.seconds);
      const report = await runBench(ctx, 'churn', seconds, (onProgress) =>
        benchChurn({
          seconds,
          concurrency: Number(opts.concurrency),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      const { dsec } = report.results;
      ctx.out(
        `dsec ${dsec.perSecond.toFixed(2)} cycles/s (${dsec.cycles} in ${seconds} s), failures ${dsec.failures}, cycle p50 ${dsec.p50Ms.toFixed(0)} ms p99 ${dsec.p99Ms.toFixed(0)} ms`,
      );
      ctx.out(`left on the host: ${JSON.stringify(dsec.left)}`);
    });
  addAdmissionOptions(bench.command('density'))
    .description(
      'idle sandboxes (--cpus 1 --memory-mb 512) until admission refuses one: how many, what stopped it, platform bytes each',
    )
    .option('--max <n>', 'stop at this many sandboxes (default: until admission refuses)')
    .option('--concurrency <n>', 'creates in flight at once', '4')
    .option('--cpus <n>', 'requested CPUs of each sandbox', '1')
    .option('--memory-mb <n>', 'requested memory of each sandbox', '512')
    .action(
      async (
        opts: {
          max?: string;
          concurrency: string;
          cpus: string;
          memoryMb: string;
        } & AdmissionFlags,
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const max = opts.max !== undefined ? Number(opts.max) : undefined;
        const report = await runBench(ctx, 'density', max ?? 0, (onProgress) =>
          benchDensity({
            max,
            concurrency: Number(opts.concurrency),
            cpus: Number(opts.cpus),
            memoryMb: Number(opts.memoryMb),
            admission: admissionConfig(opts),
            onProgress,
            ...(ctx.signal ? { signal: ctx.signal } : {}),
          }),
        );
        if (!report) return;
        const d = report.results.dsec;
        ctx.out(
          `dsec ${d.sandboxes} idle sandboxes (stopped by ${d.stoppedBy}${d.refusal ? `: ${JSON.stringify(d.refusal)}` : ''})`,
        );
        ctx.out(
          `platform memory per sandbox ${(d.platformBytesPerSandbox / 2 ** 20).toFixed(2)} MiB (process PSS ${(d.processPssBytesPerSandbox / 2 ** 20).toFixed(2)} MiB), charged ${(d.chargedBytesPerSandbox / 2 ** 20).toFixed(2)} MiB`,
        );
        ctx.out(
          `${d.createsPerSecond} creates/s, create failures ${d.createFailures}, exec failures ${d.execFailures}, remove failures ${d.removeFailures}${d.removeFailures ? ` ${JSON.stringify(d.removeFailuresByCode)}` : ''}`,
        );
      },
    );
  bench
    .command('qos')
    .description(
      'per-step latency of a latency-sensitive sandbox alone and beside 25 %/50 % best-effort load, with and without QoS classes',
    )
    .option('--steps <n>', 'measured steps per configuration', '600')
    .option('--rounds <n>', 'interleaved rounds', '6')
    .option('--step-ms <n>', 'CPU time of one step alone', '10')
    .action(async (opts: { steps: string; rounds: string; stepMs: string }, command: Command) => {
      const ctx = contextOf(command);
      const steps = Number(opts.steps);
      const rounds = Number(opts.rounds);
      const report = await runBench(
        ctx,
        'qos',
        5 * rounds * Math.ceil(steps / rounds),
        (onProgress) =>
          benchQos({
            steps,
            rounds,
            stepMs: Number(opts.stepMs),
            onProgress,
            ...(ctx.signal ? { signal: ctx.signal } : {}),
          }),
      );
      if (!report) return;
      const r = report.results;
      ctx.out(
        `alone: p50 ${r.alone.p50Ms.toFixed(2)} ms, p99 ${r.alone.p99Ms.toFixed(2)} ms (${report.stepIterations} iterations a step)`,
      );
      for (const mode of ['withClasses', 'withoutClasses'] as const) {
        for (const load of ['be25', 'be50'] as const) {
          const s = r[mode][load];
          ctx.out(
            `${mode.padEnd(15)} ${load}  p99 ${s.p99Ms.toFixed(2).padStart(8)} ms  inflation ${s.p99InflationPercent.toFixed(1).padStart(6)} %   (p50 ${s.p50InflationPercent.toFixed(1)} %)`,
          );
        }
      }
    });
  bench
    .command('bounds')
    .description(
      "a steady client's exec p50/p99 quiet and beside a flood at each per-caller bound: bogus keys, idle connections, unread streams, junk requests (docs/security.md)",
    )
    .option('--execs <n>', 'measured execs of the steady client per phase', '300')
    .option(
      '--floods <list>',
      `comma-separated, of ${FLOOD_KINDS.join(', ')}`,
      FLOOD_KINDS.join(','),
    )
    .option('--idle-connections <n>', 'connections the idle flood holds (three addresses)', '12000')
    .option(
      '--idle-reconnect-ms <n>',
      'the idle flood reopens a connection the server closed after this long (0: never)',
      '0',
    )
    .option('--unread-streams <n>', 'command streams the unread flood holds, never read', '150')
    .option('--concurrency <n>', 'requests in flight of the bogus-keys and junk floods', '64')
    .option(
      '--rate <n>',
      'requests per second of the bogus-keys and junk floods (0: as fast as they go)',
      '250',
    )
    .action(
      async (
        opts: {
          execs: string;
          floods: string;
          idleConnections: string;
          idleReconnectMs: string;
          unreadStreams: string;
          concurrency: string;
          rate: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const floods = opts.floods.split(',').map((f) => f.trim()) as FloodKind[];
        for (const f of floods) {
          if (!FLOOD_KINDS.includes(f))
            throw new DsecError('invalid_argument', `unknown flood ${f}`, { field: 'floods' });
        }
        const execs = Number(opts.execs);
        const report = await runBench(ctx, 'bounds', floods.length * 2 * execs, (onProgress) =>
          benchBounds({
            execs,
            floods,
            idleConnections: Number(opts.idleConnections),
            idleReconnectMs: Number(opts.idleReconnectMs),
            unreadStreams: Number(opts.unreadStreams),
            concurrency: Number(opts.concurrency),
            ratePerSecond: Number(opts.rate),
            onProgress,
            ...(ctx.signal ? { signal: ctx.signal } : {}),
          }),
        );
        if (!report) return;
        for (const [kind, r] of Object.entries(report.results)) {
          ctx.out(
            `${kind.padEnd(11)} quiet p50 ${r.quiet.p50Ms.toFixed(1)} p99 ${r.quiet.p99Ms.toFixed(1)} ms | flood p50 ${r.flood.p50Ms.toFixed(1)} p99 ${r.flood.p99Ms.toFixed(1)} ms | p99 x${r.p99Ratio} | failures ${r.failures} | attacker ${r.attacker.requests} requests ${JSON.stringify(r.attacker.statuses)}, ${r.attacker.closedByServer} closed by the server | node rss ${r.node.rssMbBefore}→${r.node.rssMbPeak} MiB, audit rows +${r.node.auditRows}`,
          );
        }
      },
    );
  bench
    .command('layers')
    .description(
      'N sandboxes sharing a workspace + toolkit: EROFS layers vs per-sandbox tar.gz extraction',
    )
    .option('--count <n>', 'sandboxes per system', '64')
    .option('--workspace-mb <n>', 'size of the synthetic workspace', '40')
    .option('--concurrency <n>', 'sandboxes created at a time (both systems)', '8')
    .action(
      async (
        opts: { count: string; workspaceMb: string; concurrency: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const count = Number(opts.count);
        const report = await runBench(ctx, 'layers', 2 * count, (onProgress) =>
          benchLayers({
            count,
            workspaceMb: Number(opts.workspaceMb),
            concurrency: Number(opts.concurrency),
            onProgress,
            signal: ctx.signal,
          }),
        );
        if (!report) return;
        for (const [name, s] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(6)} ${(s.bytesWritten / 2 ** 20).toFixed(1).padStart(9)} MiB written   ${(s.timeToReadyMs / 1000).toFixed(2).padStart(7)} s to ready`,
          );
        }
        ctx.out(`ratios (dsec ÷ tar): ${JSON.stringify(report.ratios)}`);
      },
    );
  bench
    .command('placement')
    .description(
      'the real placers over a simulated fleet: a burst split over several instances with lagging views; imbalance and decisions/s per strategy',
    )
    .option('--nodes <n>', 'simulated edges', '160')
    .option('--requests <n>', 'requests in the burst', '32000')
    .option('--instances <n>', 'placement instances the burst is split over', '4')
    .option('--burst-ms <n>', 'simulated time over which the burst arrives', '6400')
    .option('--view-interval-ms <n>', "how often each instance's view is refreshed", '2000')
    .option('--seed <n>', 'workload and placer seed', '1')
    .action(
      async (
        opts: {
          nodes: string;
          requests: string;
          instances: string;
          burstMs: string;
          viewIntervalMs: string;
          seed: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const total = PLACEMENT_STRATEGIES.length * Number(opts.requests);
        const report = await runBench(ctx, 'placement', total, (onProgress) =>
          benchPlacement({
            nodes: Number(opts.nodes),
            requests: Number(opts.requests),
            instances: Number(opts.instances),
            burstMs: Number(opts.burstMs),
            viewIntervalMs: Number(opts.viewIntervalMs),
            seed: Number(opts.seed),
            onProgress,
            signal: ctx.signal,
          }),
        );
        if (!report) return;
        const v = report.view;
        ctx.out(
          `${report.workload.requests} requests over ${report.fleet.nodes} edges, ${report.workload.instances} instances; each view refreshed every ${v.intervalMs} ms (~${v.decisionsPerRefresh} decisions fleet-wide between refreshes, ${v.ownDecisionsPerRefresh} of them the instance's own)`,
        );
        for (const [name, r] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(22)} imbalance ${r.imbalance.toFixed(3).padStart(6)}   ${String(r.decisionsPerSecond).padStart(9)} decisions/s   refusals ${r.refusals}   failures ${r.failures}`,
          );
        }
        ctx.out(
          `targets (powerOfKOverlay): imbalance <= ${report.targets.imbalance}, >= ${report.targets.decisionsPerSecond} decisions/s: ${report.targets.met ? 'met' : 'not met'}`,
        );
      },
    );
  bench
    .command('fork')
    .description(
      'fork K sandboxes from one with a large writable layer: snapshot once + K creates vs copying the upper directory K times',
    )
    .option('--count <n>', 'sandboxes forked', '16')
    .option('--writable-mb <n>', "MiB in the source sandbox's writable layer", '200')
    .action(async (opts: { count: string; writableMb: string }, command: Command) => {
      const ctx = contextOf(command);
      const report = await runBench(ctx, 'fork', 3, (onProgress) =>
        benchFork({
          count: Number(opts.count),
          writableMb: Number(opts.writableMb),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      const { dsec, copy } = report.results;
      ctx.out(
        `dsec  ${(dsec.bytesWritten / 2 ** 20).toFixed(1).padStart(8)} MiB written   snapshot ${dsec.snapshotMs.toFixed(0)} ms (frozen ${dsec.freezeMs.toFixed(0)} ms) + ${report.count} creates ${dsec.createMs.toFixed(0)} ms`,
      );
      ctx.out(
        `copy  ${(copy.bytesWritten / 2 ** 20).toFixed(1).padStart(8)} MiB written   ${report.count} copies ${copy.copyMs.toFixed(0)} ms`,
      );
      ctx.out(`ratios (copy ÷ dsec): ${JSON.stringify(report.ratios)}`);
    });
  bench
    .command('snapshot')
    .description(
      "freeze time and snapshot time of a sandbox's writable layer vs freeze + `tar` of the upper directory into a layer",
    )
    .option('--iterations <n>', 'snapshots per system', '5')
    .option('--writable-mb <n>', "MiB in the sandbox's writable layer", '200')
    .action(async (opts: { iterations: string; writableMb: string }, command: Command) => {
      const ctx = contextOf(command);
      const iterations = Number(opts.iterations);
      const report = await runBench(ctx, 'snapshot', iterations, (onProgress) =>
        benchSnapshot({
          iterations,
          writableMb: Number(opts.writableMb),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      for (const [name, s] of Object.entries(report.results)) {
        ctx.out(
          `${name.padEnd(5)} frozen p50 ${s.freezeMs.p50Ms.toFixed(0).padStart(6)} ms   snapshot p50 ${s.snapshotMs.p50Ms.toFixed(0).padStart(6)} ms   layer ${(s.layerBytes / 2 ** 20).toFixed(1)} MiB`,
        );
      }
      ctx.out(`ratios (dsec ÷ tar): ${JSON.stringify(report.ratios)}`);
    });
  bench
    .command('pause')
    .description(
      'a sandbox holding touched memory: bytes charged running vs paused, and resume + first exec, vs `runc pause`/`resume`',
    )
    .option('--iterations <n>', 'measured cycles per system', '10')
    .option('--warmup <n>', 'unmeasured cycles first', '1')
    .option('--hold-mib <n>', 'touched memory the sandbox holds', '256')
    .action(
      async (opts: { iterations: string; warmup: string; holdMib: string }, command: Command) => {
        const ctx = contextOf(command);
        const report = await runBench(
          ctx,
          'pause',
          Number(opts.iterations) + Number(opts.warmup),
          (onProgress) =>
            benchPause({
              iterations: Number(opts.iterations),
              warmup: Number(opts.warmup),
              holdMib: Number(opts.holdMib),
              onProgress,
              signal: ctx.signal,
            }),
        );
        if (!report) return;
        for (const [name, s] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(5)} running ${(s.runningBytes / 2 ** 20).toFixed(1).padStart(7)} MiB   paused ${(s.pausedBytes / 2 ** 20).toFixed(1).padStart(7)} MiB (${(s.pausedRatio * 100).toFixed(1)} %)   resume + exec p50 ${s.resumeExecP50Ms.toFixed(1)} ms p99 ${s.resumeExec.p99Ms.toFixed(1)} ms   pause p50 ${s.pause.p50Ms.toFixed(0)} ms`,
          );
        }
        const t = report.targets;
        ctx.out(
          `targets: paused <= ${t.pausedRatio * 100} % of running, resume + exec p50 <= ${t.resumeExecP50Ms} ms: ${t.met ? 'met' : 'not met'}`,
        );
      },
    );
  bench
    .command('ondemand')
    .description('a task reading ~10 % of a large image: on-demand data blob vs eager full pull')
    .option('--image-mb <n>', 'size of the large image', '320')
    .option('--bandwidth-mibps <n>', 'store bandwidth', '100')
    .action(async (opts: { imageMb: string; bandwidthMibps: string }, command: Command) => {
      const ctx = contextOf(command);
      const report = await runBench(ctx, 'ondemand', 6, (onProgress) =>
        benchOndemand({
          imageMb: Number(opts.imageMb),
          bandwidthMiBps: Number(opts.bandwidthMibps),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      for (const [name, s] of Object.entries(report.results)) {
        ctx.out(
          `${name.padEnd(6)} ${(s.bytesTransferred / 2 ** 20).toFixed(1).padStart(8)} MiB from the store   first exec ${(s.timeToFirstExecMs / 1000).toFixed(2)} s   task done ${(s.timeToTaskDoneMs / 1000).toFixed(2)} s`,
        );
      }
      ctx.out(`ratios (dsec ÷ eager): ${JSON.stringify(report.ratios)}`);
    });
  registerEvalBench(bench);
  registerEnvsBench(bench);
  registerFnCallBench(bench);
  registerSandboxFusionBench(bench);
  registerFuzzBench(bench);
  registerRegistryBench(bench);
  registerBuildBench(bench);
  registerMicrovmBench(bench);
}

/**
 * Runs one benchmark with a progress bar. With `--json` it prints the report
 * and returns undefined; otherwise it returns the report for the caller's table.
 */
async function runBench<R>(
  ctx: CliContext,
  name: string,
  total: number,
  run: (onProgress: (done: number) => void) => Promise<R>,
): Promise<R | undefined> {
  const progress = createProgress({ label: `bench ${name}`, total, enabled: !ctx.json });
  const report = await run((done) => progress.update(done));
  progress.done();
  if (!ctx.json) return report;
  ctx.out(JSON.stringify(report, null, 2));
  return undefined;
}

function printLatencies(
  ctx: CliContext,
  report: {
    cycle: string;
    iterations: number;
    results: Record<string, LatencySummary>;
    ratios: unknown;
  },
): void {
  ctx.out(`${report.cycle}, ${report.iterations} iterations`);
  const width = Math.max(...Object.keys(report.results).map((n) => n.length)) + 2;
  for (const [name, s] of Object.entries(report.results)) {
    ctx.out(
      `${name.padEnd(width)} p50 ${s.p50Ms.toFixed(2).padStart(8)} ms   p99 ${s.p99Ms.toFixed(2).padStart(8)} ms`,
    );
  }
  ctx.out(`ratios (dsec ÷ peer, p50): ${JSON.stringify(report.ratios)}`);
}

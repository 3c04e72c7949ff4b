import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { cpus, tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { startSingleNode } from '@dsec/cluster';
import type { QosClass } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { describeMachine } from './create.js';
import { removeCgroupParent } from './host-leftovers.js';
import { summarize, type LatencySummary } from './stats.js';

export interface QosBenchOptions {
  /** Measured steps per configuration (spread over `rounds`). Default 600. */
  steps: number;
  /** Each configuration runs this many times, interleaved with the others. Default 6. */
  rounds: number;
  /** CPU time of one step alone, in ms (calibrated at start). Default 10. */
  stepMs: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface QosInflation extends LatencySummary {
  /** p99 step latency over the p99 of the steps alone, minus one, in percent. */
  p99InflationPercent: number;
  p50InflationPercent: number;
}

export interface QosBenchReport {
  benchmark: 'qos';
  cores: number;
  stepIterations: number;
  results: {
    alone: LatencySummary;
    withClasses: { be25: QosInflation; be50: QosInflation };
    withoutClasses: { be25: QosInflation; be50: QosInflation };
  };
  method: string;
  machine: Record<string, unknown>;
}

type Config = { name: string; mode?: 'withClasses' | 'withoutClasses'; loadSandboxes: number };

/**
 * Per-step latency of a latency-sensitive sandbox (each step: one command
 * through the SDK running `stepMs` of shell arithmetic), alone and beside
 * best-effort load of 25 % and 50 % of the node's cores, with the QoS classes
 * (the load's sandboxes `best-effort`) and without (all `latency-sensitive`).
 *
 * The load: sandboxes with a CPU quota of 25 % of the node each, each running
 * one busy loop per core, so the load is spread over every core the step
 * might run on. Configurations are interleaved round by round, so drift in
 * other load on the host touches them alike.
 */
export async function benchQos(options: QosBenchOptions): Promise<QosBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-qos-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-qos-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => rm(work, { recursive: true, force: true }),
    () => removeCgroupParent(cgroupParent),
  ];
  try {
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      cgroupParent,
      network: { mode: 'none' },
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfsDir } });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());

    const cores = cpus().length;
    const make = (qosClass: QosClass, cpuCoresLimit: number) =>
      client.runContainer({ image: 'busybox', memoryLimitMb: 128, cpuCoresLimit, qosClass });
    const ls = await make('latency-sensitive', 1);
    // Two sandboxes of load per mode, 25 % of the node each: one for be25, both for be50.
    const load = {
      withClasses: [await make('best-effort', cores / 4), await make('best-effort', cores / 4)],
      withoutClasses: [
        await make('latency-sensitive', cores / 4),
        await make('latency-sensitive', cores / 4),
      ],
    };

    const stepLine = (n: number) => `i=0; while [ $i -lt ${n} ]; do i=$((i+1)); done`;
    const timeStep = async (line: string) => {
      const t0 = performance.now();
      const r = await ls.runShell(line);
      if (r.exitCode !== 0) throw new Error(`step exited ${r.exitCode}: ${r.stderr}`);
      return performance.now() - t0;
    };
    // Calibrate: iterations for `stepMs` of CPU, beyond the cost of an empty command.
    const median = async (line: string) => {
      const xs: number[] = [];
      for (let i = 0; i < 15; i++) xs.push(await timeStep(line));
      return xs.sort((a, b) => a - b)[7]!;
    };
    const empty = await median('true');
    const probe = 20_000;
    const perIteration = Math.max(1e-6, ((await median(stepLine(probe))) - empty) / probe);
    const stepIterations = Math.max(100, Math.round(options.stepMs / perIteration));
    const step = stepLine(stepIterations);

    const configs: Config[] = [
      { name: 'alone', loadSandboxes: 0 },
      { name: 'be25', mode: 'withClasses', loadSandboxes: 1 },
      { name: 'be25', mode: 'withoutClasses', loadSandboxes: 1 },
      { name: 'be50', mode: 'withClasses', loadSandboxes: 2 },
      { name: 'be50', mode: 'withoutClasses', loadSandboxes: 2 },
    ];
    const samples = new Map<Config, number[]>(configs.map((c) => [c, []]));
    const perRound = Math.ceil(options.steps / options.rounds);
    const total = configs.length * options.rounds * perRound;
    let done = 0;
    for (let round = 0; round < options.rounds; round++) {
      // Rotate the order so no configuration always follows the same one.
      for (let k = 0; k < configs.length; k++) {
        const config = configs[(round + k) % configs.length]!;
        const busy = config.mode ? load[config.mode].slice(0, config.loadSandboxes) : [];
        const loops = await Promise.all(busy.map((sb) => startLoad(sb, cores)));
        await sleep(300); // the loops are running and have used up their first quota period
        for (let i = 0; i < perRound; i++) {
          if (options.signal?.aborted) throw new Error('benchmark aborted');
          samples.get(config)!.push(await timeStep(step));
          options.onProgress?.(++done, total);
        }
        await Promise.all(loops.map((stop) => stop()));
      }
    }

    const alone = summarize(samples.get(configs[0]!)!);
    const inflation = (config: Config): QosInflation => {
      const s = summarize(samples.get(config)!);
      const pct = (x: number, base: number) => Math.round((x / base - 1) * 1000) / 10;
      return {
        ...s,
        p99InflationPercent: pct(s.p99Ms, alone.p99Ms),
        p50InflationPercent: pct(s.p50Ms, alone.p50Ms),
      };
    };
    return {
      benchmark: 'qos',
      cores,
      stepIterations,
      results: {
        alone,
        withClasses: { be25: inflation(configs[1]!), be50: inflation(configs[3]!) },
        withoutClasses: { be25: inflation(configs[2]!), be50: inflation(configs[4]!) },
      },
      method:
        `A step is one command through the SDK running ${stepIterations} iterations of shell arithmetic ` +
        `(about ${options.stepMs} ms of CPU alone) in a latency-sensitive sandbox with 1 CPU. ` +
        'Best-effort load: sandboxes with a CPU quota of 25 % of the node each, each running one busy loop per core; ' +
        'be25 runs one such sandbox, be50 two. withClasses: the load sandboxes are best-effort; withoutClasses: latency-sensitive. ' +
        `Inflation: p99 (and p50) over the steps alone. ${options.rounds} interleaved rounds.`,
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/**
 * Starts `threads` busy loops in a sandbox; the returned function stops them
 * (a marker file they test for) and waits for the command to end.
 */
async function startLoad(sb: Sandbox, threads: number): Promise<() => Promise<void>> {
  await sb.runShell('rm -f /tmp/stop');
  const loop = 'while [ ! -e /tmp/stop ]; do :; done';
  const running = sb.runShell(`for t in $(seq ${threads}); do (${loop}) & done; wait`, {
    timeoutMs: 600_000,
  });
  return async () => {
    await sb.runShell('touch /tmp/stop');
    await running;
  };
}

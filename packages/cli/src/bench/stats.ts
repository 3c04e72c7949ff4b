/** Latency samples → the summary every benchmark reports. */
export interface LatencySummary {
  n: number;
  p50Ms: number;
  p99Ms: number;
  meanMs: number;
  minMs: number;
  maxMs: number;
}

export function summarize(samplesMs: number[]): LatencySummary {
  const s = [...samplesMs].sort((a, b) => a - b);
  const at = (q: number) =>
    s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))] ?? NaN;
  const round = (x: number) => Math.round(x * 1000) / 1000;
  return {
    n: s.length,
    p50Ms: round(at(0.5)),
    p99Ms: round(at(0.99)),
    meanMs: round(s.reduce((a, b) => a + b, 0) / (s.length || 1)),
    minMs: round(s[0] ?? NaN),
    maxMs: round(s.at(-1) ?? NaN),
  };
}

/** ours ÷ peer on p50 (below 1 means ours is faster). */
export function ratio(ours: LatencySummary, peer: LatencySummary | undefined): number | null {
  if (!peer || !peer.p50Ms) return null;
  return Math.round((ours.p50Ms / peer.p50Ms) * 1000) / 1000;
}

/**
 * Times every system in turns, rotating which goes first so none always runs
 * with warm (or cold) caches, and summarizes the calls after `warmup`. A turn
 * is `block` consecutive calls of one system (default 1): a call right after
 * another system's pays for what that one did to the caches and for waking
 * CPUs it left idle, so "warm" latencies are measured in blocks, where each
 * system follows itself as back-to-back calls do, and machine noise still
 * spreads over all systems by turns. A system that times itself (a peer run
 * from another process) returns its own milliseconds.
 */
export async function interleave(
  systems: Record<string, (round: number) => Promise<void | number>>,
  options: {
    iterations: number;
    warmup: number;
    block?: number | undefined;
    signal?: AbortSignal | undefined;
    onProgress?: ((done: number, total: number) => void) | undefined;
  },
): Promise<Record<string, LatencySummary>> {
  const names = Object.keys(systems);
  const samples: Record<string, number[]> = Object.fromEntries(names.map((n) => [n, []]));
  const block = Math.max(1, Math.floor(options.block ?? 1));
  const total = options.warmup + options.iterations;
  for (let done = 0, round = 0; done < total; round++) {
    if (options.signal?.aborted) throw new Error('benchmark aborted');
    const calls = Math.min(block, total - done);
    for (let k = 0; k < names.length; k++) {
      const name = names[(round + k) % names.length]!;
      for (let c = 0; c < calls; c++) {
        const t0 = process.hrtime.bigint();
        const own = await systems[name]!(done + c);
        const ms = own ?? Number(process.hrtime.bigint() - t0) / 1e6;
        if (done + c >= options.warmup) samples[name]!.push(ms);
      }
    }
    done += calls;
    options.onProgress?.(done, total);
  }
  return Object.fromEntries(names.map((n) => [n, summarize(samples[n]!)]));
}

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
 * Times every system once per round, rotating which goes first so none always
 * runs with warm (or cold) caches, and summarizes the rounds after `warmup`.
 */
export async function interleave(
  systems: Record<string, (round: number) => Promise<void>>,
  options: {
    iterations: number;
    warmup: number;
    signal?: AbortSignal | undefined;
    onProgress?: ((done: number, total: number) => void) | undefined;
  },
): Promise<Record<string, LatencySummary>> {
  const names = Object.keys(systems);
  const samples: Record<string, number[]> = Object.fromEntries(names.map((n) => [n, []]));
  const total = options.warmup + options.iterations;
  for (let i = 0; i < total; i++) {
    if (options.signal?.aborted) throw new Error('benchmark aborted');
    for (let k = 0; k < names.length; k++) {
      const name = names[(i + k) % names.length]!;
      const t0 = process.hrtime.bigint();
      await systems[name]!(i);
      const ms = Number(process.hrtime.bigint() - t0) / 1e6;
      if (i >= options.warmup) samples[name]!.push(ms);
    }
    options.onProgress?.(i + 1, total);
  }
  return Object.fromEntries(names.map((n) => [n, summarize(samples[n]!)]));
}

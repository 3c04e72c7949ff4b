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

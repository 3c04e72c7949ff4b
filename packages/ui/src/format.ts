/** Display helpers (pure, shared by the pages). */

export function bytes(n: number | undefined): string {
  if (n === undefined || !Number.isFinite(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v >= 10 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

/** "3 min ago" / "in 2 h" relative to `nowMs`. */
export function relative(iso: string | undefined, nowMs: number): string {
  if (!iso) return '–';
  const d = (Date.parse(iso) - nowMs) / 1000;
  const a = Math.abs(d);
  const s =
    a < 60
      ? `${Math.round(a)} s`
      : a < 3600
        ? `${Math.round(a / 60)} min`
        : a < 86400
          ? `${Math.round(a / 3600)} h`
          : `${Math.round(a / 86400)} d`;
  return d < 0 ? `${s} ago` : `in ${s}`;
}

export function percent(used: number, total: number): number {
  return total > 0 ? Math.min(100, Math.round((used / total) * 100)) : 0;
}

/** `a=1, b=2` → `{ a: '1', b: '2' }`; pieces without `=` are skipped. */
export function parseLabels(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const part of text.split(',')) {
    const i = part.indexOf('=');
    if (i <= 0) continue;
    out[part.slice(0, i).trim()] = part.slice(i + 1).trim();
  }
  return out;
}

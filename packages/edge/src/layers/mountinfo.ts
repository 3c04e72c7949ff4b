import { readFile } from 'node:fs/promises';

/** Mount points visible to this process, with their filesystem types (from /proc/self/mountinfo). */
export async function mountTypes(): Promise<Map<string, string>> {
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  const mounts = new Map<string, string>();
  for (const line of text.split('\n')) {
    const fields = line.split(' ');
    const point = fields[4];
    if (!point) continue;
    const dash = fields.indexOf('-', 6);
    mounts.set(
      point.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8))),
      dash > 0 ? (fields[dash + 1] ?? '') : '',
    );
  }
  return mounts;
}

/** Mount points currently visible to this process. */
export async function mountPoints(): Promise<Set<string>> {
  return new Set((await mountTypes()).keys());
}

import { readFile } from 'node:fs/promises';

/** Mount points currently visible to this process (decoded from /proc/self/mountinfo). */
export async function mountPoints(): Promise<Set<string>> {
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  const points = new Set<string>();
  for (const line of text.split('\n')) {
    const field = line.split(' ')[4];
    if (field)
      points.add(
        field.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8))),
      );
  }
  return points;
}

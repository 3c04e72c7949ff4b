import { InvalidArgumentError } from 'commander';

/** commander argParsers; a bad value becomes a usage error naming the option. */

export function parseInteger(value: string): number {
  if (!/^-?\d+$/.test(value.trim())) throw new InvalidArgumentError('expected an integer');
  return Number(value);
}

export function parseNumber(value: string): number {
  const n = Number(value);
  if (value.trim() === '' || !Number.isFinite(n))
    throw new InvalidArgumentError('expected a number');
  return n;
}

/** Repeatable `--x A --x B`. */
export function collect(value: string, previous: string[] = []): string[] {
  return [...previous, value];
}

/** Repeatable `--env K=V`; the value may itself contain `=`. */
export function collectKeyValue(
  value: string,
  previous: Record<string, string> = {},
): Record<string, string> {
  const i = value.indexOf('=');
  if (i <= 0) throw new InvalidArgumentError(`expected KEY=VALUE, got ${JSON.stringify(value)}`);
  return { ...previous, [value.slice(0, i)]: value.slice(i + 1) };
}

export function parseRole(value: string): 'admin' | 'member' {
  if (value !== 'admin' && value !== 'member')
    throw new InvalidArgumentError('expected admin or member');
  return value;
}

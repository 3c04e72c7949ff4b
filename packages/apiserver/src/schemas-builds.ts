import { z } from 'zod';
import { parseLayerRef } from '@dsec/core';

/**
 * Request schemas of the build routes (`POST /v1/images/builds`, issue 26):
 * the same rules as `schemas.ts` (strict, bounded, no NUL bytes). The
 * context travels as the body (a tar archive); everything else is in the
 * query.
 */

const noNul = (s: string) => !s.includes('\0');
/** `K=V` (a query may repeat `buildArg`). */
const buildArg = z
  .string()
  .max(64 * 1024)
  .refine(noNul, 'must not contain NUL bytes')
  .refine((s) => /^[A-Za-z_][A-Za-z0-9_]{0,127}=/.test(s), 'must be NAME=VALUE');

export const BuildQuery = z
  .object({
    name: z
      .string()
      .max(300)
      .refine(
        (s) => parseLayerRef(s) !== undefined,
        'must be an image name `name` or `name:version`',
      ),
    dockerfile: z.string().min(1).max(4096).refine(noNul, 'must not contain NUL bytes').optional(),
    buildArg: z.union([buildArg, z.array(buildArg).max(256)]).optional(),
    target: z
      .string()
      .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/, 'must be a stage name')
      .optional(),
    timeout: z
      .string()
      .regex(/^[0-9]{1,6}$/, 'must be whole seconds')
      .transform(Number)
      .optional(),
  })
  .strict();

export const BuildParams = z
  .object({
    id: z
      .string()
      .min(1)
      .max(128)
      .regex(/^[A-Za-z0-9_-]+$/, 'must be a build ID'),
  })
  .strict();

/** `buildArg` values as a record (the last of a repeated name wins, as buildah's flags). */
export function buildArgsOf(value: string | string[] | undefined): Record<string, string> {
  const out: Record<string, string> = {};
  for (const a of value === undefined ? [] : Array.isArray(value) ? value : [value]) {
    const eq = a.indexOf('=');
    out[a.slice(0, eq)] = a.slice(eq + 1);
  }
  return out;
}

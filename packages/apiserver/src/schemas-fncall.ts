import { z } from 'zod';
import type { FnCallRequest } from '@dsec/core';

/**
 * Request schemas of the FnCall routes (issue 14): `POST /v1/fncall` and
 * `POST /v1/fncall/batch`. As in `schemas.ts`, objects are strict and strings
 * bounded; argv, env and paths may not carry NUL bytes. Defaults (timeout,
 * memory, output cap) are the edge's: a field left out stays out, so the
 * runtime's own setting applies.
 */

const KIB = 1024;
const MIB = 1024 * KIB;

const noNul = (s: string) => !s.includes('\0');
const text = (max: number) => z.string().max(max).refine(noNul, 'must not contain NUL bytes');
const int = (min: number, max: number) => z.number().int().min(min).max(max);
const boundedRecord = <T extends z.ZodTypeAny>(key: z.ZodString, value: T, maxEntries: number) =>
  z
    .record(key, value)
    .refine((r) => Object.keys(r).length <= maxEntries, `at most ${maxEntries} entries`);

/** A relative path below the call's working directory: no leading `/`, no `.`, `..` or empty parts. */
const isRelativePath = (p: string) =>
  p.length > 0 &&
  p.length <= 1024 &&
  noNul(p) &&
  p.split('/').every((part) => part !== '..' && part !== '.' && part !== '');

/** The most calls one batch may carry, and the most it runs at once. */
export const MAX_BATCH_CALLS = 10_000;
export const MAX_BATCH_CONCURRENCY = 256;
export const DEFAULT_BATCH_CONCURRENCY = 16;

export const FnCallBody = z
  .object({
    language: z
      .string()
      .regex(/^[a-z0-9][a-z0-9._-]{0,63}$/, 'must be a runtime name (`python`, `node`, `bash`)'),
    code: z.string().max(MIB),
    stdin: z.string().max(MIB).optional(),
    files: boundedRecord(z.string(), z.string().max(MIB), 256)
      .superRefine((files, ctx) => {
        const bad = Object.keys(files).find((p) => !isRelativePath(p));
        if (bad !== undefined) {
          ctx.addIssue({
            code: z.ZodIssueCode.custom,
            path: [bad],
            message: 'must be a relative path without `.`, `..` or empty parts',
          });
        }
      })
      .optional(),
    args: z
      .array(text(128 * KIB))
      .max(4096)
      .optional(),
    env: boundedRecord(
      z.string().regex(/^[A-Za-z_][A-Za-z0-9_]{0,255}$/, 'must be an environment variable name'),
      text(32 * KIB),
      256,
    ).optional(),
    timeoutMs: int(1, 300_000).optional(),
    memoryMb: int(16, 1_048_576).optional(),
    network: z.boolean().optional(),
    maxOutputBytes: int(1, 67_108_864).optional(),
    gpu: z
      .object({
        mode: z.enum(['shared', 'exclusive']),
        count: int(1, 64).optional(),
        model: z
          .string()
          .regex(/^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$/, 'must be a GPU model or MIG profile')
          .optional(),
      })
      .strict()
      .optional(),
    edgeSelector: boundedRecord(
      z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$/, 'must be a label key'),
      z.string().regex(/^[A-Za-z0-9._:/-]{0,63}$/, 'must be a label value'),
      16,
    ).optional(),
  })
  .strict();

export const FnCallBatchBody = z
  .object({
    calls: z.array(FnCallBody).min(1).max(MAX_BATCH_CALLS),
    /** Calls in flight at once; results stream back in completion order. */
    concurrency: int(1, MAX_BATCH_CONCURRENCY).default(DEFAULT_BATCH_CONCURRENCY),
  })
  .strict();

// The parsed body is exactly a `FnCallRequest` (a field added to one and not the other fails here).
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
type Check<T extends true> = T;
export type FnCallBodyMatchesRequest = Check<Same<z.infer<typeof FnCallBody>, FnCallRequest>>;

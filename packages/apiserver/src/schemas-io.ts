import { z } from 'zod';
import { DEFAULT_COMMAND_TIMEOUT_MS, parseLayerRef } from '@dsec/core';
import { requestIdString, userName } from './schemas.js';

/**
 * Request schemas of the in-sandbox routes (commands by ID, sessions, files,
 * ports, terminals; issue 4). Same rules as `schemas.ts`: strict objects,
 * bounded strings, no NUL bytes.
 */

const KIB = 1024;
const MIB = 1024 * KIB;
const noNul = (s: string) => !s.includes('\0');
const text = (max: number) => z.string().max(max).refine(noNul, 'must not contain NUL bytes');
const int = (min: number, max: number) => z.number().int().min(min).max(max);
/** Query strings carry numbers as text. */
const intText = (min: number, max: number) =>
  z
    .string()
    .regex(/^[0-9]{1,10}$/, 'must be a non-negative integer')
    .transform(Number)
    .pipe(int(min, max));
const flagText = z.enum(['1', '0', 'true', 'false']).transform((v) => v === '1' || v === 'true');
const path = text(4096).refine((s) => s.length > 0, 'must not be empty');
const mode = int(0, 0o7777);
const envMap = z
  .record(
    z.string().regex(/^[A-Za-z_][A-Za-z0-9_]{0,255}$/, 'must be an environment variable name'),
    text(32 * KIB),
  )
  .refine((r) => Object.keys(r).length <= 256, 'at most 256 entries');

export const CommandParams = z
  .object({ id: z.string().max(256), cid: z.string().min(1).max(128) })
  .strict();
export const SessionParams = z
  .object({
    id: z.string().max(256),
    name: z.string().regex(/^[A-Za-z0-9._-]{1,64}$/, 'must be 1–64 chars of [A-Za-z0-9._-]'),
  })
  .strict();
export const PortParams = z
  .object({
    id: z.string().max(256),
    port: intText(1, 65535),
    '*': z.string().max(8192).optional(),
  })
  .strict();

export const WaitQuery = z.object({ timeoutMs: intText(0, 86_400_000).optional() }).strict();
export const StdinQuery = z.object({ eof: flagText.optional() }).strict();
/** A project named in a query (IAM decides whether the caller sees it). */
const projectIdText = z
  .string()
  .min(1)
  .max(128)
  .regex(/^[A-Za-z0-9._:-]+$/, 'must be an ID');
/**
 * `?all=true`: also the per-OCI-layer records registry imports keep (`oci-diff:*`);
 * `?projectId=`: the layers that project sees (default: the key's own project).
 */
export const ListImagesQuery = z
  .object({ all: flagText.optional(), projectId: projectIdText.optional() })
  .strict();
/** `DELETE /v1/images/:ref`: a layer of the key's project, or of `?projectId=` (a descendant). */
export const ImageParams = z
  .object({
    ref: z
      .string()
      .max(300)
      .refine(
        (s) => parseLayerRef(s) !== undefined,
        'must be a layer reference `name` or `name:version`',
      ),
  })
  .strict();
export const ImageQuery = z.object({ projectId: projectIdText.optional() }).strict();
export const SignalBody = z
  .object({
    signal: z.union([
      z.string().regex(/^(?:SIG)?[A-Z0-9]{1,10}$/, 'must be a signal name'),
      int(1, 64),
    ]),
  })
  .strict();

export const SessionRunBody = z
  .object({
    line: text(MIB),
    stdin: z.string().max(MIB).optional(),
    timeoutMs: int(1, 86_400_000).default(DEFAULT_COMMAND_TIMEOUT_MS),
    maxOutputBytes: int(0, 67_108_864).default(1_048_576),
    requestId: requestIdString.optional(),
    shell: path.optional(),
    user: userName.optional(),
    env: envMap.optional(),
    cwd: path.optional(),
  })
  .strict();

export const PathQuery = z.object({ path, user: userName.optional() }).strict();
export const WriteQuery = z
  .object({
    path,
    user: userName.optional(),
    mode: z
      .string()
      .regex(/^0?[0-7]{1,4}$/, 'must be octal, e.g. 644')
      .transform((m) => parseInt(m, 8))
      .optional(),
  })
  .strict();
export const MkdirBody = z
  .object({
    path,
    parents: z.boolean().optional(),
    mode: mode.optional(),
    user: userName.optional(),
  })
  .strict();
export const RemoveBody = z
  .object({ path, recursive: z.boolean().optional(), user: userName.optional() })
  .strict();
export const RenameBody = z
  .object({ from: path, to: path, overwrite: z.boolean().optional(), user: userName.optional() })
  .strict();

export const PtyQuery = z
  .object({
    rows: intText(1, 1000).optional(),
    cols: intText(1, 1000).optional(),
    shell: path.optional(),
    user: userName.optional(),
    term: z
      .string()
      .regex(/^[A-Za-z0-9._+-]{1,64}$/, 'must be a terminal name')
      .optional(),
  })
  .strict();

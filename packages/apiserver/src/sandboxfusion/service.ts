import { z } from 'zod';
import { DsecError, toDsecError } from '@dsec/core';
import type { FnCallRequest, FnCallResult } from '@dsec/core';
import type { Principal } from '@dsec/iam';
import { SANDBOXFUSION_DIRECT_DRIVER, SANDBOXFUSION_DRIVER } from './driver.js';
import {
  SANDBOXFUSION_LANGUAGES,
  SANDBOXFUSION_MISSING,
  type SandboxFusionLanguage,
} from './languages.js';

/**
 * SandboxFusion's `/run_code` on FnCall (docs/fncall.md "SandboxFusion-compatible
 * endpoint"): its request (`RunCodeRequest`, sandbox/server/sandbox_api.py at
 * bytedance/SandboxFusion@469de08) becomes one FnCall of the language's
 * runtime running `SANDBOXFUSION_DRIVER`, and the driver's answer becomes
 * SandboxFusion's `RunCodeResponse`, with `status` decided as its
 * `parse_run_status` decides it.
 */

/** The most seconds compile and run may take together (FnCall's 300 s, less the driver's own time). */
export const SANDBOXFUSION_MAX_TOTAL_SECONDS = 290;
/** Files a request may send, and their decoded bytes together. */
export const SANDBOXFUSION_MAX_FILES = 256;
export const SANDBOXFUSION_MAX_FILE_BYTES = 768 * 1024;
/** Captured bytes per stream of a step; fetched bytes of one answer. */
export const SANDBOXFUSION_STREAM_CAP = 2 * 1024 * 1024;
export const SANDBOXFUSION_FETCH_CAP = 3 * 1024 * 1024;
/** The FnCall output cap: four streams and the fetched files as base64, with room. */
const DRIVER_OUTPUT_BYTES = 16 * 1024 * 1024;
/** The driver's own time (writing files, starting, reading back) beyond the two timeouts. */
const DRIVER_SLACK_MS = 5_000;
/** The driver's time before a direct step's program starts (reading its task, writing files). */
const DIRECT_SLACK_MS = 250;
/** The smallest memory limit honoured (a smaller one could not start any runtime). */
const MIN_MEMORY_MB = 16;

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

/** A relative path below the work dir: no leading `/`, no `.`, `..` or empty parts, no NUL. */
function relativePath(p: string): boolean {
  return (
    p.length > 0 &&
    p.length <= 1024 &&
    !p.includes('\0') &&
    p.split('/').every((part) => part !== '' && part !== '.' && part !== '..' && part.length <= 255)
  );
}

const path = z
  .string()
  .refine(relativePath, 'must be a relative path without `.`, `..` or empty parts');

const seconds = z.number().finite().positive().max(SANDBOXFUSION_MAX_TOTAL_SECONDS);

/** SandboxFusion's `RunCodeRequest`; unknown fields are ignored, as pydantic does. */
export const RunCodeBody = z.object({
  compile_timeout: seconds.default(10),
  run_timeout: seconds.default(10),
  memory_limit_MB: z.number().int().default(-1),
  code: z.string(),
  stdin: z.string().nullable().optional(),
  language: z.string().max(64),
  files: z
    .record(z.string(), z.string().nullable())
    .default({})
    .superRefine((files, ctx) => {
      const names = Object.keys(files);
      if (names.length > SANDBOXFUSION_MAX_FILES)
        ctx.addIssue({
          code: z.ZodIssueCode.custom,
          message: `at most ${SANDBOXFUSION_MAX_FILES} files`,
        });
      for (const name of names) {
        if (!relativePath(name))
          ctx.addIssue({
            code: z.ZodIssueCode.custom,
            path: [name],
            message: 'must be a relative path without `.`, `..` or empty parts',
          });
        const v = files[name];
        if (typeof v === 'string' && (v.length % 4 !== 0 || !BASE64.test(v)))
          ctx.addIssue({ code: z.ZodIssueCode.custom, path: [name], message: 'must be base64' });
      }
    }),
  fetch_files: z.array(path).max(SANDBOXFUSION_MAX_FILES).default([]),
});
export type RunCodeRequest = z.infer<typeof RunCodeBody>;

export type CommandRunStatus = 'Finished' | 'Error' | 'TimeLimitExceeded';

/** SandboxFusion's `CommandRunResult`. */
export interface CommandRunResult {
  status: CommandRunStatus;
  execution_time: number | null;
  return_code: number | null;
  stdout: string | null;
  stderr: string | null;
}

/** SandboxFusion's `RunCodeResponse`. */
export interface RunCodeResponse {
  status: 'Success' | 'Failed' | 'SandboxError';
  message: string;
  compile_result: CommandRunResult | null;
  run_result: CommandRunResult | null;
  executor_pod_name: string | null;
  files: Record<string, string>;
}

/** What the driver prints (driver.ts). */
interface DriverStep {
  status: 'Finished' | 'TimeLimitExceeded';
  execution_time: number;
  return_code?: number;
  stdout: string;
  stderr: string;
  truncated: boolean;
}
interface DriverAnswer {
  compile: DriverStep | null;
  run: DriverStep | null;
  files: Record<string, string>;
  skipped: Record<string, string>;
}

/** What the driver reads on stdin. */
export interface SandboxFusionTask {
  direct: boolean;
  source: string;
  code: string;
  files: Record<string, string>;
  stdin: string | null;
  compile: SandboxFusionLanguage['compile'] | null;
  run: SandboxFusionLanguage['run'];
  compile_timeout: number;
  run_timeout: number;
  memory_mb: number;
  fetch_files: string[];
  caps: { stream: number; files: number };
}

export interface SandboxFusionDeps {
  /** Runs one FnCall for the caller (FnCallService.run: scope, quota, routing). */
  run(principal: Principal, req: FnCallRequest, signal?: AbortSignal): Promise<FnCallResult>;
  /** `executor_pod_name` of answers (SandboxFusion's MY_POD_NAME); default null. */
  executorName?: string | undefined;
}

/** Languages served, in the order of SandboxFusion's list (and `c`). */
export function sandboxFusionLanguages(): string[] {
  return Object.keys(SANDBOXFUSION_LANGUAGES);
}

/** The language's entry, or `invalid_argument` naming the ones served. */
export function sandboxFusionLanguage(name: string): SandboxFusionLanguage {
  const lang = Object.hasOwn(SANDBOXFUSION_LANGUAGES, name)
    ? SANDBOXFUSION_LANGUAGES[name]
    : undefined;
  if (lang) return lang;
  const why = Object.hasOwn(SANDBOXFUSION_MISSING, name) ? ` (${SANDBOXFUSION_MISSING[name]})` : '';
  throw new DsecError(
    'invalid_argument',
    `language ${JSON.stringify(name.slice(0, 64))} is not served${why}; served: ${sandboxFusionLanguages().join(', ')}`,
    { field: 'language' },
  );
}

/**
 * Turns a validated request into the FnCall that runs it (throws
 * `invalid_argument`). `direct`: one step and nothing to fetch, so the
 * driver becomes the program and the call's own result is the step's.
 */
export function toFnCall(body: RunCodeRequest): { call: FnCallRequest; direct: boolean } {
  const lang = sandboxFusionLanguage(body.language);
  const compileTimeout = lang.compile ? body.compile_timeout : 0;
  if (compileTimeout + body.run_timeout > SANDBOXFUSION_MAX_TOTAL_SECONDS)
    throw new DsecError(
      'invalid_argument',
      `compile_timeout and run_timeout may be ${SANDBOXFUSION_MAX_TOTAL_SECONDS} s together at most`,
      { field: 'run_timeout' },
    );
  let memoryMb = -1;
  if (body.memory_limit_MB > 0) {
    const max = lang.maxMemoryMb;
    if (body.memory_limit_MB < MIN_MEMORY_MB || body.memory_limit_MB > max)
      throw new DsecError(
        'invalid_argument',
        `memory_limit_MB must be -1 (the runtime's own) or ${MIN_MEMORY_MB}..${max} for ${body.language}`,
        { field: 'memory_limit_MB' },
      );
    memoryMb = body.memory_limit_MB;
  }
  const files: Record<string, string> = {};
  let bytes = 0;
  for (const [name, content] of Object.entries(body.files)) {
    // SandboxFusion skips a file whose content is not a string (null).
    if (typeof content !== 'string') continue;
    bytes += (content.length / 4) * 3;
    files[name] = content;
  }
  if (bytes > SANDBOXFUSION_MAX_FILE_BYTES)
    throw new DsecError(
      'invalid_argument',
      `files may hold ${SANDBOXFUSION_MAX_FILE_BYTES} bytes together at most`,
      { field: 'files' },
    );
  const direct = !lang.compile && body.fetch_files.length === 0;
  const code = lang.prepare ? lang.prepare(body.code) : body.code;
  const text = direct && lang.native ? textFiles(files) : undefined;
  if (lang.native && text) {
    // FnCall's own runtime runs this exactly as the driver would: a plain call, its fast path.
    return {
      call: {
        language: lang.native,
        code,
        ...(body.stdin != null ? { stdin: body.stdin } : {}),
        ...(Object.keys(text).length > 0 ? { files: text } : {}),
        memoryMb: memoryMb > 0 ? memoryMb : lang.maxMemoryMb,
        timeoutMs: Math.ceil(body.run_timeout * 1000),
        maxOutputBytes: SANDBOXFUSION_STREAM_CAP,
      },
      direct: true,
    };
  }
  const task: SandboxFusionTask = {
    direct,
    source: lang.source,
    code,
    files,
    stdin: body.stdin ?? null,
    compile: lang.compile ?? null,
    run: lang.run,
    compile_timeout: compileTimeout,
    run_timeout: body.run_timeout,
    memory_mb: memoryMb,
    fetch_files: body.fetch_files,
    caps: { stream: SANDBOXFUSION_STREAM_CAP, files: SANDBOXFUSION_FETCH_CAP },
  };
  return {
    call: {
      language: lang.runtime,
      code: direct ? SANDBOXFUSION_DIRECT_DRIVER : SANDBOXFUSION_DRIVER,
      stdin: JSON.stringify(task),
      timeoutMs: direct
        ? Math.ceil(body.run_timeout * 1000) + DIRECT_SLACK_MS
        : Math.ceil((compileTimeout + body.run_timeout) * 1000) + DRIVER_SLACK_MS,
      maxOutputBytes: direct ? SANDBOXFUSION_STREAM_CAP : DRIVER_OUTPUT_BYTES,
    },
    direct,
  };
}

const text = (b64: string): string => Buffer.from(b64, 'base64').toString('utf8');

const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/** The files as text when every one is UTF-8 (FnCall's files are text); else undefined. */
function textFiles(files: Record<string, string>): Record<string, string> | undefined {
  const out: Record<string, string> = {};
  for (const [name, b64] of Object.entries(files)) {
    try {
      out[name] = utf8.decode(Buffer.from(b64, 'base64'));
    } catch {
      return undefined;
    }
  }
  return out;
}

function commandResult(step: DriverStep): CommandRunResult {
  return {
    status: step.status,
    execution_time: step.execution_time,
    return_code: step.return_code ?? null,
    stdout: text(step.stdout),
    stderr: text(step.stderr),
  };
}

/** SandboxFusion's `parse_run_status`: Error first, then a time limit, then a non-zero code. */
export function runStatus(
  compile: CommandRunResult | null,
  run: CommandRunResult | null,
): { status: RunCodeResponse['status']; message: string } {
  const steps = [compile, run].filter((s): s is CommandRunResult => s !== null);
  for (const s of steps)
    if (s.status === 'Error') return { status: 'SandboxError', message: s.stderr ?? '' };
  if (steps.some((s) => s.status === 'TimeLimitExceeded')) return { status: 'Failed', message: '' };
  if (steps.some((s) => s.return_code !== null && s.return_code !== 0))
    return { status: 'Failed', message: '' };
  return { status: 'Success', message: '' };
}

/** The answer of a call whose driver did not answer (the platform failed it). */
function sandboxError(message: string, executor: string | null): RunCodeResponse {
  return {
    status: 'SandboxError',
    message,
    compile_result: null,
    run_result: null,
    executor_pod_name: executor,
    files: {},
  };
}

const outputLimit = `a stream of the program went past ${SANDBOXFUSION_STREAM_CAP} bytes`;

/** SandboxFusion's `return_code`: negative for a signal (as Python's subprocess reports it). */
const returnCode = (exitCode: number, signaled: boolean) =>
  signaled && exitCode > 128 ? -(exitCode - 128) : exitCode;

/** A direct step: the FnCall's own result is the step's. */
function fromDirect(result: FnCallResult, executor: string | null): RunCodeResponse {
  const base = {
    execution_time: result.durationMs / 1000,
    stdout: result.stdout,
    stderr: result.stderr,
  };
  let run: CommandRunResult;
  switch (result.outcome) {
    case 'ok':
    case 'pids_limit':
      run = { status: 'Finished', return_code: result.exitCode, ...base };
      break;
    case 'signaled':
    case 'oom':
      run = { status: 'Finished', return_code: returnCode(result.exitCode, true), ...base };
      break;
    case 'timeout':
      run = { status: 'TimeLimitExceeded', return_code: null, ...base };
      break;
    case 'output_limit':
      return {
        ...sandboxError(outputLimit, executor),
        run_result: { status: 'Finished', return_code: null, ...base },
      };
    default:
      return sandboxError(
        `the sandbox failed the call (${result.outcome}): ${result.reason ?? ''}`,
        executor,
      );
  }
  const { status, message } = runStatus(null, run);
  return {
    status,
    message,
    compile_result: null,
    run_result: run,
    executor_pod_name: executor,
    files: {},
  };
}

/** Reads the step results out of the FnCall's result (the driver's answer, or a direct step's). */
export function fromFnCall(
  result: FnCallResult,
  direct = false,
  executor: string | null = null,
): RunCodeResponse {
  if (direct) return fromDirect(result, executor);
  if (result.outcome !== 'ok' || result.exitCode !== 0) {
    const why = result.reason ?? result.stderr.slice(-2000);
    return sandboxError(`the sandbox failed the call (${result.outcome}): ${why}`, executor);
  }
  let answer: DriverAnswer;
  try {
    answer = JSON.parse(result.stdout) as DriverAnswer;
  } catch {
    return sandboxError('the sandbox answered no result', executor);
  }
  const compile = answer.compile ? commandResult(answer.compile) : null;
  const run = answer.run ? commandResult(answer.run) : null;
  const cut = answer.compile?.truncated === true || answer.run?.truncated === true;
  const { status, message } = cut
    ? { status: 'SandboxError' as const, message: outputLimit }
    : runStatus(compile, run);
  return {
    status,
    message,
    compile_result: compile,
    run_result: run,
    executor_pod_name: executor,
    files: answer.files,
  };
}

/**
 * One `/run_code`: a request that does not parse, or names a language, path
 * or limit this endpoint refuses, is a DSec error (`invalid_argument`, HTTP
 * 400, with `field`); a refusal of the platform (quota, no edge, capacity)
 * too, so clients retry as they retry FnCall. What the program did, and a
 * sandbox that failed under it, are SandboxFusion answers.
 */
export async function runCode(
  deps: SandboxFusionDeps,
  principal: Principal,
  input: unknown,
  signal?: AbortSignal,
): Promise<RunCodeResponse> {
  const parsed = RunCodeBody.safeParse(input ?? {});
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    const field = issue.path.join('.');
    throw new DsecError('invalid_argument', `${field || 'body'}: ${issue.message}`, {
      field: field || 'body',
    });
  }
  const { call, direct } = toFnCall(parsed.data);
  let result: FnCallResult;
  try {
    result = await deps.run(principal, call, signal);
  } catch (err) {
    const e = toDsecError(err);
    // A runtime this edge lacks (its image not prepared) is the sandbox's failure, not the caller's.
    // Its toolkit image not prepared on the edge: the sandbox's failure too.
    if (e.code === 'image_not_found')
      return sandboxError(
        `the image of runtime ${call.language} is not on the edge (dsec fncall prepare --image sandboxfusion): ${e.message}`,
        deps.executorName ?? null,
      );
    if (e.code === 'invalid_argument' && e.field === 'language')
      return sandboxError(
        `no runtime ${call.language} on the edges: ${e.message}`,
        deps.executorName ?? null,
      );
    throw e;
  }
  return fromFnCall(result, direct, deps.executorName ?? null);
}

import { StringDecoder } from 'node:string_decoder';
import { DsecError, toDsecError } from '@dsec/core';
import type { HttpTransport } from './transport.js';
import { RETRY_CODES } from './transport.js';
import type { CallOptions } from './types.js';
import type { components } from './gen/openapi.js';

/** One function call: runtime, program, input and limits (`POST /v1/fncall`). */
export type FnCallRequest = components['schemas']['FnCallBody'];
/** How a call ended: `exitCode`, `stdout`, `stderr`, `truncated`, `outcome`, `durationMs`. */
export type FnCallResult = components['schemas']['FnCallResult'];
export type FnCallOutcome = FnCallResult['outcome'];
export type FnCallPoolStatus = components['schemas']['FnCallPoolStatus'];

/** One finished call of `map`, in completion order: its result, or the platform error that failed it. */
export type FnCallMapItem =
  | { index: number; result: FnCallResult; error?: undefined }
  | { index: number; result?: undefined; error: DsecError };

export interface FnCallMapOptions {
  /** Calls in flight at once on the server (1–256). Default 16. */
  concurrency?: number | undefined;
  signal?: AbortSignal | undefined;
  /** Deadline of each batch request. Default 6 h. */
  timeoutMs?: number | undefined;
}

/** Server-side slack over a call's own time limit (queueing for a warm worker, the hops). */
const RUN_SLACK_MS = 60_000;
const DEFAULT_CALL_TIMEOUT_MS = 10_000;
const DEFAULT_MAP_TIMEOUT_MS = 6 * 3600_000;
const DEFAULT_CONCURRENCY = 16;
/** A batch body stays under the API's 1 MiB request limit (with room for the envelope). */
const MAX_BATCH_BODY_BYTES = 900 * 1024;
const MAX_BATCH_CALLS = 10_000;
/** The longest `details.retryAfterMs` of a `quota_exceeded` that `map` waits for. */
const MAX_RETRY_AFTER_MS = 4000;

/** The wait a `quota_exceeded` names (`details.retryAfterMs`), capped; 0 when it names none. */
function retryAfterMs(e: DsecError): number {
  const ms = Number(e.details?.retryAfterMs);
  return Number.isFinite(ms) && ms > 0 ? Math.min(ms, MAX_RETRY_AFTER_MS) : 0;
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new DsecError('aborted', 'the map was aborted'));
    const timer = setTimeout(resolve, ms);
    signal.addEventListener(
      'abort',
      () => {
        clearTimeout(timer);
        reject(new DsecError('aborted', 'the map was aborted'));
      },
      { once: true },
    );
  });
}

/**
 * Stateless function calls (issue 14; docs/fncall.md), as `client.fncall`.
 * Calls run in warm pools on the edges; nothing one leaves behind is seen by
 * another, so the SDK resends a call freely (`unavailable`,
 * `capacity_exhausted`, `quota_exceeded`, with backoff).
 *
 * @example
 * ```ts
 * const r = await client.fncall.run({ language: 'python', code: 'print(input()[::-1])', stdin: 'abc\n' });
 * r.stdout; // 'cba\n'
 * for await (const { index, result, error } of client.fncall.map(calls, { concurrency: 32 })) {
 *   grade(index, result ?? error);
 * }
 * ```
 */
export class FnCalls {
  readonly #http: HttpTransport;

  constructor(http: HttpTransport) {
    this.#http = http;
  }

  /**
   * Runs one call and resolves with how it ended. A program that fails is a
   * result (`exitCode`, `outcome`), not an error; errors are the platform's.
   * Deadline: `timeoutMs`, default the call's own limit (10 s unless given) + 60 s.
   */
  run(req: FnCallRequest, options: CallOptions = {}): Promise<FnCallResult> {
    return this.#http.json<FnCallResult>({
      method: 'POST',
      path: '/v1/fncall',
      body: req,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? (req.timeoutMs ?? DEFAULT_CALL_TIMEOUT_MS) + RUN_SLACK_MS,
      idempotent: true,
    });
  }

  /**
   * Runs `calls` with at most `concurrency` in flight and yields each as it
   * finishes (`{ index, result }`, or `{ index, error }` for a call the
   * platform failed), through `POST /v1/fncall/batch`. Calls that do not fit
   * one request body (1 MiB) go in further batches, one after the other.
   * Calls refused for now (`unavailable`, `capacity_exhausted`,
   * `quota_exceeded`) and those of a batch whose stream broke are sent again
   * as the client's `retry` policy says (default up to 3 times, with
   * backoff; `retry: false`: never); an item's error is the last one.
   * Breaking out of the loop aborts the calls still running.
   */
  map(
    calls: readonly FnCallRequest[],
    options: FnCallMapOptions = {},
  ): AsyncIterable<FnCallMapItem> {
    return { [Symbol.asyncIterator]: () => this.#map(calls, options) };
  }

  async *#map(
    calls: readonly FnCallRequest[],
    options: FnCallMapOptions,
  ): AsyncGenerator<FnCallMapItem> {
    const stop = new AbortController();
    const signal = options.signal ? AbortSignal.any([options.signal, stop.signal]) : stop.signal;
    try {
      for (const chunk of batches(calls)) {
        let pending = chunk;
        for (let attempt = 0; pending.length > 0; attempt++) {
          const byIndex = new Map(pending.map((c) => [c.index, c]));
          const done = new Set<number>();
          // Calls the platform refused for now (full, down, over quota): sent again after a wait.
          const again: typeof pending = [];
          const resend = attempt < this.#http.maxRetries;
          let waitMs = this.#http.retryDelayMs(attempt);
          try {
            for await (const item of this.#batch(pending, options, signal)) {
              done.add(item.index);
              if (item.error && RETRY_CODES.has(item.error.code) && resend) {
                again.push(byIndex.get(item.index)!);
                waitMs = Math.max(waitMs, retryAfterMs(item.error));
                continue;
              }
              yield item;
            }
            pending = again;
          } catch (err) {
            const e = toDsecError(err);
            pending = [...again, ...pending.filter((c) => !done.has(c.index))];
            if (signal.aborted || !resend || !RETRY_CODES.has(e.code)) throw e;
          }
          if (pending.length > 0) await sleep(waitMs, signal);
        }
      }
    } finally {
      stop.abort(new DsecError('aborted', 'the map was left'));
    }
  }

  /** One batch request; items carry indexes into `calls` as the caller numbers them. */
  async *#batch(
    calls: readonly { index: number; req: FnCallRequest }[],
    options: FnCallMapOptions,
    signal: AbortSignal,
  ): AsyncGenerator<FnCallMapItem> {
    const local = new AbortController();
    const queue: FnCallMapItem[] = [];
    let wake: (() => void) | undefined;
    let ended = false;
    let failure: unknown;
    const lines = new StringDecoder('utf8');
    let partial = '';
    const onLine = (line: string) => {
      if (line.trim() === '') return;
      let raw: {
        index?: unknown;
        result?: FnCallResult;
        error?: { code: string; message: string };
      };
      try {
        raw = JSON.parse(line) as typeof raw;
      } catch (cause) {
        throw new DsecError('internal', 'malformed line in the fncall batch stream', { cause });
      }
      const call = typeof raw.index === 'number' ? calls[raw.index] : undefined;
      if (!call) throw new DsecError('internal', 'fncall batch line without a known index');
      queue.push(
        raw.error
          ? { index: call.index, error: DsecError.fromBody({ error: raw.error }) }
          : { index: call.index, result: raw.result! },
      );
    };
    const request = this.#http
      .stream<void>({
        method: 'POST',
        path: '/v1/fncall/batch',
        body: {
          calls: calls.map((c) => c.req),
          concurrency: options.concurrency ?? DEFAULT_CONCURRENCY,
        },
        accept: 'application/x-ndjson',
        signal: AbortSignal.any([signal, local.signal]),
        // Resent (with backoff) only while nothing was delivered; `#map` resends the rest later.
        idempotent: true,
        timeoutMs: options.timeoutMs ?? DEFAULT_MAP_TIMEOUT_MS,
        onChunk: (chunk) => {
          partial += lines.write(chunk);
          let nl: number;
          while ((nl = partial.indexOf('\n')) >= 0) {
            const line = partial.slice(0, nl);
            partial = partial.slice(nl + 1);
            onLine(line);
          }
          wake?.();
        },
        onEnd: () => {
          onLine(partial + lines.end());
          partial = '';
        },
        onJson: () => {
          throw new DsecError('internal', 'the fncall batch answer is not a stream');
        },
      })
      .then(
        () => {
          ended = true;
        },
        (err: unknown) => {
          failure = err;
          ended = true;
        },
      )
      .finally(() => wake?.());
    try {
      for (;;) {
        const item = queue.shift();
        if (item) {
          yield item;
          continue;
        }
        if (ended) break;
        await new Promise<void>((resolve) => (wake = resolve));
        wake = undefined;
      }
      if (failure !== undefined) throw toDsecError(failure);
    } finally {
      // Left early (the caller broke out, or a line was bad): the calls still running are aborted.
      if (!ended) local.abort(new DsecError('aborted', 'the batch was left'));
      await request;
    }
  }
}

/** Splits calls into request bodies under the size and count limits, numbering them. */
function batches(calls: readonly FnCallRequest[]): { index: number; req: FnCallRequest }[][] {
  const out: { index: number; req: FnCallRequest }[][] = [];
  let current: { index: number; req: FnCallRequest }[] = [];
  let bytes = 0;
  calls.forEach((req, index) => {
    const size = Buffer.byteLength(JSON.stringify(req)) + 1;
    if (
      current.length > 0 &&
      (bytes + size > MAX_BATCH_BODY_BYTES || current.length >= MAX_BATCH_CALLS)
    ) {
      out.push(current);
      current = [];
      bytes = 0;
    }
    current.push({ index, req });
    bytes += size;
  });
  if (current.length > 0) out.push(current);
  return out;
}

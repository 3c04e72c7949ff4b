import type { Socket } from 'node:net';
import type { FastifyReply, FastifyRequest } from 'fastify';
import {
  CONNECTION_LIMIT_DEFAULTS,
  DsecError,
  OUTPUT_BUDGET_DEFAULTS,
  OutputBudget,
} from '@dsec/core';
import type { OutputAccount, OutputCutReason } from '@dsec/core';

/**
 * Per-caller bounds of one apiserver (docs/security.md, "Bounded work per
 * caller"). Connection caps are `ConnectionGuard`'s (@dsec/core); these are
 * the ones a key or a stream is charged against:
 *
 * - `maxRequestsPerKey` requests of one key answered at once;
 * - `maxStreamsPerKey` streams of one key open at once (command output,
 *   session output, function-call batches, file downloads, E2B process and
 *   watch streams);
 * - `streamBufferBytes` queued for one stream whose client does not read,
 *   and `outputBudgetBytes` for all of them together (`OutputBudget`): a
 *   stream over either is cut, its socket destroyed and its backlog freed.
 *
 * Past a per-key cap a request is refused with `rate_limited` (429,
 * `Retry-After: 1`) before it reaches an edge.
 */
export interface ApiLimits {
  /** Open connections from one client address (IPv4, IPv6 /64). Default 4096. */
  maxConnectionsPerAddress: number;
  /** Keep-alive idle time while connections are above half a cap. Default 1000. */
  pressureKeepAliveMs: number;
  /** Requests of one API key in flight at once. Default 4096. */
  maxRequestsPerKey: number;
  /** Streams of one API key open at once. Default 512. */
  maxStreamsPerKey: number;
  /** Unread output one stream may queue before it is cut. Default 8 MiB. */
  streamBufferBytes: number;
  /** Unread output all streams together may queue. Default 256 MiB. */
  outputBudgetBytes: number;
}

export const API_LIMIT_DEFAULTS: ApiLimits = {
  maxConnectionsPerAddress: CONNECTION_LIMIT_DEFAULTS.maxConnectionsPerAddress,
  pressureKeepAliveMs: CONNECTION_LIMIT_DEFAULTS.pressureKeepAliveMs,
  maxRequestsPerKey: 4096,
  maxStreamsPerKey: 512,
  streamBufferBytes: OUTPUT_BUDGET_DEFAULTS.maxStreamBytes,
  outputBudgetBytes: OUTPUT_BUDGET_DEFAULTS.maxBytes,
};

/** What a per-key refusal tells the client to wait. */
const RETRY_AFTER_MS = 1000;

/** A stream's hold on its key's stream count and on the output budget. */
export interface StreamTicket {
  /** Call after queuing output: false when the stream has been cut (it is over). */
  check(): boolean;
  /** The stream ended; idempotent. */
  release(): void;
}

/** The per-key counters and the output budget of one apiserver. */
export class CallerLimits {
  readonly limits: ApiLimits;
  readonly budget: OutputBudget;
  readonly #requests = new Map<string, number>();
  readonly #streams = new Map<string, number>();
  readonly #onCut: ((reason: OutputCutReason) => void) | undefined;
  readonly #onRefused: ((reason: 'requests_per_key' | 'streams_per_key') => void) | undefined;

  constructor(
    limits: Partial<ApiLimits> = {},
    events: {
      onCut?: (reason: OutputCutReason) => void;
      onRefused?: (reason: 'requests_per_key' | 'streams_per_key') => void;
    } = {},
  ) {
    this.limits = { ...API_LIMIT_DEFAULTS, ...definedOnly(limits) };
    this.budget = new OutputBudget({
      maxBytes: this.limits.outputBudgetBytes,
      maxStreamBytes: this.limits.streamBufferBytes,
    });
    this.#onCut = events.onCut;
    this.#onRefused = events.onRefused;
  }

  /** Counts a request of `keyId` until `release`; `rate_limited` past `maxRequestsPerKey`. */
  enterRequest(keyId: string): () => void {
    return this.#enter(this.#requests, keyId, this.limits.maxRequestsPerKey, 'requests_per_key');
  }

  /**
   * Opens a stream of `caller`'s key whose backlog `measure` reports; `cut`
   * stops it (it must destroy the stream's socket). `rate_limited` past
   * `maxStreamsPerKey`. Over the output budget, the project whose streams
   * hold the most pays first (`OutputBudget`).
   */
  openStream(
    caller: { keyId: string; projectId: string },
    measure: () => number,
    cut: (reason: OutputCutReason) => void,
  ): StreamTicket {
    const leave = this.#enter(
      this.#streams,
      caller.keyId,
      this.limits.maxStreamsPerKey,
      'streams_per_key',
    );
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      account.close();
      leave();
    };
    const account: OutputAccount = this.budget.open(
      measure,
      (reason) => {
        this.#onCut?.(reason);
        release();
        cut(reason);
      },
      caller.projectId,
    );
    return { check: () => account.check(), release };
  }

  #enter(
    counts: Map<string, number>,
    keyId: string,
    max: number,
    reason: 'requests_per_key' | 'streams_per_key',
  ): () => void {
    const n = counts.get(keyId) ?? 0;
    if (n >= max) {
      this.#onRefused?.(reason);
      throw new DsecError(
        'rate_limited',
        reason === 'streams_per_key'
          ? `this key has ${n} streams open, the most it may; close one first`
          : `this key has ${n} requests in flight, the most it may`,
        { details: { retryAfterMs: RETRY_AFTER_MS, limit: reason, max } },
      );
    }
    counts.set(keyId, n + 1);
    let left = false;
    return () => {
      if (left) return;
      left = true;
      const now = (counts.get(keyId) ?? 1) - 1;
      if (now <= 0) counts.delete(keyId);
      else counts.set(keyId, now);
    };
  }
}

const limitsOfRequest = new WeakMap<FastifyRequest, CallerLimits>();

/** Set by the server's first hook: the limits every route of this request is charged against. */
export function bindLimits(req: FastifyRequest, limits: CallerLimits): void {
  limitsOfRequest.set(req, limits);
}

/** The limits `bindLimits` set (undefined for a request that skipped the hooks). */
export function limitsOf(req: FastifyRequest): CallerLimits | undefined {
  return limitsOfRequest.get(req);
}

/** The `Retry-After` header value (whole seconds, at least 1) for a `rate_limited` error's details. */
export function retryAfterSeconds(details: Record<string, unknown> | undefined): number {
  const ms = Number(details?.['retryAfterMs']);
  return Number.isFinite(ms) && ms > 0 ? Math.max(1, Math.ceil(ms / 1000)) : 1;
}

/**
 * Destroys the connection a reply goes out on, with a TCP reset: what is
 * queued for it is dropped with it, in this process and in the kernel's
 * send buffer (a plain close would keep sending to a reader that reads
 * nothing).
 */
export function destroyConnection(reply: FastifyReply): void {
  // Not every socket has it: inject()'s stand-in has only `destroy`.
  const socket: Partial<Socket> | null = reply.request.raw.socket;
  reply.raw.destroy();
  if (typeof socket?.resetAndDestroy === 'function') socket.resetAndDestroy();
  else socket?.destroy?.();
}

function definedOnly<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}

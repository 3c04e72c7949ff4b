import { StringDecoder } from 'node:string_decoder';
import { DsecError } from '@dsec/core';
import type { CommandResult } from './wire.js';

/**
 * Decodes the NDJSON event stream of `POST /v1/sandboxes/:id/commands`
 * (`Accept: application/x-ndjson`). Output events carry base64 bytes; they are
 * decoded to UTF-8 per stream so a character split across two events is
 * delivered whole. Throws `DsecError` on an `error` event or a malformed line.
 */
export class CommandEventDecoder {
  readonly #onStdout: (chunk: string) => void;
  readonly #onStderr: (chunk: string) => void;
  readonly #stdout = new StringDecoder('utf8');
  readonly #stderr = new StringDecoder('utf8');
  readonly #lines = new StringDecoder('utf8');
  #pending = '';
  #result: CommandResult | undefined;

  constructor(onStdout: (chunk: string) => void, onStderr: (chunk: string) => void) {
    this.#onStdout = onStdout;
    this.#onStderr = onStderr;
  }

  push(chunk: Buffer): void {
    this.#pending += this.#lines.write(chunk);
    let nl: number;
    while ((nl = this.#pending.indexOf('\n')) >= 0) {
      const line = this.#pending.slice(0, nl);
      this.#pending = this.#pending.slice(nl + 1);
      if (line.trim().length > 0) this.#event(line);
    }
  }

  /** Call at the end of the body; returns the final result. */
  end(): CommandResult {
    this.#pending += this.#lines.end();
    if (this.#pending.trim().length > 0) this.#event(this.#pending);
    this.#pending = '';
    this.#flush();
    if (!this.#result) {
      throw new DsecError('unavailable', 'the command stream ended before its result');
    }
    return this.#result;
  }

  #event(line: string): void {
    let event: unknown;
    try {
      event = JSON.parse(line);
    } catch (cause) {
      throw new DsecError('internal', 'malformed line in the command stream', { cause });
    }
    const e = event as { type?: unknown; data?: unknown; result?: unknown; error?: unknown };
    switch (e.type) {
      case 'stdout':
      case 'stderr': {
        const bytes = Buffer.from(typeof e.data === 'string' ? e.data : '', 'base64');
        const text = (e.type === 'stdout' ? this.#stdout : this.#stderr).write(bytes);
        if (text.length > 0) (e.type === 'stdout' ? this.#onStdout : this.#onStderr)(text);
        return;
      }
      case 'result':
        this.#flush();
        this.#result = e.result as CommandResult;
        return;
      case 'error':
        throw DsecError.fromBody({ error: e.error });
      default:
        // Unknown event types are skipped so the server can add new ones.
        return;
    }
  }

  #flush(): void {
    const out = this.#stdout.end();
    if (out.length > 0) this.#onStdout(out);
    const err = this.#stderr.end();
    if (err.length > 0) this.#onStderr(err);
  }
}

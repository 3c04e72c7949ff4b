import type { DisplayInput, DisplayInputEvent } from '@dsec/core';
import { readAll } from './commands.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions } from './types.js';

export type { DisplayInput, DisplayInputEvent };

/** A screendump of an emulated display takes a moment under TCG. */
const SCREENSHOT_TIMEOUT_MS = 60_000;
/** Extra deadline per key or event of an input call. */
const INPUT_MS_PER_EVENT = 50;

/** `GET /v1/sandboxes/{id}/screenshot`: the PNG bytes. */
export async function screenshot(
  http: HttpTransport,
  id: string,
  options: CallOptions = {},
): Promise<Buffer> {
  const res = await http.raw({
    method: 'GET',
    path: `/v1/sandboxes/${encodeURIComponent(id)}/screenshot`,
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? SCREENSHOT_TIMEOUT_MS,
    idempotent: true,
  });
  return readAll(res);
}

/** `POST /v1/sandboxes/{id}/input`: events in order, or text typed key by key. */
export async function sendInput(
  http: HttpTransport,
  id: string,
  input: DisplayInput,
  options: CallOptions & { defaultTimeoutMs: number },
): Promise<void> {
  // Keys go in one by one with a short gap (the guest's queue is short): allow for it.
  const keys = 'text' in input ? input.text.length : input.events.length;
  await http.json<undefined>({
    method: 'POST',
    path: `/v1/sandboxes/${encodeURIComponent(id)}/input`,
    body: input,
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? options.defaultTimeoutMs + keys * INPUT_MS_PER_EVENT,
  });
}

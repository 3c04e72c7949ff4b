import { DsecError } from './errors.js';

/**
 * The screen of a sandbox that has one (the full-VM backend, issue 15):
 * keys and pointer events sent to it, and screenshots taken from it.
 *
 * Keys are named by QEMU's `QKeyCode` (`a`, `ret`, `shift`, `ctrl`, `f1`,
 * `esc`, `kp_add`, …: qapi/ui.json), so the names mean the same key on every
 * host. A key or button event without `down` is a press and a release.
 * Pointer positions are pixels of the screen as the last screenshot shows it.
 */
export type DisplayInputEvent =
  | { type: 'key'; key: string; down?: boolean | undefined }
  | { type: 'button'; button: PointerButton; down?: boolean | undefined }
  | { type: 'move'; x: number; y: number }
  | { type: 'moveBy'; dx: number; dy: number };

export type PointerButton =
  'left' | 'middle' | 'right' | 'wheel-up' | 'wheel-down' | 'side' | 'extra';

export const POINTER_BUTTONS: readonly PointerButton[] = [
  'left',
  'middle',
  'right',
  'wheel-up',
  'wheel-down',
  'side',
  'extra',
];

/** What `POST /v1/sandboxes/{id}/input` takes: events, or text typed as key presses (US layout). */
export type DisplayInput = { events: DisplayInputEvent[] } | { text: string };

/** At most this many events, or characters of text, in one input request. */
export const MAX_DISPLAY_INPUT = 4096;

const QCODE = /^[a-z0-9_]{1,24}$/;

/** Checks an input request's shape (the API schema does too; edges check again). */
export function validateDisplayInput(input: DisplayInput): void {
  const bad = (msg: string, field: string) => new DsecError('invalid_argument', msg, { field });
  if ('text' in input) {
    if (typeof input.text !== 'string') throw bad('text must be a string', 'text');
    if ([...input.text].length > MAX_DISPLAY_INPUT)
      throw bad(`text is longer than ${MAX_DISPLAY_INPUT} characters`, 'text');
    return;
  }
  if (!Array.isArray(input.events)) throw bad('events must be an array', 'events');
  if (input.events.length > MAX_DISPLAY_INPUT)
    throw bad(`more than ${MAX_DISPLAY_INPUT} events`, 'events');
  input.events.forEach((e, i) => {
    const field = `events.${i}`;
    switch (e.type) {
      case 'key':
        if (typeof e.key !== 'string' || !QCODE.test(e.key))
          throw bad('key must be a QEMU key code such as "a", "ret" or "shift"', `${field}.key`);
        break;
      case 'button':
        if (!POINTER_BUTTONS.includes(e.button))
          throw bad(`button must be one of ${POINTER_BUTTONS.join(', ')}`, `${field}.button`);
        break;
      case 'move':
        for (const k of ['x', 'y'] as const)
          if (!Number.isInteger(e[k]) || e[k] < 0 || e[k] > 65_535)
            throw bad(`${k} must be a pixel position`, `${field}.${k}`);
        break;
      case 'moveBy':
        for (const k of ['dx', 'dy'] as const)
          if (!Number.isInteger(e[k]) || Math.abs(e[k]) > 65_535)
            throw bad(`${k} must be a whole number of pixels`, `${field}.${k}`);
        break;
      default:
        throw bad('type must be key, button, move or moveBy', `${field}.type`);
    }
  });
}

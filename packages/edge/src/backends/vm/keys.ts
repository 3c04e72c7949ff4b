import { DsecError } from '@dsec/core';
import type { DisplayInputEvent } from '@dsec/core';

/** One event of QMP's `input-send-event` (qapi/ui.json `InputEvent`). */
export type QmpInputEvent =
  | { type: 'key'; data: { down: boolean; key: { type: 'qcode'; data: string } } }
  | { type: 'btn'; data: { down: boolean; button: string } }
  | { type: 'abs' | 'rel'; data: { axis: 'x' | 'y'; value: number } };

/** QEMU's absolute pointer axes run from 0 to this, whatever the screen's size. */
export const ABS_MAX = 0x7fff;

const UNSHIFTED: Record<string, string> = {
  ' ': 'spc',
  '\n': 'ret',
  '\t': 'tab',
  '-': 'minus',
  '=': 'equal',
  '[': 'bracket_left',
  ']': 'bracket_right',
  '\\': 'backslash',
  ';': 'semicolon',
  "'": 'apostrophe',
  '`': 'grave_accent',
  ',': 'comma',
  '.': 'dot',
  '/': 'slash',
};
const SHIFTED: Record<string, string> = {
  '!': '1',
  '@': '2',
  '#': '3',
  $: '4',
  '%': '5',
  '^': '6',
  '&': '7',
  '*': '8',
  '(': '9',
  ')': '0',
  _: 'minus',
  '+': 'equal',
  '{': 'bracket_left',
  '}': 'bracket_right',
  '|': 'backslash',
  ':': 'semicolon',
  '"': 'apostrophe',
  '~': 'grave_accent',
  '<': 'comma',
  '>': 'dot',
  '?': 'slash',
};

/** The key (and whether shift is held) that types `ch` on a US keyboard. */
export function keyForChar(ch: string): { key: string; shift: boolean } {
  if (/^[a-z0-9]$/.test(ch)) return { key: ch, shift: false };
  if (/^[A-Z]$/.test(ch)) return { key: ch.toLowerCase(), shift: true };
  const plain = UNSHIFTED[ch];
  if (plain) return { key: plain, shift: false };
  const shifted = SHIFTED[ch];
  if (shifted) return { key: shifted, shift: true };
  throw new DsecError(
    'invalid_argument',
    `cannot type ${JSON.stringify(ch)}: text is typed on a US keyboard (printable ASCII, tab and newline)`,
    { field: 'text' },
  );
}

const key = (k: string, down: boolean): QmpInputEvent => ({
  type: 'key',
  data: { down, key: { type: 'qcode', data: k } },
});

/**
 * `text` as groups of QMP events, one group per character (press and
 * release, shift around it where needed). Each group is sent on its own:
 * the guest's keyboard queue is short, and keys sent faster than the guest
 * reads them are dropped by the device. Every character is checked before
 * anything is typed.
 */
export function textToEvents(text: string): QmpInputEvent[][] {
  return [...text].map((ch) => {
    const { key: k, shift } = keyForChar(ch);
    return shift
      ? [key('shift', true), key(k, true), key(k, false), key('shift', false)]
      : [key(k, true), key(k, false)];
  });
}

/**
 * API events as groups of QMP events (a key or button without `down` is a
 * press and a release, sent as its own group for the reason above).
 * Absolute positions are scaled from the screen's pixels to QEMU's axis.
 */
export function toQmpEvents(
  events: readonly DisplayInputEvent[],
  screen: { width: number; height: number },
): QmpInputEvent[][] {
  const groups: QmpInputEvent[][] = [];
  const scale = (v: number, size: number) =>
    Math.min(ABS_MAX, Math.round((v * ABS_MAX) / Math.max(1, size - 1)));
  for (const e of events) {
    switch (e.type) {
      case 'key':
        groups.push(
          e.down === undefined ? [key(e.key, true), key(e.key, false)] : [key(e.key, e.down)],
        );
        break;
      case 'button': {
        const btn = (down: boolean): QmpInputEvent => ({
          type: 'btn',
          data: { down, button: e.button },
        });
        groups.push(e.down === undefined ? [btn(true), btn(false)] : [btn(e.down)]);
        break;
      }
      case 'move':
        groups.push([
          { type: 'abs', data: { axis: 'x', value: scale(e.x, screen.width) } },
          { type: 'abs', data: { axis: 'y', value: scale(e.y, screen.height) } },
        ]);
        break;
      case 'moveBy':
        groups.push([
          { type: 'rel', data: { axis: 'x', value: e.dx } },
          { type: 'rel', data: { axis: 'y', value: e.dy } },
        ]);
        break;
    }
  }
  return groups;
}

/** Width and height from a PNG's IHDR chunk (QEMU's `screendump` with `format: png`). */
export function pngSize(png: Buffer): { width: number; height: number } {
  if (png.length < 24 || png.toString('latin1', 12, 16) !== 'IHDR')
    throw new DsecError('internal', 'screendump wrote no PNG');
  return { width: png.readUInt32BE(16), height: png.readUInt32BE(20) };
}

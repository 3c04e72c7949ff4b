import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DsecError, validateDisplayInput } from '@dsec/core';
import { ABS_MAX, keyForChar, pngSize, textToEvents, toQmpEvents } from './keys.js';

test('text becomes one press-and-release group per character, shift where a US keyboard needs it', () => {
  const groups = textToEvents('aB $\n');
  const keys = groups.map((g) =>
    g
      .map((e) => (e.type === 'key' ? `${e.data.down ? '+' : '-'}${e.data.key.data}` : '?'))
      .join(' '),
  );
  assert.deepEqual(keys, [
    '+a -a',
    '+shift +b -b -shift',
    '+spc -spc',
    '+shift +4 -4 -shift',
    '+ret -ret',
  ]);
  assert.deepEqual(keyForChar('\\'), { key: 'backslash', shift: false });
  assert.deepEqual(keyForChar('|'), { key: 'backslash', shift: true });
  assert.deepEqual(keyForChar("'"), { key: 'apostrophe', shift: false });
});

test('a character no US key types is refused before anything is typed', () => {
  assert.throws(
    () => textToEvents('ok é'),
    (err: unknown) => err instanceof DsecError && err.code === 'invalid_argument',
  );
});

test('pointer positions scale from pixels to QEMU axis; keys and buttons keep their order', () => {
  const screen = { width: 1024, height: 768 };
  const groups = toQmpEvents(
    [
      { type: 'move', x: 1023, y: 0 },
      { type: 'move', x: 512, y: 767 },
      { type: 'button', button: 'left' },
      { type: 'key', key: 'ctrl', down: true },
      { type: 'moveBy', dx: -5, dy: 3 },
    ],
    screen,
  );
  assert.deepEqual(groups[0], [
    { type: 'abs', data: { axis: 'x', value: ABS_MAX } },
    { type: 'abs', data: { axis: 'y', value: 0 } },
  ]);
  assert.equal(
    (groups[1]![0]!.data as { value: number }).value,
    Math.round((512 * ABS_MAX) / 1023),
  );
  assert.equal((groups[1]![1]!.data as { value: number }).value, ABS_MAX);
  assert.deepEqual(groups[2], [
    { type: 'btn', data: { down: true, button: 'left' } },
    { type: 'btn', data: { down: false, button: 'left' } },
  ]);
  assert.deepEqual(groups[3], [
    { type: 'key', data: { down: true, key: { type: 'qcode', data: 'ctrl' } } },
  ]);
  assert.deepEqual(groups[4], [
    { type: 'rel', data: { axis: 'x', value: -5 } },
    { type: 'rel', data: { axis: 'y', value: 3 } },
  ]);
});

test('input requests are checked field by field', () => {
  const field = (input: unknown) => {
    try {
      validateDisplayInput(input as never);
    } catch (err) {
      assert.ok(err instanceof DsecError && err.code === 'invalid_argument');
      return err.field;
    }
    return undefined;
  };
  assert.equal(field({ text: 'ls\n' }), undefined);
  assert.equal(field({ events: [{ type: 'key', key: 'ret' }] }), undefined);
  assert.equal(field({ events: [{ type: 'key', key: 'Return; rm' }] }), 'events.0.key');
  assert.equal(field({ events: [{ type: 'button', button: 'fourth' }] }), 'events.0.button');
  assert.equal(
    field({
      events: [
        { type: 'key', key: 'a' },
        { type: 'move', x: -1, y: 0 },
      ],
    }),
    'events.1.x',
  );
  assert.equal(field({ events: [{ type: 'warp' }] }), 'events.0.type');
  assert.equal(field({ text: 'x'.repeat(5000) }), 'text');
});

test('the screen size comes from the PNG header', () => {
  const png = Buffer.alloc(33);
  Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]).copy(png);
  png.writeUInt32BE(13, 8);
  png.write('IHDR', 12, 'latin1');
  png.writeUInt32BE(1280, 16);
  png.writeUInt32BE(800, 20);
  assert.deepEqual(pngSize(png), { width: 1280, height: 800 });
  assert.throws(() => pngSize(Buffer.from('P6 1 1 255\n')), DsecError);
});

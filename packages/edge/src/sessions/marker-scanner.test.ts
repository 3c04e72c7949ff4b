import { test } from 'node:test';
import assert from 'node:assert/strict';
import { MarkerScanner } from './marker-scanner.js';
import { wrap } from './shell-session.js';

const NONCE = '0123456789abcdef0123456789abcdef';
const marker = (status: number, nonce = NONCE) => `\x1eDSEC:${nonce}:${status}\x1e`;

function feed(scanner: MarkerScanner, chunks: string[]): string {
  return chunks.map((c) => scanner.push(Buffer.from(c, 'latin1')).toString('latin1')).join('');
}

test('output before the marker is passed through; the status is read', () => {
  const s = new MarkerScanner(NONCE);
  assert.equal(feed(s, [`hello\nworld${marker(3)}`]), 'hello\nworld');
  assert.equal(s.done, true);
  assert.equal(s.status, 3);
});

test('a marker split across chunks at every position is found, and no output is lost', () => {
  const text = `out${marker(42)}`;
  for (let i = 1; i < text.length; i++) {
    for (let j = i; j < text.length; j++) {
      const s = new MarkerScanner(NONCE);
      const out = feed(s, [text.slice(0, i), text.slice(i, j), text.slice(j)]);
      assert.equal(out, 'out', `split at ${i},${j}`);
      assert.equal(s.status, 42);
    }
  }
});

test("a marker with another call's nonce, or a lookalike, is output", () => {
  const s = new MarkerScanner(NONCE);
  const fake = `${marker(0, 'f'.repeat(32))}\x1eDSEC:${NONCE.slice(0, 8)}\x1e \x1e`;
  assert.equal(feed(s, [fake, 'x']), fake + 'x');
  assert.equal(s.done, false);
  assert.equal(s.flush().length, 0);
});

test('held-back bytes come out when the next chunk shows they were not a marker', () => {
  const s = new MarkerScanner(NONCE);
  assert.equal(feed(s, ['abc\x1eDS']), 'abc');
  assert.equal(feed(s, ['X']), '\x1eDSX');
  assert.equal(feed(s, ['\x1e']), '');
  assert.equal(s.flush().toString('latin1'), '\x1e');
});

test('the wrapped line quotes the line, isolates stdin and prints the marker on both streams', () => {
  const text = wrap({ line: "echo 'it''s'; exit 3" }, NONCE, 'tag1');
  assert.match(
    text,
    /^DSEC_CALL=tag1 command eval 'echo '\\''it'\\'''\\''s'\\''; exit 3' <\/dev\/null 7>&- 8>&-\n/,
  );
  assert.equal(text.split(NONCE).length - 1, 2);
  const withStdin = wrap({ line: 'cat', stdin: 'a\nb' }, NONCE, 'tag1');
  assert.ok(withStdin.includes(`<<'DSEC_EOF_${NONCE}' 7>&- 8>&-\na\nb\nDSEC_EOF_${NONCE}\n`));
});

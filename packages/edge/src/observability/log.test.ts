import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { edgeLog, jsonLogger, REDACTED_FIELDS, type LevelLogger } from './log.js';

function capture(): {
  stream: Writable;
  lines: () => Record<string, unknown>[];
  text: () => string;
} {
  let text = '';
  const stream = new Writable({
    write(chunk: Buffer, _enc, done) {
      text += chunk.toString();
      done();
    },
  });
  return {
    stream,
    text: () => text,
    lines: () =>
      text
        .split('\n')
        .filter(Boolean)
        .map((l) => JSON.parse(l) as Record<string, unknown>),
  };
}

test('edge log levels: explicit wins; without one, an err field means error', () => {
  const seen: [string, string, object][] = [];
  const logger: LevelLogger = {
    info: (o, m) => seen.push(['info', m, o]),
    warn: (o, m) => seen.push(['warn', m, o]),
    error: (o, m) => seen.push(['error', m, o]),
  };
  const log = edgeLog(logger);
  log('sandbox started', { id: 'sb1' });
  log('admission refused', { resource: 'memory' }, 'warn');
  log('idle pause failed', { id: 'sb1', err: new Error('frozen') });
  assert.deepEqual(seen, [
    ['info', 'sandbox started', { id: 'sb1' }],
    ['warn', 'admission refused', { resource: 'memory' }],
    ['error', 'idle pause failed', { id: 'sb1', err: 'frozen' }],
  ]);
});

test('JSON lines carry name, level and time; secrets are redacted wherever they sit', () => {
  const out = capture();
  const logger = jsonLogger({ name: 'dsec-edge', destination: out.stream });
  const apiKey = 'dsk_live_0123456789abcdef0123456789abcdef';
  const hmac = 'f'.repeat(64);
  const log = edgeLog(logger);
  log('edge joined', { edgeId: 'node-1', secret: hmac, apiKey });
  logger.info({ req: { headers: { authorization: `Bearer ${apiKey}` } } }, 'request');
  logger.warn({ store: { secretAccessKey: hmac, accessKeyId: 'AKIA0000' } }, 'store opened');
  logger.info({ key: apiKey, adminKey: apiKey, token: hmac, password: hmac }, 'keys');
  const text = out.text();
  assert.ok(!text.includes(apiKey), text);
  assert.ok(!text.includes(hmac), text);
  assert.ok(!text.includes('AKIA0000'), text);
  const lines = out.lines();
  assert.equal(lines.length, 4);
  assert.equal(lines[0]!.name, 'dsec-edge');
  assert.equal(lines[0]!.msg, 'edge joined');
  assert.equal(lines[0]!.edgeId, 'node-1');
  assert.equal(lines[0]!.secret, '[redacted]');
  assert.equal(lines[2]!.level, 40); // pino's warn
  assert.match(String(lines[0]!.time), /^\d{4}-\d\d-\d\dT/);
  assert.ok(REDACTED_FIELDS.includes('secret'));
});

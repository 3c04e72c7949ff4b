import assert from 'node:assert/strict';
import { chmodSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { ConntrackSession, MARK_TAG_MASK, markTag, newMark, parseEntry } from './conntrack.js';

const dir = mkdtempSync(join(tmpdir(), 'dsec-conntrack-'));
after(() => rmSync(dir, { recursive: true, force: true }));

/** A stand-in for `dsec-helper conntrack`: answers by the request's verb, logging each request. */
function fakeHelper(
  name: string,
  body: string,
): { binary: () => string; requests: () => string[] } {
  const file = join(dir, name);
  const log = join(dir, `${name}.log`);
  writeFileSync(
    file,
    `#!/bin/sh\n[ "$1" = conntrack ] || exit 2\nwhile read -r verb rest; do\n  echo "$verb $rest" >> '${log}'\n${body}\ndone\n`,
  );
  chmodSync(file, 0o755);
  writeFileSync(log, '');
  return {
    binary: () => file,
    requests: () => readFileSync(log, 'utf8').split('\n').filter(Boolean),
  };
}

test('parseEntry reads the helper entry lines and nothing else', () => {
  assert.deepEqual(parseEntry('entry 4 17 10.213.0.2 198.18.1.10 7 0a1b'), {
    family: 4,
    protocol: 17,
    source: '10.213.0.2',
    destination: '198.18.1.10',
    port: 7,
    key: '0a1b',
  });
  assert.equal(parseEntry('entry 6 58 fd00::2 fdff::1 - ff')?.port, undefined);
  for (const bad of [
    'entry 4 17 10.0.0.2 10.0.0.1 7',
    'entry 5 17 10.0.0.2 10.0.0.1 7 ab',
    'entry 4 17 10.0.0.2 10.0.0.1 7 AB',
    'entry 4 17 10.0.0.2 10.0.0.1 7 ab extra',
    'entry 4 udp 10.0.0.2 10.0.0.1 7 ab',
    'entry 4 17 10.0.0.2 10.0.0.1 7.5 ab',
    'ok 3',
    '',
  ])
    assert.equal(parseEntry(bad), undefined, bad);
});

test("an edge's marks share its tag, never 0, and a new mark is none of the live ones", () => {
  const tag = markTag('dsec_10_213');
  assert.equal(tag, markTag('dsec_10_213'), 'stable across restarts');
  assert.notEqual(tag, 0);
  assert.equal((tag & ~MARK_TAG_MASK) >>> 0, 0);
  const taken = new Set<number>();
  for (let i = 0; i < 2000; i++) {
    const mark = newMark(tag, taken);
    assert.equal((mark & MARK_TAG_MASK) >>> 0, tag);
    assert.notEqual(mark, tag, 'the low bits are never 0');
    assert.ok(!taken.has(mark));
    taken.add(mark);
  }
});

test('the session lists, deletes in bounded requests and sweeps through one helper process', async () => {
  const helper = fakeHelper(
    'ok.sh',
    `  case "$verb" in
    list) echo "entry 4 6 10.213.0.2 198.18.1.10 443 aa"; echo "entry 6 17 fd00::2 fdff::1 7 bb"; echo "ok 2";;
    delete) set -- $rest; echo "ok $#";;
    sweep) echo "ok 5";;
  esac`,
  );
  const session = new ConntrackSession({ binary: helper.binary });
  try {
    const entries = await session.list(0x2a000001);
    assert.deepEqual(
      entries.map((e) => [e.family, e.destination, e.port, e.key]),
      [
        [4, '198.18.1.10', 443, 'aa'],
        [6, 'fdff::1', 7, 'bb'],
      ],
    );
    const keys = Array.from({ length: 600 }, (_, i) => i.toString(16));
    assert.equal(await session.delete(keys), 600);
    assert.equal(await session.sweep(0x2a000000, ['10.213.0.0/16'], [0x2a000001, 0x2a000002]), 5);
    const requests = helper.requests();
    assert.equal(requests[0], `list ${0x2a000001}`);
    // 600 keys in requests of 256 at most.
    assert.deepEqual(
      requests.slice(1, 4).map((r) => r.split(' ').length - 1),
      [256, 256, 88],
    );
    assert.equal(
      requests[4],
      `sweep ${0x2a000000} ${MARK_TAG_MASK} 10.213.0.0/16 -- ${0x2a000001} ${0x2a000002}`,
    );
  } finally {
    session.close();
  }
});

test("a helper's error, exit or silence fails the request with internal, and the next starts afresh", async () => {
  const failing = fakeHelper(
    'fail.sh',
    `  case "$verb" in
    list) echo "error netlink: Operation not permitted";;
    delete) exit 3;;
    sweep) sleep 30;;
  esac`,
  );
  const session = new ConntrackSession({ binary: failing.binary, timeoutMs: 300 });
  try {
    await assert.rejects(
      session.list(1),
      (e) => isDsecError(e, 'internal') && /Operation not permitted/.test(e.message),
    );
    await assert.rejects(
      session.delete(['ab']),
      (e) => isDsecError(e, 'internal') && /exited/.test(e.message),
    );
    await assert.rejects(
      session.sweep(0x2a000000, [], []),
      (e) => isDsecError(e, 'internal') && /no answer/.test(e.message),
    );
    // A new process after each death: the list still answers (with its error).
    await assert.rejects(session.list(1), (e) => isDsecError(e, 'internal'));
  } finally {
    session.close();
  }
});

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { parseDockerfile, StepTracker } from './parse.js';

const reason = (fn: () => unknown): unknown => {
  try {
    fn();
  } catch (err) {
    assert.ok(isDsecError(err, 'invalid_argument'), String(err));
    return { reason: err.details?.['reason'], line: err.details?.['line'] };
  }
  assert.fail('expected invalid_argument');
};

void test('stages, continuations, comments and lines', () => {
  const p = parseDockerfile(
    [
      '# syntax=docker/dockerfile:1',
      'ARG V=1',
      'FROM reg.example:5000/base:$V AS build',
      'RUN echo a \\',
      '  # a comment inside a continuation',
      '  && echo b',
      '',
      'COPY . /src',
      'from build as final',
      'CMD ["sh"]',
    ].join('\n'),
  );
  assert.equal(p.globalArgs.length, 1);
  assert.deepEqual(
    p.stages.map((s) => [s.name, s.from, s.instructions.map((i) => [i.keyword, i.line])]),
    [
      [
        'build',
        'reg.example:5000/base:$V',
        [
          ['FROM', 3],
          ['RUN', 4],
          ['COPY', 8],
        ],
      ],
      [
        'final',
        'build',
        [
          ['FROM', 9],
          ['CMD', 10],
        ],
      ],
    ],
  );
  assert.equal(p.stages[0]!.instructions[1]!.text, 'RUN echo a   && echo b');
});

void test('the escape directive', () => {
  const p = parseDockerfile('# escape=`\nFROM x/y:1\nRUN echo a `\n  b\n');
  assert.equal(p.stages[0]!.instructions[1]!.args, 'echo a   b');
});

void test('refusals name their reason and line', () => {
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nFROB x\n')),
    { reason: 'syntax', line: 2 },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('RUN x\n')),
    { reason: 'syntax', line: 1 },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('# nothing\n')),
    { reason: 'syntax', line: undefined },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nADD https://x.example/f /f\n')),
    {
      reason: 'remote_add',
      line: 2,
    },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nADD --chown=1 git@github.com:a/b /f\n')),
    {
      reason: 'remote_add',
      line: 2,
    },
  );
  // A local ADD is fine.
  parseDockerfile('FROM a/b\nADD ./f.tar /f\n');
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nRUN --mount=type=cache,target=/c true\n')),
    {
      reason: 'run_flag',
      line: 2,
    },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nONBUILD RUN --network=host true\n')),
    {
      reason: 'run_flag',
      line: 2,
    },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\nRUN <<EOF\necho\nEOF\n')),
    {
      reason: 'heredoc',
      line: 2,
    },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\0\n')),
    { reason: 'syntax', line: undefined },
  );
});

void test('bounds: bytes and instructions', () => {
  assert.deepEqual(
    reason(() => parseDockerfile(`FROM a/b\n${'RUN true\n'.repeat(5)}`, { maxInstructions: 3 })),
    {
      reason: 'too_many_instructions',
      line: 4,
    },
  );
  assert.deepEqual(
    reason(() => parseDockerfile('FROM a/b\n'.repeat(100), { maxDockerfileBytes: 64 })),
    {
      reason: 'too_large',
      line: undefined,
    },
  );
  // An unterminated continuation does not make the parser hold more than the file.
  assert.equal(parseDockerfile(`FROM a/b\nRUN x \\\n${'y \\\n'.repeat(1000)}`).instructionCount, 2);
});

void test('StepTracker follows buildah STEP lines through the stages', () => {
  const p = parseDockerfile('FROM a/b AS one\nRUN x\nRUN y\nFROM one\nRUN z\n');
  const t = new StepTracker(p);
  assert.equal(t.step('STEP 1/3: FROM a/b AS one')?.instruction.line, 1);
  assert.equal(t.step('STEP 3/3: RUN y')?.instruction.line, 3);
  assert.equal(t.step('STEP 1/2: FROM one')?.instruction.line, 4);
  assert.equal(t.step('STEP 2/2: RUN z')?.instruction.line, 5);
  assert.equal(t.step('some output'), undefined);
});

import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { globCovers, globMatch, wildcardCount } from './glob.js';

/** The definition, by recursion: exponential, fine for a handful of characters. */
function matchesByDefinition(pattern: string, text: string): boolean {
  if (pattern === '') return text === '';
  if (pattern[0] === '*')
    return (
      matchesByDefinition(pattern.slice(1), text) ||
      (text !== '' && matchesByDefinition(pattern, text.slice(1)))
    );
  return (
    text !== '' && pattern[0] === text[0] && matchesByDefinition(pattern.slice(1), text.slice(1))
  );
}

/** Every string over `alphabet` of length 0..`maxLength`. */
function allStrings(alphabet: string, maxLength: number): string[] {
  const out = [''];
  let layer = [''];
  for (let n = 1; n <= maxLength; n++) {
    layer = layer.flatMap((s) => [...alphabet].map((c) => s + c));
    out.push(...layer);
  }
  return out;
}

/** Brute force: every string of `universe` that `wanted` matches, `held` matches. */
function includedIn(held: string, wanted: string, universe: readonly string[]): boolean {
  return universe.every((s) => !globMatch(wanted, s) || globMatch(held, s));
}

const pattern = (letters: string, maxLength = 6) =>
  fc.array(fc.constantFrom(...letters, '*'), { maxLength }).map((cs) => cs.join(''));
const text = (letters: string, maxLength = 8) =>
  fc.array(fc.constantFrom(...letters), { maxLength }).map((cs) => cs.join(''));

test('globMatch agrees with the definition on small alphabets', () => {
  fc.assert(
    fc.property(pattern('ab', 8), text('ab', 10), (p, t) => {
      assert.equal(globMatch(p, t), matchesByDefinition(p, t), `${p} ~ ${t}`);
    }),
    { numRuns: 5000 },
  );
  fc.assert(
    fc.property(pattern('a.-:', 6), text('a.-:', 8), (p, t) => {
      assert.equal(globMatch(p, t), matchesByDefinition(p, t), `${p} ~ ${t}`);
    }),
    { numRuns: 2000 },
  );
});

test('globMatch: edge cases, and characters a RegExp would read as syntax are literal', () => {
  for (const [p, t, want] of [
    ['', '', true],
    ['', 'a', false],
    ['*', '', true],
    ['**', 'abc', true],
    ['a*', 'a', true],
    ['*a', 'ba', true],
    ['a*a', 'a', false], // the two literal ends may not overlap
    ['a*b*a', 'aba', true],
    ['a*b*a', 'ab', false],
    ['.', 'x', false],
    ['a.b', 'a.b', true],
    ['(a|b)', 'a', false],
    ['[ab]', '[ab]', true],
  ] as const) {
    assert.equal(globMatch(p, t), want, `${p} ~ ${t}`);
  }
});

test('globCovers is sound: a yes means every string the wanted pattern matches, the held matches', () => {
  // Over {a,b} alone, which held patterns can use up: no false yes, whatever the patterns.
  const universe = allStrings('ab', 8);
  fc.assert(
    fc.property(pattern('ab', 5), pattern('ab', 5), (held, wanted) => {
      if (globCovers(held, wanted))
        assert.ok(includedIn(held, wanted, universe), `${held} ⊇ ${wanted}`);
    }),
    { numRuns: 3000 },
  );
});

test('globCovers is exact when the alphabet has a character the held pattern lacks', () => {
  // Patterns over {a,b}, strings over {a,b,c}. A counterexample, when there is one, is the
  // wanted pattern with each star read as `c`: no longer than the pattern itself.
  const universe = allStrings('abc', 6);
  fc.assert(
    fc.property(pattern('ab', 6), pattern('ab', 6), (held, wanted) => {
      assert.equal(
        globCovers(held, wanted),
        includedIn(held, wanted, universe),
        `${held} ⊇ ${wanted}`,
      );
    }),
    { numRuns: 3000 },
  );
  for (const [held, wanted, want] of [
    ['task-*', 'task-a*', true],
    ['task-*', 'task-*', true],
    ['*', '**', true],
    ['a*', '*', false],
    ['*a*', 'a*', true],
    ['a*b', 'a*c*b', true],
    ['a*c*b', 'a*b', false],
  ] as const) {
    assert.equal(globCovers(held, wanted), want, `${held} ⊇ ${wanted}`);
  }
});

test('globCovers refuses, never grants, where a held pattern uses up the alphabet', () => {
  // Over {a,b} every string a…b contains "ab", so `*ab*` does cover `a*b` there; over any larger
  // alphabet (a layer name's) it does not (`acb`). The refusal is the safe side.
  const universe = allStrings('ab', 8);
  assert.ok(includedIn('*ab*', 'a*b', universe));
  assert.equal(globCovers('*ab*', 'a*b'), false);
});

test('many stars against a long text answer at once (a backtracking RegExp takes hours)', () => {
  const evil = 'a*a*a*a*a*a*a*a*b';
  assert.equal(globMatch(evil, 'a'.repeat(120)), false);
  assert.equal(globMatch(evil, 'a'.repeat(4000)), false);
  assert.equal(globMatch(evil, `${'a'.repeat(4000)}b`), true);
  assert.equal(globMatch(`${'*a'.repeat(200)}b`, 'a'.repeat(4000)), false);
  assert.equal(globCovers(evil, 'a'.repeat(4000)), false);
  assert.equal(wildcardCount(evil), 8);
  assert.equal(wildcardCount('plain'), 0);
});

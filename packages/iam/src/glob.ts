/**
 * Glob patterns where `*` matches any run of characters (none included) and
 * every other character only itself: the patterns of key scopes
 * (`images:run:task-*`). Matched by hand, never through a RegExp, because the
 * patterns come from callers: a backtracking engine takes exponential time on
 * `a*a*a*a*a*a*a*a*b` against a long name (issue 24, SECURITY.md J38).
 *
 * Cost: `globMatch` splits the pattern at its stars and places each literal
 * piece at its leftmost fit after the previous one, so it looks at each text
 * position at most once per pattern character: O(n·m) for a text of n and a
 * pattern of m characters (at most 257 × 257 for layer references), whatever
 * the number of stars, with no backtracking and no allocation beyond the
 * pieces.
 */

/**
 * Whether `text` matches `pattern` as a whole. Leftmost placement of the
 * middle pieces is enough: any match can slide each piece left to its
 * leftmost fit without disturbing the others, since the stars around it
 * absorb the difference.
 */
export function globMatch(pattern: string, text: string): boolean {
  const pieces = pattern.split('*');
  const first = pieces[0]!;
  if (pieces.length === 1) return pattern === text;
  const last = pieces[pieces.length - 1]!;
  if (text.length < first.length + last.length) return false;
  if (!text.startsWith(first) || !text.endsWith(last)) return false;
  let at = first.length;
  const end = text.length - last.length;
  for (let i = 1; i < pieces.length - 1; i++) {
    const piece = pieces[i]!;
    const found = text.indexOf(piece, at);
    if (found < 0 || found + piece.length > end) return false;
    at = found + piece.length;
  }
  return true;
}

/**
 * Whether every text `wanted` matches, `held` matches too (the language of
 * `wanted` is inside that of `held`), decided as `held` matching `wanted`'s
 * own characters where a `*` of `wanted` can only be absorbed by a `*` of
 * `held`. Same cost as `globMatch`.
 *
 * Sound: a yes is always right (each `*` of `wanted` lies inside a `*` of
 * `held`, which absorbs whatever it stands for). Exact whenever the
 * alphabet has a character `held` does not use: then a `*` of `wanted` can
 * stand for that character, which only a `*` of `held` matches, so a no
 * comes with a text `wanted` matches and `held` does not. Over an alphabet
 * `held` uses up entirely (layer names have 39 characters; a 128-character
 * pattern can hold them all) it may say no where a clever `held` in fact
 * covers (`*ab*` covers `a*b` over the letters a and b alone): a refusal,
 * never a grant too many.
 */
export function globCovers(held: string, wanted: string): boolean {
  // `globMatch` treats the text's `*` as an ordinary character, which only a `*` of the
  // pattern can consume: exactly the rule above.
  return globMatch(held, wanted);
}

/** How many `*` the pattern has. */
export function wildcardCount(pattern: string): number {
  let n = 0;
  for (let i = 0; i < pattern.length; i++) if (pattern.charCodeAt(i) === 42) n++;
  return n;
}

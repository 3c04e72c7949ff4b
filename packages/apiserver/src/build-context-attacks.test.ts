import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { DEFAULT_BUILD_CONTEXT_LIMITS, unpackBuildContext } from './build-context.js';

// Attacks on the build context unpacker (adversarial review of h/imgbuild): an archive of
// few entries whose paths make many directories, which the entry bound did not count.

function header(name: string, type: string, size: number): Buffer {
  const h = Buffer.alloc(512);
  h.write(name, 0, 100, 'utf8');
  h.write('0000644\0', 100, 'latin1');
  h.write('0000000\0', 108, 'latin1');
  h.write('0000000\0', 116, 'latin1');
  h.write(size.toString(8).padStart(11, '0') + '\0', 124, 'latin1');
  h.write('00000000000\0', 136, 'latin1');
  h.write(type, 156, 'latin1');
  h.write('ustar\0', 257, 'latin1');
  h.write('00', 263, 'latin1');
  h.fill(0x20, 148, 156);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(sum.toString(8).padStart(6, '0') + '\0 ', 148, 'latin1');
  return h;
}

/** Empty regular files at `paths`, each named through a pax header (any length). */
function tar(paths: string[]): Buffer {
  const parts: Buffer[] = [];
  for (const path of paths) {
    const body = ` path=${path}\n`;
    let len = body.length + 1;
    while (`${len}${body}`.length !== len) len++;
    const pax = Buffer.from(`${len}${body}`);
    parts.push(
      header('PaxHeader', 'x', pax.length),
      pax,
      Buffer.alloc((512 - (pax.length % 512)) % 512),
    );
    parts.push(header('short', '0', 0));
  }
  parts.push(Buffer.alloc(1024));
  return Buffer.concat(parts);
}

async function unpack(
  t: { after: (fn: () => Promise<void>) => void },
  archive: Buffer,
  limits: Partial<typeof DEFAULT_BUILD_CONTEXT_LIMITS>,
) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-ctx-attack-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  await writeFile(join(dir, 'a.tar'), archive);
  const dest = join(dir, 'ctx');
  await mkdir(dest);
  return {
    dest,
    run: () =>
      unpackBuildContext(join(dir, 'a.tar'), dest, { ...DEFAULT_BUILD_CONTEXT_LIMITS, ...limits }),
  };
}

const deep = (i: number, depth: number, width = 1) =>
  [...Array<undefined>(depth)]
    .map((_, d) => `${String(i)}-${String(d)}`.padEnd(width, 'x'))
    .join('/') + '/f';

test('the directories an entry path makes count as entries', async (t) => {
  // 5 entries, 40 directories each: 205 paths made, past a bound of 50.
  const { dest, run } = await unpack(t, tar([0, 1, 2, 3, 4].map((i) => deep(i, 40))), {
    maxEntries: 50,
  });
  await assert.rejects(
    run(),
    (e) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'context_too_large',
  );
  // It stopped at the bound: at most 50 paths were made.
  let made = 0;
  const walk = async (d: string): Promise<void> => {
    for (const x of await readdir(d, { withFileTypes: true })) {
      made++;
      if (x.isDirectory()) await walk(join(d, x.name));
    }
  };
  await walk(dest);
  assert.ok(made <= 50, `${made} paths made`);
});

test('the bytes of all recorded paths are bounded (they are kept in memory)', async (t) => {
  // 5 entries of 12 directories of 250-byte names: each prefix is kept, ~20 KB per entry.
  const { run } = await unpack(t, tar([0, 1, 2, 3, 4].map((i) => deep(i, 12, 250))), {
    maxTotalPathBytes: 40_000,
  });
  await assert.rejects(
    run(),
    (e) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'context_too_large',
  );
});

test('an ordinary context within the bounds unpacks, its directories counted', async (t) => {
  const { run } = await unpack(t, tar(['a/b/c', 'a/b/d', 'e']), { maxEntries: 5 });
  const u = await run();
  assert.equal(u.entries, 5);
  assert.equal(u.kindOf('a/b'), 'dir');
  assert.equal(u.kindOf('a/b/d'), 'file');
});

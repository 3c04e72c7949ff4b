import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import prettier from 'prettier';

const pkg = dirname(dirname(fileURLToPath(import.meta.url)));
const bin = (name: string) => join(pkg, '..', '..', 'node_modules', '.bin', name);

/** src/gen is generated from proto/ (`npm run generate -w @dsec/e2b`); a stale copy fails here. */
test('the generated protocol code matches the protos', async () => {
  const out = await mkdtemp(join(tmpdir(), 'dsec-e2b-gen-'));
  try {
    await promisify(execFile)(bin('buf'), ['generate', '-o', out], {
      cwd: pkg,
      env: {
        ...process.env,
        PATH: `${join(pkg, 'node_modules', '.bin')}:${dirname(bin('buf'))}:${process.env.PATH ?? ''}`,
      },
    });
    for (const file of ['process/process_pb.ts', 'filesystem/filesystem_pb.ts']) {
      const fresh = (await readFile(join(out, 'src', 'gen', file), 'utf8')).replace(
        /^\/\* eslint-disable \*\/\n/m,
        '',
      );
      const committed = join(pkg, 'src', 'gen', file);
      const options = { ...(await prettier.resolveConfig(committed)), filepath: committed };
      assert.equal(
        await prettier.format(fresh, options),
        await readFile(committed, 'utf8'),
        `${file} is stale: run npm run generate -w @dsec/e2b`,
      );
    }
  } finally {
    await rm(out, { recursive: true, force: true });
  }
});

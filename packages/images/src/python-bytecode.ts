import { execFile } from 'node:child_process';
import { access, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { throwIfAborted } from '@dsec/core';

/** What `compilePythonBytecode` compiled, or why it did not. */
export interface PythonBytecodeResult {
  /** The interpreter versions whose modules were compiled (`3.11`). */
  versions: string[];
  /** Set when an interpreter in the tree could not run on this host: the layer works, only slower. */
  skipped?: string | undefined;
}

/**
 * Compiles the Python modules of an unpacked debs tree to bytecode, the
 * work Debian's maintainer scripts do on an installed system (py3compile
 * for each python3-* package, compileall for the standard library) and
 * that `dpkg-deb -x` leaves out. Without it every process in every sandbox
 * compiles the modules it imports, and a read-only layer (or `python3 -B`)
 * never keeps the result: a pytest run spends about two thirds of its CPU
 * compiling pytest and the standard library.
 *
 * The tree's own interpreter compiles (so the bytecode matches it), with
 * paths recorded as they appear in the sandbox (`/usr/lib/…`). The
 * invalidation mode is `checked-hash`: layers normalise timestamps, so
 * timestamp checks would reject every file, and an unchecked hash would
 * keep running the layer's bytecode after a sandbox (an agent) edits the
 * source in its writable layer; hashing a source on import costs far less
 * than compiling it.
 * Files that do not compile (Python 2 test data some packages ship) are
 * left as they are, as py3compile does.
 */
export async function compilePythonBytecode(
  tree: string,
  options: { signal?: AbortSignal | undefined } = {},
): Promise<PythonBytecodeResult> {
  const lib = join(tree, 'usr', 'lib');
  const versions = (await readdir(lib).catch(() => [] as string[]))
    .map((name) => /^python(3\.\d+)$/.exec(name)?.[1])
    .filter((v): v is string => v !== undefined)
    .sort();
  const done: string[] = [];
  for (const version of versions) {
    throwIfAborted(options.signal);
    const interpreter = join(tree, 'usr', 'bin', `python${version}`);
    // A toolkit adding modules to a base's interpreter has none of its own: nothing to run here.
    if (!(await exists(interpreter))) continue;
    const dirs = [join(lib, `python${version}`)];
    const shared = join(lib, 'python3', 'dist-packages');
    if (await exists(shared)) dirs.push(shared);
    const code = await run(
      interpreter,
      [
        // Isolated and without site: the host's site-packages play no part. -B: the
        // modules compileall itself imports would otherwise be cached with timestamps
        // first, which a sandbox finds stale; -f rewrites any such file.
        '-I',
        '-S',
        '-B',
        '-m',
        'compileall',
        '-f',
        '-q',
        '-j',
        '0',
        '--invalidation-mode',
        'checked-hash',
        '-s',
        tree,
        '-p',
        '/',
        ...dirs,
      ],
      options.signal,
    );
    // 1: some files did not compile (kept as source); anything else: the interpreter did not run.
    if (code !== 0 && code !== 1) {
      return {
        versions: done,
        skipped: `python${version} from the tree does not run on this host (exit ${code})`,
      };
    }
    done.push(version);
  }
  return { versions: done };
}

async function exists(path: string): Promise<boolean> {
  return access(path).then(
    () => true,
    () => false,
  );
}

function run(command: string, args: string[], signal: AbortSignal | undefined): Promise<number> {
  return new Promise((resolve, reject) => {
    execFile(
      command,
      args,
      { env: { PATH: '/usr/bin:/bin', LANG: 'C.UTF-8' }, maxBuffer: 16 * 1024 * 1024, signal },
      (err) => {
        if (!err) return resolve(0);
        if (signal?.aborted) return reject(signal.reason as Error);
        const code = (err as { code?: unknown }).code;
        // ENOENT/EACCES and friends (a binary for another architecture): it did not run.
        resolve(typeof code === 'number' ? code : 127);
      },
    );
  });
}

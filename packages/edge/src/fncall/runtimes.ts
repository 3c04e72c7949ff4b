import { DsecError } from '@dsec/core';

/**
 * A FnCall runtime: an image (with python3, which runs the worker's zygote)
 * and how a call's program runs in it. Operators add runtimes by
 * configuration (`FnCallPoolsOptions.runtimes`).
 */
export interface FnCallRuntime {
  /** The name calls give as `language`. */
  name: string;
  /** Base image of the worker sandboxes. */
  image: string;
  toolkits?: string[] | undefined;
  /**
   * `python`: the code runs in the zygote's already-started interpreter after
   * a fork (the fast path). `exec`: the child execs `command`.
   */
  mode: 'python' | 'exec';
  /** For `exec`: argv, with `{entry}` replaced by the program file's path; the call's args follow. */
  command?: string[] | undefined;
  /** The program's file name in the call's work dir (`main.py`). */
  entry: string;
  /** Memory of a call when it names none (the data segment limit, RLIMIT_DATA). */
  defaultMemoryMb: number;
  /** The most a call may ask for; the worker sandbox's memory ceiling is this plus the zygote's share. */
  maxMemoryMb: number;
  /** Modules the python zygote imports once, so calls find them loaded. */
  preload?: string[] | undefined;
  /** Environment of every call before the call's own (PATH, LANG). */
  env?: Record<string, string> | undefined;
  /**
   * What the runtime writes on stderr when a program runs out of memory: a
   * failed call (non-zero exit or a signal) whose stderr holds one ends as
   * `oom` (the python fast path reports a `MemoryError` by itself).
   */
  oomMessages?: string[] | undefined;
}

const BASE_ENV = {
  PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
  LANG: 'C.UTF-8',
};

/** python, node and bash on the images `prepareFnCallImages` builds. */
export const DEFAULT_FNCALL_RUNTIMES: readonly FnCallRuntime[] = [
  {
    name: 'python',
    image: 'fncall-base',
    mode: 'python',
    entry: 'main.py',
    defaultMemoryMb: 512,
    maxMemoryMb: 2048,
    env: { ...BASE_ENV, PYTHONDONTWRITEBYTECODE: '1', PYTHONUNBUFFERED: '' },
    preload: [
      'math',
      're',
      'collections',
      'itertools',
      'functools',
      'heapq',
      'bisect',
      'string',
      'random',
      'json',
      'decimal',
      'fractions',
      'statistics',
      'typing',
      'dataclasses',
      'traceback',
      'io',
      'types',
      'atexit',
      'copy',
      'operator',
    ],
  },
  {
    name: 'node',
    image: 'fncall-base',
    toolkits: ['fncall-node'],
    mode: 'exec',
    command: ['node', '{entry}'],
    entry: 'main.js',
    defaultMemoryMb: 512,
    maxMemoryMb: 2048,
    env: BASE_ENV,
    // V8 aborts on a full heap (SIGABRT) or fails a large allocation with a RangeError.
    oomMessages: [
      'JavaScript heap out of memory',
      'Fatal process out of memory',
      'Array buffer allocation failed',
    ],
  },
  {
    name: 'bash',
    image: 'fncall-base',
    mode: 'exec',
    command: ['bash', '{entry}'],
    entry: 'main.sh',
    defaultMemoryMb: 256,
    maxMemoryMb: 2048,
    env: BASE_ENV,
  },
];

const RUNTIME_NAME = /^[a-z][a-z0-9_-]{0,31}$/;
const ENTRY_NAME = /^[A-Za-z0-9_.-]{1,64}$/;

/** Checks operator-given runtimes; names are unique, `exec` ones have a command. */
export function validateRuntimes(runtimes: readonly FnCallRuntime[]): Map<string, FnCallRuntime> {
  const byName = new Map<string, FnCallRuntime>();
  for (const [i, r] of runtimes.entries()) {
    const bad = (msg: string): never => {
      throw new DsecError('invalid_argument', `fncall runtime ${i} (${r.name}): ${msg}`, {
        field: `fncall.runtimes.${i}`,
      });
    };
    if (!RUNTIME_NAME.test(r.name)) bad('bad name');
    if (byName.has(r.name)) bad('name given twice');
    if (!ENTRY_NAME.test(r.entry) || r.entry.startsWith('.')) bad('bad entry file name');
    if (r.mode === 'exec' && !(r.command && r.command.length > 0))
      bad('exec runtimes need a command');
    if (!(r.defaultMemoryMb > 0 && r.maxMemoryMb >= r.defaultMemoryMb)) bad('bad memory sizes');
    byName.set(r.name, r);
  }
  return byName;
}

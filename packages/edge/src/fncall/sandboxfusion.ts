import type { EnvironmentRecipes } from '@dsec/images';
import { DEFAULT_FNCALL_RUNTIMES, type FnCallRuntime } from './runtimes.js';

/**
 * The FnCall runtimes behind the SandboxFusion-compatible endpoint
 * (docs/fncall.md "SandboxFusion-compatible endpoint"; the language table is
 * `SANDBOXFUSION_LANGUAGES` in @dsec/apiserver). Each is a python-mode
 * runtime: the apiserver sends its driver program, which compiles and runs
 * the caller's code in the call's work dir with the tools of the runtime's
 * image, one toolkit of Debian packages over `fncall-base` per language
 * family. The call's memory is the compilers' (`maxMemoryMb`); the driver
 * lowers it for the program itself to the request's `memory_limit_MB`.
 */
export interface SandboxFusionToolkit {
  /** The runtime's name (`sf-gcc`). */
  runtime: string;
  /** The toolkit image over `fncall-base`; absent: the base alone (python3, bash). */
  toolkit?: string | undefined;
  /** Debian packages of the toolkit. */
  debs: string[];
  /** The most memory a call (compiler included) may use. */
  maxMemoryMb: number;
}

export const SANDBOXFUSION_TOOLKITS: readonly SandboxFusionToolkit[] = [
  { runtime: 'sf-base', debs: [], maxMemoryMb: 2048 },
  {
    runtime: 'sf-gcc',
    toolkit: 'fncall-sf-gcc',
    debs: ['gcc', 'g++', 'libc6-dev'],
    maxMemoryMb: 2048,
  },
  { runtime: 'sf-go', toolkit: 'fncall-sf-go', debs: ['golang-go'], maxMemoryMb: 2048 },
  {
    runtime: 'sf-java',
    toolkit: 'fncall-sf-java',
    debs: ['default-jdk-headless'],
    maxMemoryMb: 4096,
  },
  { runtime: 'sf-rust', toolkit: 'fncall-sf-rust', debs: ['rustc'], maxMemoryMb: 2048 },
  {
    runtime: 'sf-node',
    toolkit: 'fncall-sf-node',
    debs: ['nodejs', 'node-typescript'],
    maxMemoryMb: 2048,
  },
  { runtime: 'sf-php', toolkit: 'fncall-sf-php', debs: ['php-cli'], maxMemoryMb: 2048 },
  { runtime: 'sf-lua', toolkit: 'fncall-sf-lua', debs: ['lua5.4'], maxMemoryMb: 2048 },
  { runtime: 'sf-perl', toolkit: 'fncall-sf-perl', debs: ['perl'], maxMemoryMb: 2048 },
  { runtime: 'sf-ruby', toolkit: 'fncall-sf-ruby', debs: ['ruby'], maxMemoryMb: 2048 },
  { runtime: 'sf-r', toolkit: 'fncall-sf-r', debs: ['r-base-core'], maxMemoryMb: 2048 },
  {
    runtime: 'sf-pytest',
    toolkit: 'fncall-sf-pytest',
    debs: ['python3-pytest'],
    maxMemoryMb: 2048,
  },
  { runtime: 'sf-verilog', toolkit: 'fncall-sf-verilog', debs: ['iverilog'], maxMemoryMb: 2048 },
  { runtime: 'sf-racket', toolkit: 'fncall-sf-racket', debs: ['racket'], maxMemoryMb: 2048 },
  { runtime: 'sf-d', toolkit: 'fncall-sf-d', debs: ['gdc'], maxMemoryMb: 2048 },
  { runtime: 'sf-csharp', toolkit: 'fncall-sf-csharp', debs: ['mono-mcs'], maxMemoryMb: 2048 },
];

const BASE_ENV = {
  PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
  LANG: 'C.UTF-8',
};

/** The runtimes: python mode (the driver is Python), with the toolkit's tools on PATH. */
export const SANDBOXFUSION_RUNTIMES: readonly FnCallRuntime[] = SANDBOXFUSION_TOOLKITS.map((t) => ({
  name: t.runtime,
  image: 'fncall-base',
  ...(t.toolkit ? { toolkits: [t.toolkit] } : {}),
  mode: 'python' as const,
  entry: 'sandboxfusion_driver.py',
  defaultMemoryMb: t.maxMemoryMb,
  maxMemoryMb: t.maxMemoryMb,
  env: { ...BASE_ENV, PYTHONDONTWRITEBYTECODE: '1' },
  // The driver's own imports and the python runtime's, loaded once in the zygote.
  preload: [
    ...new Set([
      'base64',
      'json',
      'selectors',
      'signal',
      'time',
      'types',
      'traceback',
      'stat',
      'linecache',
      'resource',
      ...(DEFAULT_FNCALL_RUNTIMES.find((r) => r.name === 'python')?.preload ?? []),
    ]),
  ],
}));

/** Image recipes of the toolkits (built by `prepareFnCallImages` with `sandboxfusion`). */
export const SANDBOXFUSION_IMAGE_RECIPES: EnvironmentRecipes = Object.fromEntries(
  SANDBOXFUSION_TOOLKITS.filter((t) => t.toolkit !== undefined).map((t) => [
    t.toolkit!,
    { kind: 'toolkit' as const, debs: t.debs, base: 'fncall-base' },
  ]),
);

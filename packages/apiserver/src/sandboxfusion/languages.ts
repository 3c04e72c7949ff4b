/**
 * SandboxFusion's languages (its `Language` literal, sandbox/runners/types.py
 * at bytedance/SandboxFusion@469de08) that DSec runs, each on a FnCall
 * runtime of `SANDBOXFUSION_RUNTIMES` (@dsec/edge) built from Debian's
 * packages, plus `c`. A step is either an argv run in the call's work dir or
 * `{ python }`: the file run by the runtime's own interpreter after a fork
 * (no interpreter start per call).
 */
export type SandboxFusionStep =
  { argv: string[]; env?: Record<string, string> } | { python: string };

export interface SandboxFusionLanguage {
  /** The FnCall runtime that has its tools. */
  runtime: string;
  /** The file the request's `code` is written to, in the work dir. */
  source: string;
  /** The compile step (its own `compile_timeout`); absent: the language runs its source. */
  compile?: SandboxFusionStep | undefined;
  run: SandboxFusionStep;
  /**
   * A default FnCall runtime that runs this language's run step exactly
   * (`python`, `bash`, `node`): a call with one step, nothing to fetch and
   * text files only goes to it as a plain FnCall, FnCall's own fast path.
   */
  native?: string | undefined;
  /** Rewrites the code before it is written (php's opening tag). */
  prepare?: ((code: string) => string) | undefined;
  /** The runtime's `maxMemoryMb` (SANDBOXFUSION_TOOLKITS in @dsec/edge): the most `memory_limit_MB`. */
  maxMemoryMb: number;
  /** Debian packages its tools come from (documentation, `GET /sandboxfusion/languages`). */
  debian: string;
}

const GO_ENV = {
  GOCACHE: '/tmp/sf-go-cache',
  GOPATH: '/tmp/sf-go',
  GO111MODULE: 'off',
  GOTOOLCHAIN: 'local',
  CGO_ENABLED: '0',
};

const sh = (script: string): SandboxFusionStep => ({ argv: ['/bin/sh', '-c', script] });

export const SANDBOXFUSION_LANGUAGES: Readonly<Record<string, SandboxFusionLanguage>> = {
  python: {
    runtime: 'sf-base',
    maxMemoryMb: 2048,
    native: 'python',
    source: 'main.py',
    run: { python: 'main.py' },
    debian: 'python3',
  },
  bash: {
    runtime: 'sf-base',
    maxMemoryMb: 2048,
    native: 'bash',
    source: 'main.sh',
    run: { argv: ['/bin/bash', 'main.sh'] },
    debian: 'bash',
  },
  c: {
    runtime: 'sf-gcc',
    maxMemoryMb: 2048,
    source: 'main.c',
    compile: { argv: ['gcc', '-O2', 'main.c', '-o', 'test', '-lm'] },
    run: { argv: ['./test'] },
    debian: 'gcc',
  },
  cpp: {
    runtime: 'sf-gcc',
    maxMemoryMb: 2048,
    source: 'main.cpp',
    compile: { argv: ['g++', '-std=c++17', 'main.cpp', '-o', 'test', '-lpthread'] },
    run: { argv: ['./test'] },
    debian: 'g++',
  },
  go: {
    runtime: 'sf-go',
    maxMemoryMb: 2048,
    source: 'main.go',
    compile: { argv: ['go', 'build', '-o', 'out', 'main.go'], env: GO_ENV },
    run: { argv: ['./out'] },
    debian: 'golang-go',
  },
  go_test: {
    runtime: 'sf-go',
    maxMemoryMb: 2048,
    source: 'main_test.go',
    run: { argv: ['go', 'test', 'main_test.go'], env: GO_ENV },
    debian: 'golang-go',
  },
  java: {
    runtime: 'sf-java',
    maxMemoryMb: 4096,
    source: 'Main.java',
    // /usr/bin/javac is an alternatives link the package's scripts make; the JDK's own path is not.
    compile: { argv: ['/usr/lib/jvm/default-java/bin/javac', '-cp', '.', 'Main.java'] },
    run: { argv: ['/usr/lib/jvm/default-java/bin/java', '-cp', '.', '-ea', 'Main'] },
    debian: 'default-jdk-headless',
  },
  rust: {
    runtime: 'sf-rust',
    maxMemoryMb: 2048,
    source: 'main.rs',
    // `cc` is an alternatives link; gcc is the linker rustc's package depends on.
    compile: { argv: ['rustc', '-C', 'linker=gcc', 'main.rs', '-o', 'test'] },
    run: { argv: ['./test'] },
    debian: 'rustc',
  },
  nodejs: {
    runtime: 'sf-node',
    maxMemoryMb: 2048,
    native: 'node',
    source: 'main.js',
    run: { argv: ['node', 'main.js'] },
    debian: 'nodejs',
  },
  typescript: {
    runtime: 'sf-node',
    maxMemoryMb: 2048,
    source: 'main.ts',
    // As SandboxFusion's tsx: types are stripped, never checked (tsc emits despite type errors).
    run: sh(
      'tsc --target es2020 --module commonjs --skipLibCheck --outDir .sf-ts main.ts >/dev/null 2>&1; exec node .sf-ts/main.js',
    ),
    debian: 'node-typescript, nodejs',
  },
  php: {
    runtime: 'sf-php',
    maxMemoryMb: 2048,
    source: 'main.php',
    // /usr/bin/php is an alternatives link: the versioned binary the package installs.
    run: sh(
      'for p in /usr/bin/php /usr/bin/php[0-9]*; do [ -x "$p" ] && exec "$p" -f main.php; done; exit 127',
    ),
    prepare: (code) => (code.includes('<?php') ? code : `<?php\n${code}`),
    debian: 'php-cli',
  },
  lua: {
    runtime: 'sf-lua',
    maxMemoryMb: 2048,
    source: 'main.lua',
    run: { argv: ['lua5.4', 'main.lua'] },
    debian: 'lua5.4',
  },
  perl: {
    runtime: 'sf-perl',
    maxMemoryMb: 2048,
    source: 'main.pl',
    run: { argv: ['perl', 'main.pl'] },
    debian: 'perl',
  },
  ruby: {
    runtime: 'sf-ruby',
    maxMemoryMb: 2048,
    source: 'main.rb',
    run: { argv: ['ruby', 'main.rb'] },
    debian: 'ruby',
  },
  R: {
    runtime: 'sf-r',
    maxMemoryMb: 2048,
    source: 'main.R',
    // libblas.so.3 and liblapack.so.3 are alternatives links: R finds them in their own directories.
    run: {
      argv: ['Rscript', 'main.R'],
      env: {
        LD_LIBRARY_PATH: [
          '/usr/lib/x86_64-linux-gnu/blas',
          '/usr/lib/x86_64-linux-gnu/lapack',
          '/usr/lib/aarch64-linux-gnu/blas',
          '/usr/lib/aarch64-linux-gnu/lapack',
        ].join(':'),
      },
    },
    debian: 'r-base-core',
  },
  pytest: {
    runtime: 'sf-pytest',
    maxMemoryMb: 2048,
    source: 'test_main.py',
    run: { argv: ['python3', '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'test_main.py'] },
    debian: 'python3-pytest',
  },
  verilog: {
    runtime: 'sf-verilog',
    maxMemoryMb: 2048,
    source: 'main.sv',
    compile: {
      argv: [
        'iverilog',
        '-Wall',
        '-Winfloop',
        '-Wno-timescale',
        '-g2012',
        '-s',
        'tb',
        '-o',
        'test.vvp',
        'main.sv',
      ],
    },
    run: { argv: ['vvp', '-n', 'test.vvp'] },
    debian: 'iverilog',
  },
  racket: {
    runtime: 'sf-racket',
    maxMemoryMb: 2048,
    source: 'main.rkt',
    run: { argv: ['racket', 'main.rkt'] },
    debian: 'racket',
  },
  D_ut: {
    runtime: 'sf-d',
    maxMemoryMb: 2048,
    source: 'main.d',
    compile: { argv: ['gdc', '-funittest', 'main.d', '-o', 'test'] },
    run: { argv: ['./test'] },
    debian: 'gdc',
  },
  csharp: {
    runtime: 'sf-csharp',
    maxMemoryMb: 2048,
    source: 'main.cs',
    compile: { argv: ['mcs', '-out:main.exe', 'main.cs'] },
    run: sh(
      'for m in /usr/bin/mono /usr/bin/mono-sgen; do [ -x "$m" ] && exec "$m" main.exe; done; exit 127',
    ),
    debian: 'mono-mcs',
  },
};

/** SandboxFusion's languages DSec does not run, and why (answered with the error). */
export const SANDBOXFUSION_MISSING: Readonly<Record<string, string>> = {
  sql: 'not offered',
  julia: 'Debian does not package julia',
  kotlin_script: 'Debian does not package kotlin',
  jest: 'Debian does not package jest',
  junit: 'not offered',
  lean: 'Debian does not package lean 4',
  swift: 'not offered',
  scala: 'not offered',
  cuda: 'GPU languages are not offered on this endpoint (use FnCall with gpu, docs/gpu.md)',
  python_gpu: 'GPU languages are not offered on this endpoint (use FnCall with gpu, docs/gpu.md)',
};

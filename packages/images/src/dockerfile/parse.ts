import { DsecError } from '@dsec/core';
import { assertRegistryRef } from './onbuild.js';

/** One instruction of a Dockerfile as written: its keyword, arguments and first line (1-based). */
export interface DockerfileInstruction {
  /** Upper case: `FROM`, `RUN`, `COPY`, … */
  keyword: string;
  /** The text after the keyword, continuation lines joined (escape and newline removed). */
  args: string;
  /** The line the instruction starts on. */
  line: number;
  /** `KEYWORD args` as one line, as buildah prints it in `STEP k/n: …`. */
  text: string;
}

/** A build stage: its `FROM` and what follows it, in order (the `FROM` is `instructions[0]`). */
export interface DockerfileStage {
  /** `AS name`, lower case, when given. */
  name?: string | undefined;
  /** The image reference (or an earlier stage's name) after `FROM`, as written. */
  from: string;
  instructions: DockerfileInstruction[];
}

export interface ParsedDockerfile {
  /** `ARG`s before the first `FROM` (not build steps). */
  globalArgs: DockerfileInstruction[];
  stages: DockerfileStage[];
  /** Every instruction, global `ARG`s included. */
  instructionCount: number;
}

export interface DockerfileLimits {
  /** Bytes of the Dockerfile (default {@link DEFAULT_MAX_DOCKERFILE_BYTES}). */
  maxDockerfileBytes?: number | undefined;
  /** Instructions in it (default {@link DEFAULT_MAX_INSTRUCTIONS}). */
  maxInstructions?: number | undefined;
}

/** 1 MiB: a hundred times the largest Dockerfile of the public task suites we read. */
export const DEFAULT_MAX_DOCKERFILE_BYTES = 1024 * 1024;
/** 1000 instructions (a stage per instruction would still be far below it). */
export const DEFAULT_MAX_INSTRUCTIONS = 1000;

const KEYWORDS = new Set([
  'FROM',
  'RUN',
  'CMD',
  'LABEL',
  'MAINTAINER',
  'EXPOSE',
  'ENV',
  'ADD',
  'COPY',
  'ENTRYPOINT',
  'VOLUME',
  'USER',
  'WORKDIR',
  'ARG',
  'ONBUILD',
  'STOPSIGNAL',
  'HEALTHCHECK',
  'SHELL',
]);

/**
 * Parses a Dockerfile far enough to bound it, to refuse what would leave
 * DSec's egress policy or the build context, and to name the instruction and
 * line of a failed step: parser directives (`# escape=`), comments, line
 * continuations, keywords, stages. A malformed file is `invalid_argument`
 * (field `dockerfile`, `details.line`). Refused on purpose, each with
 * `details.reason`:
 * - `ADD` of a URL or git repository (`remote_add`): buildah fetches it from
 *   the host, outside the build's network policy; fetch it in a `RUN`.
 * - `RUN --mount`/`--network`/`--security` (`run_flag`): bind mounts, caches
 *   shared between builds, and host networking are not part of a sandbox's
 *   world.
 * - heredocs (`heredoc`): buildah 1.28 does not run them.
 * - `COPY --from=` an image named by a transport (`image_transport`:
 *   `oci:/path`, `docker-archive:/file`): buildah would read the host's files.
 */
export function parseDockerfile(text: string, limits: DockerfileLimits = {}): ParsedDockerfile {
  const maxBytes = limits.maxDockerfileBytes ?? DEFAULT_MAX_DOCKERFILE_BYTES;
  const maxInstructions = limits.maxInstructions ?? DEFAULT_MAX_INSTRUCTIONS;
  if (Buffer.byteLength(text) > maxBytes) {
    throw bad(`the Dockerfile is larger than ${maxBytes} bytes`, 0, 'too_large', {
      maxDockerfileBytes: maxBytes,
    });
  }
  if (text.includes('\0')) throw bad('the Dockerfile holds a NUL byte', 0, 'syntax');
  const lines = text.split(/\r?\n/);
  let escape = '\\';
  // Parser directives: `# key=value` lines at the very top only.
  for (const raw of lines) {
    const m = /^#\s*([A-Za-z]+)\s*=\s*(\S+)\s*$/.exec(raw);
    if (!m) break;
    if (m[1]!.toLowerCase() === 'escape') {
      if (m[2] !== '\\' && m[2] !== '`') {
        throw bad('the escape directive must be \\ or `', 1, 'syntax');
      }
      escape = m[2];
    }
  }

  const instructions: DockerfileInstruction[] = [];
  let current: { line: number; parts: string[] } | undefined;
  for (const [i, raw] of lines.entries()) {
    const lineNo = i + 1;
    const trimmed = raw.trim();
    // Comments and blank lines, also between continued lines.
    if (trimmed === '' || trimmed.startsWith('#')) continue;
    const continues = raw.trimEnd().endsWith(escape);
    const body = continues ? raw.trimEnd().slice(0, -1) : raw;
    if (current) current.parts.push(body);
    else current = { line: lineNo, parts: [body] };
    if (!continues) {
      instructions.push(instruction(current.parts.join(''), current.line));
      current = undefined;
      if (instructions.length > maxInstructions) {
        throw bad(`more than ${maxInstructions} instructions`, lineNo, 'too_many_instructions', {
          maxInstructions,
        });
      }
    }
  }
  if (current) instructions.push(instruction(current.parts.join(''), current.line));

  const globalArgs: DockerfileInstruction[] = [];
  const stages: DockerfileStage[] = [];
  for (const ins of instructions) {
    if (ins.keyword === 'FROM') {
      const words = ins.args.split(/\s+/).filter((w) => !w.startsWith('--'));
      if (words.length !== 1 && !(words.length === 3 && words[1]!.toLowerCase() === 'as')) {
        throw bad('FROM takes an image and an optional AS name', ins.line, 'syntax');
      }
      stages.push({
        from: words[0]!,
        ...(words[2] !== undefined ? { name: words[2].toLowerCase() } : {}),
        instructions: [ins],
      });
      continue;
    }
    const stage = stages.at(-1);
    if (!stage) {
      if (ins.keyword !== 'ARG') {
        throw bad(`${ins.keyword} before the first FROM`, ins.line, 'syntax');
      }
      globalArgs.push(ins);
      continue;
    }
    stage.instructions.push(ins);
  }
  if (stages.length === 0) throw bad('the Dockerfile has no FROM', 0, 'syntax');
  return { globalArgs, stages, instructionCount: instructions.length };
}

function instruction(joined: string, line: number): DockerfileInstruction {
  const m = /^\s*([A-Za-z]+)(?:\s+([\s\S]*))?$/.exec(joined);
  if (!m) throw bad(`cannot read an instruction: ${clip(joined)}`, line, 'syntax');
  const keyword = m[1]!.toUpperCase();
  const args = (m[2] ?? '').trim();
  if (!KEYWORDS.has(keyword)) throw bad(`unknown instruction ${m[1]}`, line, 'syntax');
  if (args === '' && keyword !== 'FROM') {
    // Every instruction takes arguments; FROM's absence is reported below.
    throw bad(`${keyword} needs arguments`, line, 'syntax');
  }
  const checked = keyword === 'ONBUILD' ? (/^(\w+)\s*([\s\S]*)$/.exec(args) ?? []) : [];
  const inner = checked[1]?.toUpperCase();
  const target = inner ?? keyword;
  const targetArgs = inner !== undefined ? (checked[2] ?? '') : args;
  if (/<<-?["']?[A-Za-z_]/.test(targetArgs) && ['RUN', 'COPY', 'ADD'].includes(target)) {
    throw bad(`${target} with a heredoc: buildah 1.28 cannot run it`, line, 'heredoc');
  }
  if (target === 'RUN') {
    const flag = /^--(mount|network|security)\b/.exec(targetArgs);
    if (flag) {
      throw bad(
        `RUN --${flag[1]} is not allowed in a DSec build (a step runs in the build's sandbox only)`,
        line,
        'run_flag',
      );
    }
  }
  if (target === 'COPY' || target === 'ADD') {
    const from = /(?:^|\s)--from=(\S+)/.exec(targetArgs)?.[1];
    if (from !== undefined) assertRegistryRef(from.replace(/^["']|["']$/g, ''), line);
  }
  if (target === 'ADD') {
    const words = targetArgs.split(/\s+/).filter((w) => !w.startsWith('--'));
    const remote = words.slice(0, -1).find((w) => /^[a-z][a-z0-9+.-]*:\/\/|^git@/i.test(w));
    if (remote !== undefined) {
      throw bad(
        `ADD ${clip(remote)}: remote sources are fetched outside the build's network policy; fetch it in a RUN step`,
        line,
        'remote_add',
      );
    }
  }
  return { keyword, args, line, text: `${keyword} ${args}`.trim() };
}

function clip(s: string): string {
  return s.length > 80 ? `${s.slice(0, 80)}…` : s;
}

function bad(
  message: string,
  line: number,
  reason: string,
  extra: Record<string, unknown> = {},
): DsecError {
  return new DsecError(
    'invalid_argument',
    line > 0 ? `Dockerfile line ${line}: ${message}` : `Dockerfile: ${message}`,
    { field: 'dockerfile', details: { reason, ...(line > 0 ? { line } : {}), ...extra } },
  );
}

/**
 * Follows buildah's `STEP k/n: TEXT` lines through the stages: the stage
 * being built is the next one (from the last) whose instruction count is
 * `n`, entered at its `FROM` (k = 1). Gives the instruction a line names.
 */
export class StepTracker {
  readonly #stages: DockerfileStage[];
  #stage = -1;

  constructor(parsed: ParsedDockerfile) {
    this.#stages = parsed.stages;
  }

  /** The instruction of a `STEP k/n: …` line, or undefined when the line is none. */
  step(
    line: string,
  ): { instruction: DockerfileInstruction; done: number; total: number } | undefined {
    const m = /^STEP (\d+)\/(\d+): /.exec(line);
    if (!m) return undefined;
    const k = Number(m[1]);
    const n = Number(m[2]);
    const fits = (i: number): boolean => this.#stages[i]?.instructions.length === n;
    if (k === 1 || !fits(this.#stage)) {
      let next = -1;
      for (let i = Math.max(0, this.#stage + (k === 1 ? 1 : 0)); i < this.#stages.length; i++) {
        if (fits(i)) {
          next = i;
          break;
        }
      }
      if (next < 0) return undefined;
      this.#stage = next;
    }
    const instruction = this.#stages[this.#stage]?.instructions[k - 1];
    return instruction && { instruction, done: k, total: n };
  }
}

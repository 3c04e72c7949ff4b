import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Command } from 'commander';
import { DSecClient } from '@dsec/sdk';

export const DEFAULT_URL = 'http://127.0.0.1:7420';
export const DEFAULT_STATE_DIR = '/var/lib/dsec';

/** Where the CLI writes; tests inject these instead of process streams. */
export interface Writer {
  write(chunk: string): unknown;
  isTTY?: boolean | undefined;
}

export interface CliIo {
  stdout: Writer;
  stderr: Writer;
  /** Environment to read `DSEC_*` from; default `process.env`. */
  env: Record<string, string | undefined>;
  /** Fires on Ctrl-C (the bin wrapper wires SIGINT to it). */
  signal?: AbortSignal | undefined;
}

export interface GlobalOptions {
  url: string;
  apiKey: string | undefined;
  stateDir: string;
  /** The node's image store location (`--image-store`, env DSEC_IMAGE_STORE); default `<state-dir>/images`. */
  imageStore: string | undefined;
  json: boolean;
}

/**
 * What every command needs besides its own options: resolved global options,
 * a lazily made SDK client, the output streams, and the exit code to return.
 * Commands get it with `contextOf(command)`.
 */
export class CliContext {
  readonly io: CliIo;
  readonly program: Command;
  /** Set by commands whose exit code is not 0/1 (`sandbox exec`). */
  exitCode = 0;
  #client: DSecClient | undefined;

  constructor(io: CliIo, program: Command) {
    this.io = io;
    this.program = program;
  }

  get options(): GlobalOptions {
    const o = this.program.opts<{
      url?: string;
      apiKey?: string;
      stateDir?: string;
      imageStore?: string;
      json?: boolean;
    }>();
    const env = this.io.env;
    const stateDir = o.stateDir ?? env.DSEC_STATE_DIR ?? DEFAULT_STATE_DIR;
    return {
      url: o.url ?? env.DSEC_URL ?? DEFAULT_URL,
      apiKey: o.apiKey ?? env.DSEC_API_KEY ?? readAdminKey(stateDir),
      stateDir,
      imageStore: o.imageStore ?? (env.DSEC_IMAGE_STORE || undefined),
      json: o.json === true,
    };
  }

  get json(): boolean {
    return this.options.json;
  }

  get signal(): AbortSignal | undefined {
    return this.io.signal;
  }

  client(): DSecClient {
    if (!this.#client) {
      const { url, apiKey } = this.options;
      // An empty key (rather than undefined) keeps the SDK from reading process.env.
      this.#client = new DSecClient({ url, apiKey: apiKey ?? '' });
    }
    return this.#client;
  }

  out(text: string): void {
    this.io.stdout.write(text.endsWith('\n') ? text : text + '\n');
  }

  err(text: string): void {
    this.io.stderr.write(text.endsWith('\n') ? text : text + '\n');
  }

  printJson(value: unknown): void {
    this.io.stdout.write(JSON.stringify(value, null, 2) + '\n');
  }

  close(): void {
    this.#client?.close();
  }
}

const contexts = new WeakMap<Command, CliContext>();

export function attachContext(program: Command, ctx: CliContext): void {
  contexts.set(program, ctx);
}

/** The context of the `main()` run that owns `command` (any subcommand depth). */
export function contextOf(command: Command): CliContext {
  let c: Command | null = command;
  while (c) {
    const ctx = contexts.get(c);
    if (ctx) return ctx;
    c = c.parent;
  }
  throw new Error('command is not attached to a dsec program');
}

/** The admin key written by `dsec up`; absent or unreadable means no key. */
function readAdminKey(stateDir: string): string | undefined {
  try {
    const key = readFileSync(join(stateDir, 'admin.key'), 'utf8').trim();
    return key.length > 0 ? key : undefined;
  } catch {
    return undefined;
  }
}

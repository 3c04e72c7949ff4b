import type { CommandResult } from './wire.js';

/** One piece of a command's output, decoded as UTF-8 text per stream. */
export type CommandEvent = { type: 'stdout'; data: string } | { type: 'stderr'; data: string };

export interface OutputCallbacks {
  onStdout?: ((chunk: string) => void) | undefined;
  onStderr?: ((chunk: string) => void) | undefined;
}

/** Starts the request; `streaming` says whether output must be streamed (callbacks or iteration). */
export type Starter = (callbacks: OutputCallbacks, streaming: boolean) => Promise<CommandResult>;

/**
 * A command on its way: await it for the result, or iterate it for output
 * events as they come (the result is still there to await afterwards).
 *
 * ```ts
 * for await (const ev of sandbox.commands.run('make')) process.stdout.write(ev.data);
 * const { exitCode } = await sandbox.commands.run('make test');
 * ```
 */
export class CommandRun<R extends CommandResult = CommandResult>
  implements PromiseLike<R>, AsyncIterable<CommandEvent>
{
  readonly #start: Starter;
  readonly #callbacks: OutputCallbacks;
  #promise: Promise<R> | undefined;
  #queue: EventQueue | undefined;

  constructor(start: Starter, callbacks: OutputCallbacks = {}) {
    this.#start = start;
    this.#callbacks = callbacks;
  }

  /** The result (starts the command if nothing did yet). */
  get result(): Promise<R> {
    return this.#run();
  }

  then<A = R, B = never>(
    onfulfilled?: ((value: R) => A | PromiseLike<A>) | null,
    onrejected?: ((reason: unknown) => B | PromiseLike<B>) | null,
  ): Promise<A | B> {
    return this.#run().then(onfulfilled, onrejected);
  }

  catch<B = never>(onrejected?: ((reason: unknown) => B | PromiseLike<B>) | null): Promise<R | B> {
    return this.#run().catch(onrejected);
  }

  finally(onfinally?: (() => void) | null): Promise<R> {
    return this.#run().finally(onfinally);
  }

  [Symbol.asyncIterator](): AsyncIterator<CommandEvent> {
    if (!this.#queue) {
      if (this.#promise) throw new Error('iterate a command before awaiting it');
      this.#queue = new EventQueue();
      void this.#run();
    }
    return this.#queue[Symbol.asyncIterator]();
  }

  #run(): Promise<R> {
    if (!this.#promise) {
      const q = this.#queue;
      const { onStdout, onStderr } = this.#callbacks;
      const streaming = q !== undefined || onStdout !== undefined || onStderr !== undefined;
      this.#promise = this.#start(
        {
          onStdout: (data) => {
            onStdout?.(data);
            q?.push({ type: 'stdout', data });
          },
          onStderr: (data) => {
            onStderr?.(data);
            q?.push({ type: 'stderr', data });
          },
        },
        streaming,
      ) as Promise<R>;
      this.#promise.then(
        () => q?.end(),
        (err: unknown) => q?.end(err),
      );
      if (q) this.#promise.catch(() => undefined); // the iterator reports it
    }
    return this.#promise;
  }
}

/** Output events waiting for an async iterator. */
class EventQueue implements AsyncIterable<CommandEvent> {
  #items: CommandEvent[] = [];
  #done = false;
  #error: unknown;
  #wake: (() => void) | undefined;

  push(ev: CommandEvent): void {
    this.#items.push(ev);
    this.#wake?.();
  }

  end(error?: unknown): void {
    this.#done = true;
    this.#error = error;
    this.#wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<CommandEvent> {
    for (;;) {
      const ev = this.#items.shift();
      if (ev) {
        yield ev;
        continue;
      }
      if (this.#done) {
        if (this.#error !== undefined) throw this.#error as Error;
        return;
      }
      await new Promise<void>((r) => (this.#wake = r));
      this.#wake = undefined;
    }
  }
}

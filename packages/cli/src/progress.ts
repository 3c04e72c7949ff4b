/**
 * A tiny progress bar on stderr, dependency-free. Quiet (every call a no-op)
 * unless `enabled` and the stream is a TTY, so piped output and `--json`
 * stay clean. Redraws at most every `intervalMs`.
 *
 * @example
 * ```ts
 * const bar = createProgress({ label: 'uploading', total: bytes, enabled: !ctx.json, format: formatBytes });
 * for await (const chunk of source) bar.update((sent += chunk.length));
 * bar.done();
 * ```
 */
export interface ProgressOptions {
  label: string;
  /** Without a total the bar shows a spinner and the count. */
  total?: number | undefined;
  enabled: boolean;
  stream?:
    | { write(chunk: string): unknown; isTTY?: boolean | undefined; columns?: number | undefined }
    | undefined;
  /** Renders counts (`formatBytes` for byte totals); default plain numbers. */
  format?: ((n: number) => string) | undefined;
  intervalMs?: number | undefined;
}

export interface Progress {
  update(done: number, total?: number): void;
  /** Draws the final state and ends the line. */
  done(): void;
}

const SPINNER = ['|', '/', '-', '\\'];

export function createProgress(options: ProgressOptions): Progress {
  const stream = options.stream ?? process.stderr;
  if (!options.enabled || !stream.isTTY) return { update() {}, done() {} };
  const format = options.format ?? ((n: number) => String(n));
  const interval = options.intervalMs ?? 100;
  let total = options.total;
  let current = 0;
  let lastDraw = 0;
  let frame = 0;
  let finished = false;

  const draw = () => {
    lastDraw = Date.now();
    let line: string;
    if (total !== undefined && total > 0) {
      const ratio = Math.min(1, current / total);
      const width = Math.max(10, Math.min(40, (stream.columns ?? 80) - options.label.length - 40));
      const filled = Math.round(ratio * width);
      line = `${options.label} [${'#'.repeat(filled)}${'-'.repeat(width - filled)}] ${String(Math.floor(ratio * 100)).padStart(3)}% ${format(current)}/${format(total)}`;
    } else {
      line = `${options.label} ${finished ? ' ' : SPINNER[frame++ % SPINNER.length]} ${format(current)}`;
    }
    // \r + erase-line redraws in place without scrolling.
    stream.write(`\r\x1b[2K${line}`);
  };

  return {
    update(done, newTotal) {
      if (finished) return;
      current = done;
      if (newTotal !== undefined) total = newTotal;
      if (Date.now() - lastDraw >= interval) draw();
    },
    done() {
      if (finished) return;
      finished = true;
      draw();
      stream.write('\n');
    },
  };
}

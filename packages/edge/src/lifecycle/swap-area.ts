import { readdirSync, readFileSync, rmSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { runTool } from '../network/sys.js';
import { ensureDir, PRIVATE_DIR_MODE, PRIVATE_FILE_MODE } from '../state/host-state.js';

export interface SwapAreaOptions {
  /** Where the swap files live (the edge's `stateDir/swap`; a local disk that supports swap files). */
  dir: string;
  /** Total size of this edge's swap files; no file is added beyond it. */
  maxBytes: number;
  /** Size of one added file (one is at least as large as the pause that needs it). */
  chunkBytes: number;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/** Free swap kept beyond what a pause needs: other swap users and rounding. */
const MARGIN_BYTES = 64 * 2 ** 20;
const ALIGN_BYTES = 64 * 2 ** 20;
/** swapoff swaps every page back in; on a loaded host that can take minutes. */
const SWAPOFF_TIMEOUT_MS = 600_000;
const SWAPOFF_ATTEMPTS = 5;

/**
 * The swap space a pause pushes a sandbox's memory into (ADR 0012). The
 * host may have none: the edge adds swap files under its own state dir as
 * pauses need them, `chunkBytes` at a time up to `maxBytes`, and takes them
 * away again (`release`) when it closes with nothing paused. Disk is only
 * taken when something is paused, and only about as much as is paused.
 *
 * The files are ordinary swap areas to the kernel: it may also put other
 * processes' pages there under host-wide memory pressure (the files are the
 * host's only swap), which `swapoff` reads back in. Running sandboxes do not
 * swap: their RAM + swap limit equals their memory limit.
 *
 * Files are `swap-N` in `dir`. After an edge restart the active ones are
 * this edge's still (paused sandboxes' pages live in them); inactive ones
 * (after a reboot, or a failed `swapon`) hold nothing and are removed.
 */
export class SwapArea {
  readonly #o: SwapAreaOptions;
  /** Serialises `ensure` and `release`: two pauses must not both add a file for the same need. */
  #queue: Promise<unknown> = Promise.resolve();
  #scanned = false;

  constructor(options: SwapAreaOptions) {
    this.#o = options;
  }

  /**
   * Makes sure the host has `neededBytes` of free swap (plus a margin),
   * adding a file when it has not and `maxBytes` allows. Best effort: a
   * failure is logged and the pause reclaims what the swap there is allows.
   */
  ensure(neededBytes: number): Promise<void> {
    return this.#serial(async () => {
      this.#scan();
      const free = swapFreeBytes();
      if (free >= neededBytes + MARGIN_BYTES) return;
      const ours = this.files().reduce((sum, f) => sum + f.sizeBytes, 0);
      const want = alignUp(Math.max(this.#o.chunkBytes, neededBytes + MARGIN_BYTES - free));
      const size = Math.min(want, this.#o.maxBytes - ours);
      if (size < ALIGN_BYTES) {
        this.#o.log?.('pause swap space is at its limit', {
          freeBytes: free,
          neededBytes,
          maxBytes: this.#o.maxBytes,
        });
        return;
      }
      await this.#add(size).catch((err: unknown) =>
        this.#o.log?.('cannot add swap space for pauses', { err: String(err), sizeBytes: size }),
      );
    });
  }

  /**
   * Switches this edge's swap files off and removes them. `swapoff` reads
   * back whatever is in them (a paused sandbox's pages included, so the edge
   * calls this only with nothing paused); a file it fails to switch off
   * (not enough memory to take its pages back) stays, logged, and is reused.
   */
  release(): Promise<void> {
    return this.#serial(async () => {
      this.#scan();
      for (const f of this.files()) {
        try {
          await this.#swapoff(f.path);
          rmSync(f.path, { force: true });
        } catch (err) {
          this.#o.log?.('cannot switch a pause swap file off', { file: f.path, err: String(err) });
        }
      }
    });
  }

  /** This edge's active swap files. */
  files(): { path: string; sizeBytes: number; usedBytes: number }[] {
    const prefix = join(this.#o.dir, 'swap-');
    return activeSwaps().filter((s) => s.path.startsWith(prefix));
  }

  /**
   * `swapoff`, retried: it fails with EINVAL while the area is not writable,
   * which it is not for a moment while another swapoff of it runs; done when
   * the file is no longer active, whoever switched it off.
   */
  async #swapoff(path: string): Promise<void> {
    for (let attempt = 0; ; attempt++) {
      try {
        await runTool('swapoff', [path], { timeoutMs: SWAPOFF_TIMEOUT_MS });
        return;
      } catch (err) {
        if (!activeSwaps().some((s) => s.path === path)) return;
        if (attempt >= SWAPOFF_ATTEMPTS) throw err;
        await sleep(200 * (attempt + 1));
      }
    }
  }

  #serial<T>(fn: () => Promise<T>): Promise<T> {
    const next = this.#queue.then(fn, fn);
    this.#queue = next.catch(() => undefined);
    return next;
  }

  /** Once per process: drop files that are not active swap (nothing of value can be in them). */
  #scan(): void {
    if (this.#scanned) return;
    this.#scanned = true;
    ensureDir(this.#o.dir, PRIVATE_DIR_MODE);
    const active = new Set(this.files().map((f) => f.path));
    for (const name of readdirSync(this.#o.dir)) {
      const path = join(this.#o.dir, name);
      if (name.startsWith('swap-') && !active.has(path)) rmSync(path, { force: true });
    }
  }

  async #add(sizeBytes: number): Promise<void> {
    const names = new Set(readdirSync(this.#o.dir));
    let n = 0;
    while (names.has(`swap-${n}`)) n++;
    const path = join(this.#o.dir, `swap-${n}`);
    // Private from its first instant (it will hold sandboxes' memory).
    await (await open(path, 'wx', PRIVATE_FILE_MODE)).close();
    try {
      // Allocated, not sparse: the kernel refuses swap files with holes.
      await runTool('fallocate', ['-l', String(sizeBytes), path]);
      await runTool('mkswap', [path]);
      await runTool('swapon', [path]);
    } catch (err) {
      rmSync(path, { force: true });
      throw err;
    }
    this.#o.log?.('swap space added for pauses', { file: path, sizeBytes });
  }
}

/** The host's active swap areas (`/proc/swaps`; sizes there are in KiB). */
function activeSwaps(): { path: string; sizeBytes: number; usedBytes: number }[] {
  let text: string;
  try {
    text = readFileSync('/proc/swaps', 'utf8');
  } catch {
    return [];
  }
  return text
    .split('\n')
    .slice(1)
    .filter(Boolean)
    .map((line) => {
      const [path = '', , size = '0', used = '0'] = line.split(/\s+/);
      // /proc/swaps escapes blanks in names as octal.
      const name = path.replace(/\\([0-7]{3})/g, (_m, o: string) =>
        String.fromCharCode(parseInt(o, 8)),
      );
      return { path: name, sizeBytes: Number(size) * 1024, usedBytes: Number(used) * 1024 };
    });
}

function swapFreeBytes(): number {
  const meminfo = readFileSync('/proc/meminfo', 'utf8');
  return Number(/^SwapFree:\s+(\d+) kB$/m.exec(meminfo)?.[1] ?? 0) * 1024;
}

function alignUp(bytes: number): number {
  return Math.ceil(bytes / ALIGN_BYTES) * ALIGN_BYTES;
}

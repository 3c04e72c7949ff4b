import { posix } from 'node:path';
import { DsecError } from '@dsec/core';
import type { FileInfo } from '@dsec/core';

/**
 * Directory watching by polling. DSec's in-sandbox interface has no change
 * notification, so a watch lists the directory (and, recursive, its
 * subdirectories) and compares each listing with the previous one. What this
 * cannot see, docs/e2b.md says: a change undone within one interval, a
 * rename (a remove and a create), and writes that keep size and mtime.
 */

export type ChangeKind = 'create' | 'write' | 'remove' | 'chmod';

export interface DirChange {
  /** Path relative to the watched directory, as envd names it. */
  name: string;
  kind: ChangeKind;
  /** The entry after the change (absent for a removal). */
  entry?: FileInfo | undefined;
}

/** Entries one poll may list: a watch of a huge tree is refused, not slowed to a crawl. */
export const MAX_WATCHED_ENTRIES = 10_000;

export type Listing = Map<string, FileInfo>;

const KIND_ORDER: Record<ChangeKind, number> = { remove: 0, create: 1, write: 2, chmod: 3 };

export class DirPoller {
  #last: Listing | undefined;

  constructor(
    readonly root: string,
    readonly recursive: boolean,
    /** Lists one directory; `signal` is the signal of the call that polls (never the watch's creator's). */
    readonly list: (path: string, signal?: AbortSignal) => Promise<FileInfo[]>,
  ) {}

  /** Takes the first listing (the baseline); later `poll`s report changes against the previous one. */
  async start(signal?: AbortSignal): Promise<void> {
    this.#last = await this.#snapshot(signal);
  }

  async poll(signal?: AbortSignal): Promise<DirChange[]> {
    const next = await this.#snapshot(signal);
    const changes = this.#last ? diffListings(this.#last, next) : [];
    this.#last = next;
    return changes;
  }

  async #snapshot(signal: AbortSignal | undefined): Promise<Listing> {
    const out: Listing = new Map();
    const pending = [''];
    while (pending.length > 0) {
      const rel = pending.shift()!;
      const dir = rel === '' ? this.root : posix.join(this.root, rel);
      for (const f of await this.list(dir, signal)) {
        const name = rel === '' ? f.name : posix.join(rel, f.name);
        out.set(name, f);
        if (out.size > MAX_WATCHED_ENTRIES) {
          throw new DsecError(
            'resource_exhausted',
            `too many entries to watch under ${this.root} (more than ${MAX_WATCHED_ENTRIES})`,
          );
        }
        if (this.recursive && f.type === 'directory') pending.push(name);
      }
    }
    return out;
  }
}

/**
 * The changes between two listings, sorted by name; for one name a removal
 * comes first, then its creation, then the write of its content.
 */
export function diffListings(before: Listing, after: Listing): DirChange[] {
  const out: DirChange[] = [];
  for (const [name, old] of before) {
    const now = after.get(name);
    if (!now || now.type !== old.type) out.push({ name, kind: 'remove' });
  }
  for (const [name, now] of after) {
    const old = before.get(name);
    if (!old || old.type !== now.type) {
      out.push({ name, kind: 'create', entry: now });
      // envd (inotify) sees a new file's content written after its creation: CREATE, then WRITE.
      if (now.type === 'file' && now.size > 0) out.push({ name, kind: 'write', entry: now });
    } else if (now.type !== 'directory' && (old.size !== now.size || old.mtime !== now.mtime)) {
      out.push({ name, kind: 'write', entry: now });
    } else if (old.mode !== now.mode || old.uid !== now.uid || old.gid !== now.gid) {
      out.push({ name, kind: 'chmod', entry: now });
    }
  }
  return out.sort((a, b) =>
    a.name === b.name ? KIND_ORDER[a.kind] - KIND_ORDER[b.kind] : a.name < b.name ? -1 : 1,
  );
}

import { randomUUID } from 'node:crypto';
import { posix } from 'node:path';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { timestampFromMs } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError } from '@connectrpc/connect';
import type { HandlerContext, ServiceImpl } from '@connectrpc/connect';
import { DsecError, toDsecError } from '@dsec/core';
import type { FileInfo } from '@dsec/core';
import { envdUser } from '../auth.js';
import { toConnectError } from '../errors.js';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';
import { EventType, FileType } from '../gen/filesystem/filesystem_pb.js';
import type {
  EntryInfoSchema,
  Filesystem,
  FilesystemEventSchema,
} from '../gen/filesystem/filesystem_pb.js';
import { DirPoller } from './dir-poller.js';
import type { DirChange } from './dir-poller.js';
import { keepaliveMs } from './event-queue.js';
import { envdTargetKey, openTarget, requestHeaderOf, requestHeadersOf } from './rpc-context.js';
import { ensureParents, nameOf, OwnerNames, resolveSymlinks } from './sandbox-files.js';
import type { IdNames, LinkTarget } from './sandbox-files.js';

type EntryInit = MessageInitShape<typeof EntryInfoSchema>;
type EventInit = MessageInitShape<typeof FilesystemEventSchema>;

/** Unpolled non-streaming watchers are dropped after this long. */
const WATCHER_IDLE_MS = 10 * 60_000;
/** Non-streaming watchers per apiserver: one more is refused (never another's evicted). */
export const MAX_WATCHERS = 10_000;
/** Non-streaming watchers per project (and apiserver): one project cannot take them all. */
export const MAX_WATCHERS_PER_PROJECT = 256;
/** Entries one `ListDir` answers (all levels of its depth): a bigger tree is refused, not held. */
export const MAX_LIST_ENTRIES = 100_000;
/** Non-streaming watchers per sandbox (and apiserver): one more is refused. */
export const MAX_WATCHERS_PER_SANDBOX = 64;

export interface FilesystemServiceDeps {
  access: SandboxAccess;
  /** Time between two listings of a streamed watch. */
  watchIntervalMs: number;
}

interface Watcher {
  sandboxId: string;
  projectId: string;
  keyId: string;
  user: string | undefined;
  poller: DirPoller;
  includeEntry: boolean;
  lastUsedAt: number;
}

/**
 * envd's filesystem service over DSec's file operations. Paths may be
 * relative to the user's home, as in envd. Watching polls (see
 * `dir-poller.ts`): `WatchDir` streams what each poll finds;
 * `CreateWatcher` / `GetWatcherEvents` poll when asked, so an unread
 * watcher costs nothing; watchers live in the apiserver that made them.
 */
export function filesystemService({ access, watchIntervalMs }: FilesystemServiceDeps): {
  impl: ServiceImpl<typeof Filesystem>;
  close(): void;
} {
  // Not a BoundedMap: evicting the oldest would let one project drop every other's watchers.
  const watchers = new Map<string, Watcher>();
  const owners = new OwnerNames();
  const sweeper = setInterval(() => {
    const now = Date.now();
    for (const [id, w] of watchers) if (now - w.lastUsedAt > WATCHER_IDLE_MS) watchers.delete(id);
  }, 60_000);
  sweeper.unref();

  /** A sandbox that is gone takes its watchers and cached names with it. */
  function sandboxGone(sandboxId: string): void {
    for (const [id, w] of watchers) if (w.sandboxId === sandboxId) watchers.delete(id);
    owners.forget(sandboxId);
  }

  function isGone(err: unknown): boolean {
    const code = toDsecError(err).code;
    return code === 'sandbox_not_found' || code === 'sandbox_not_running';
  }

  /** envd's entries for DSec's: owners by name, symlinks by their target's type and path. */
  async function entries(
    sb: OpenedSandbox,
    files: readonly FileInfo[],
    user: string | undefined,
    signal: AbortSignal | undefined,
  ): Promise<EntryInit[]> {
    if (files.length === 0) return [];
    const links = files.filter((f) => f.type === 'symlink').map((f) => f.path);
    const [names, targets, metadata] = await Promise.all([
      owners.lookup(sb, files, signal),
      links.length > 0
        ? resolveSymlinks(sb, links, user, signal)
        : Promise.resolve(new Map<string, LinkTarget>()),
      access.metadata.get(
        sb,
        files.map((f) => f.path),
        user,
        signal,
      ),
    ]);
    return files.map((f) => {
      const entry = entryOf(f, names, targets.get(f.path));
      const meta = metadata.get(f.path);
      return meta && Object.keys(meta).length > 0 ? { ...entry, metadata: meta } : entry;
    });
  }

  async function target(ctx: HandlerContext, path: string) {
    const sb = await openTarget(access, ctx);
    const user = envdUser(requestHeadersOf(ctx));
    return { sb, user, path: await access.resolvePath(sb, path, user, ctx.signal) };
  }

  async function stat(
    sb: OpenedSandbox,
    path: string,
    user: string | undefined,
    signal: AbortSignal,
  ): Promise<EntryInit> {
    const info = await sb.io.statFile(sb.id, path, { user, signal });
    return (await entries(sb, [info], user, signal))[0]!;
  }

  async function watchTarget(
    ctx: HandlerContext,
    req: { path: string; recursive: boolean },
  ): Promise<{ sb: OpenedSandbox; user: string | undefined; poller: DirPoller }> {
    const { sb, user, path } = await target(ctx, req.path);
    const info = await sb.io.statFile(sb.id, path, { user, signal: ctx.signal });
    if (info.type !== 'directory') {
      throw new DsecError('invalid_argument', `path ${path} is not a directory`, { field: 'path' });
    }
    // Each poll lists with the signal of the call that polls: a non-streaming watcher
    // outlives the `CreateWatcher` call that made it.
    const poller = new DirPoller(path, req.recursive, (p, signal) =>
      sb.io.listDir(sb.id, p, { user, signal }),
    );
    await poller.start(ctx.signal);
    return { sb, user, poller };
  }

  /** Refuses one more watcher past the sandbox's, the project's or the apiserver's bound. */
  function roomForWatcher(sb: OpenedSandbox): void {
    let mine = 0;
    let project = 0;
    for (const w of watchers.values()) {
      if (w.sandboxId === sb.id) mine++;
      if (w.projectId === sb.principal.projectId) project++;
    }
    if (mine >= MAX_WATCHERS_PER_SANDBOX) {
      throw new DsecError(
        'resource_exhausted',
        `at most ${MAX_WATCHERS_PER_SANDBOX} watchers per sandbox: remove one first (RemoveWatcher)`,
      );
    }
    if (project >= MAX_WATCHERS_PER_PROJECT || watchers.size >= MAX_WATCHERS) {
      throw new DsecError(
        'resource_exhausted',
        project >= MAX_WATCHERS_PER_PROJECT
          ? `at most ${MAX_WATCHERS_PER_PROJECT} watchers per project: remove one first (RemoveWatcher)`
          : 'this server holds as many watchers as it may: try again later',
      );
    }
  }

  function ownedWatcher(sb: OpenedSandbox, id: string): Watcher {
    const w = watchers.get(id);
    // Another key's watcher is as absent as one that never existed.
    if (!w || w.sandboxId !== sb.id || w.keyId !== sb.principal.keyId) {
      throw new DsecError('not_found', `watcher ${JSON.stringify(id.slice(0, 80))} not found`);
    }
    w.lastUsedAt = Date.now();
    return w;
  }

  const impl: ServiceImpl<typeof Filesystem> = {
    async stat(req, ctx) {
      try {
        const { sb, user, path } = await target(ctx, req.path);
        return { entry: await stat(sb, path, user, ctx.signal) };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async makeDir(req, ctx) {
      try {
        const { sb, user, path } = await target(ctx, req.path);
        const opts = { user, signal: ctx.signal };
        try {
          await sb.io.mkdir(sb.id, path, opts);
        } catch (err) {
          const code = toDsecError(err).code;
          if (code === 'conflict') {
            throw new ConnectError(`directory ${path} already exists`, Code.AlreadyExists);
          }
          // envd (root) makes missing parents too, and where the user may not write,
          // owned by the user.
          const who = user ?? (await access.defaultUser(sb, ctx.signal));
          if (code !== 'not_found' && (who === 'root' || who === '0')) throw err;
          await ensureParents(access, sb, path, user, ctx.signal);
        }
        return { entry: await stat(sb, path, user, ctx.signal) };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async move(req, ctx) {
      try {
        const { sb, user, path: from } = await target(ctx, req.source);
        const to = await access.resolvePath(sb, req.destination, user, ctx.signal);
        // envd makes the destination's directory; DSec's rename does not.
        const parent = posix.dirname(to);
        try {
          await sb.io.statFile(sb.id, parent, { user, signal: ctx.signal });
        } catch (err) {
          if (toDsecError(err).code !== 'not_found') throw err;
          await sb.io.statFile(sb.id, from, { user, signal: ctx.signal }); // the source must exist
          await ensureParents(access, sb, parent, user, ctx.signal);
        }
        await sb.io.rename(sb.id, from, to, { user, signal: ctx.signal, overwrite: true });
        return { entry: await stat(sb, to, user, ctx.signal) };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async listDir(req, ctx) {
      try {
        const { sb, user, path } = await target(ctx, req.path);
        const depth = Math.max(1, req.depth);
        const found: FileInfo[] = [];
        const walk = async (dir: string, level: number): Promise<void> => {
          for (const f of await sb.io.listDir(sb.id, dir, { user, signal: ctx.signal })) {
            found.push(f);
            if (found.length > MAX_LIST_ENTRIES) {
              throw new DsecError(
                'resource_exhausted',
                `more than ${MAX_LIST_ENTRIES} entries under ${path}: list with a smaller depth`,
              );
            }
            if (f.type === 'directory' && level < depth) {
              await walk(posix.join(dir, f.name), level + 1);
            }
          }
        };
        await walk(path, 1);
        return { entries: await entries(sb, found, user, ctx.signal) };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async remove(req, ctx) {
      try {
        const { sb, user, path } = await target(ctx, req.path);
        try {
          await sb.io.remove(sb.id, path, { user, signal: ctx.signal, recursive: true });
        } catch (err) {
          // envd's remove is os.RemoveAll: a path that is not there is removed already.
          if (toDsecError(err).code !== 'not_found') throw err;
        }
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async *watchDir(req, ctx) {
      try {
        const { sb, user, poller } = await watchTarget(ctx, req);
        yield { event: { case: 'start', value: {} } };
        const keepalive = keepaliveMs(requestHeaderOf(ctx, 'keepalive-ping-interval'));
        let quietSince = Date.now();
        while (!ctx.signal.aborted) {
          await sleep(watchIntervalMs, ctx.signal);
          if (ctx.signal.aborted) break;
          const changes = await poller.poll(ctx.signal);
          for (const event of await events(sb, changes, req.includeEntry, user, ctx.signal)) {
            yield { event: { case: 'filesystem', value: event } };
          }
          if (changes.length > 0) quietSince = Date.now();
          else if (Date.now() - quietSince >= keepalive) {
            quietSince = Date.now();
            yield { event: { case: 'keepalive', value: {} } };
          }
        }
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async createWatcher(req, ctx) {
      try {
        const sb = await openTarget(access, ctx);
        roomForWatcher(sb);
        const { user, poller } = await watchTarget(ctx, req);
        const id = randomUUID();
        // Counted again: other calls may have added some while this one listed.
        roomForWatcher(sb);
        watchers.set(id, {
          sandboxId: sb.id,
          projectId: sb.principal.projectId,
          keyId: sb.principal.keyId,
          user,
          poller,
          includeEntry: req.includeEntry,
          lastUsedAt: Date.now(),
        });
        return { watcherId: id };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async getWatcherEvents(req, ctx) {
      try {
        let sb: OpenedSandbox;
        try {
          sb = await openTarget(access, ctx);
        } catch (err) {
          const target = ctx.values.get(envdTargetKey);
          if (target && isGone(err)) sandboxGone(target.sandboxId);
          throw err;
        }
        const w = ownedWatcher(sb, req.watcherId);
        try {
          const changes = await w.poller.poll(ctx.signal);
          return { events: await events(sb, changes, w.includeEntry, w.user, ctx.signal) };
        } catch (err) {
          if (isGone(err)) sandboxGone(sb.id);
          throw err;
        }
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async removeWatcher(req, ctx) {
      try {
        const sb = await openTarget(access, ctx);
        ownedWatcher(sb, req.watcherId);
        watchers.delete(req.watcherId);
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },
  };
  async function events(
    sb: OpenedSandbox,
    changes: readonly DirChange[],
    includeEntry: boolean,
    user: string | undefined,
    signal: AbortSignal,
  ): Promise<EventInit[]> {
    if (!includeEntry) return changes.map((c) => eventOf(c, undefined));
    const withEntry = changes.flatMap((c) => (c.entry ? [c.entry] : []));
    const infos = await entries(sb, withEntry, user, signal);
    const byPath = new Map<string, EntryInit>(withEntry.map((f, i) => [f.path, infos[i]!]));
    return changes.map((c) => eventOf(c, c.entry ? byPath.get(c.entry.path) : undefined));
  }

  return {
    impl,
    close() {
      clearInterval(sweeper);
      watchers.clear();
    },
  };
}

/**
 * envd's types. A symlink is reported as what it leads to (envd follows it;
 * SYMLINK is not a value older SDK decoders know), a broken one as a file.
 */
const FILE_TYPES: Record<FileInfo['type'], FileType> = {
  file: FileType.FILE,
  directory: FileType.DIRECTORY,
  symlink: FileType.FILE,
  fifo: FileType.UNSPECIFIED,
  socket: FileType.UNSPECIFIED,
  char: FileType.UNSPECIFIED,
  block: FileType.UNSPECIFIED,
  unknown: FileType.UNSPECIFIED,
};

/** Go's `FileMode.String()` type letters, as envd reports `permissions`. */
const TYPE_LETTERS: Record<FileInfo['type'], string> = {
  file: '-',
  directory: 'd',
  symlink: 'L',
  fifo: 'p',
  socket: 'S',
  char: 'Dc',
  block: 'D',
  unknown: '?',
};

/**
 * envd's entry for a DSec `FileInfo`: owners by the sandbox's names (numeric
 * when it has none), a symlink as its target's type with the target's
 * absolute path (`link`, resolved in the sandbox; without it, the link's text).
 */
export function entryOf(f: FileInfo, names?: IdNames, link?: LinkTarget): EntryInit {
  // A broken link (its target's type unknown) reads as a file.
  const type =
    f.type === 'symlink' ? (link && link.type !== 'unknown' ? link.type : 'file') : f.type;
  const target = f.type === 'symlink' ? linkTarget(f, link) : undefined;
  return {
    name: f.name,
    type: FILE_TYPES[type],
    path: f.path,
    size: BigInt(f.size),
    mode: f.mode & 0o777,
    permissions: permissionString(f.type, f.mode),
    owner: nameOf(names?.users, f.uid),
    group: nameOf(names?.groups, f.gid),
    modifiedTime: timestampFromMs(Date.parse(f.mtime)),
    ...(target ? { symlinkTarget: target } : {}),
  };
}

/**
 * A link's absolute target: resolved in the sandbox; for a broken one (whose
 * end cannot be resolved) its own text, made absolute against the link's
 * directory (text only, nothing is resolved here).
 */
function linkTarget(f: FileInfo, link: LinkTarget | undefined): string | undefined {
  if (link && link.type !== 'unknown' && link.path) return link.path;
  const text = f.target || link?.text;
  if (!text) return link?.path || undefined;
  return text.startsWith('/')
    ? posix.normalize(text)
    : posix.normalize(posix.join(posix.dirname(f.path), text));
}

export function permissionString(type: FileInfo['type'], mode: number): string {
  let out = TYPE_LETTERS[type];
  for (const [shift, chars] of [
    [6, 'rwx'],
    [3, 'rwx'],
    [0, 'rwx'],
  ] as const) {
    for (let i = 0; i < 3; i++) out += mode & (1 << (shift + 2 - i)) ? chars[i] : '-';
  }
  return out;
}

const EVENT_TYPES: Record<DirChange['kind'], EventType> = {
  create: EventType.CREATE,
  write: EventType.WRITE,
  remove: EventType.REMOVE,
  chmod: EventType.CHMOD,
};

function eventOf(c: DirChange, entry: EntryInit | undefined): EventInit {
  return { name: c.name, type: EVENT_TYPES[c.kind], ...(entry ? { entry } : {}) };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done() {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}

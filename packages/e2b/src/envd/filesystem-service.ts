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
import { BoundedMap } from '../sandbox-access.js';
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
import { openTarget, requestHeaderOf, requestHeadersOf } from './rpc-context.js';

type EntryInit = MessageInitShape<typeof EntryInfoSchema>;
type EventInit = MessageInitShape<typeof FilesystemEventSchema>;

/** Unpolled non-streaming watchers are dropped after this long. */
const WATCHER_IDLE_MS = 10 * 60_000;
/** Non-streaming watchers per apiserver. */
const MAX_WATCHERS = 10_000;

export interface FilesystemServiceDeps {
  access: SandboxAccess;
  /** Time between two listings of a streamed watch. */
  watchIntervalMs: number;
}

interface Watcher {
  sandboxId: string;
  keyId: string;
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
  const watchers = new BoundedMap<string, Watcher>(MAX_WATCHERS);
  const sweeper = setInterval(() => {
    const now = Date.now();
    for (const [id, w] of watchers) if (now - w.lastUsedAt > WATCHER_IDLE_MS) watchers.delete(id);
  }, 60_000);
  sweeper.unref();

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
  ) {
    return entryOf(await sb.io.statFile(sb.id, path, { user, signal }));
  }

  async function watchTarget(
    ctx: HandlerContext,
    req: { path: string; recursive: boolean },
  ): Promise<{ sb: OpenedSandbox; poller: DirPoller }> {
    const { sb, user, path } = await target(ctx, req.path);
    const info = await sb.io.statFile(sb.id, path, { user, signal: ctx.signal });
    if (info.type !== 'directory') {
      throw new DsecError('invalid_argument', `path ${path} is not a directory`, { field: 'path' });
    }
    const poller = new DirPoller(path, req.recursive, (p) =>
      sb.io.listDir(sb.id, p, { user, signal: ctx.signal }),
    );
    await poller.start();
    return { sb, poller };
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
          // envd makes missing parents too.
          if (code !== 'not_found') throw err;
          await sb.io.mkdir(sb.id, path, { ...opts, parents: true });
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
          await sb.io.mkdir(sb.id, parent, { user, signal: ctx.signal, parents: true });
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
        const entries: EntryInit[] = [];
        const walk = async (dir: string, level: number): Promise<void> => {
          for (const f of await sb.io.listDir(sb.id, dir, { user, signal: ctx.signal })) {
            entries.push(entryOf(f));
            if (f.type === 'directory' && level < depth) {
              await walk(posix.join(dir, f.name), level + 1);
            }
          }
        };
        await walk(path, 1);
        return { entries };
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async remove(req, ctx) {
      try {
        const { sb, user, path } = await target(ctx, req.path);
        await sb.io.remove(sb.id, path, { user, signal: ctx.signal, recursive: true });
        return {};
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async *watchDir(req, ctx) {
      try {
        const { poller } = await watchTarget(ctx, req);
        yield { event: { case: 'start', value: {} } };
        const keepalive = keepaliveMs(requestHeaderOf(ctx, 'keepalive-ping-interval'));
        let quietSince = Date.now();
        while (!ctx.signal.aborted) {
          await sleep(watchIntervalMs, ctx.signal);
          if (ctx.signal.aborted) break;
          const changes = await poller.poll();
          for (const c of changes) {
            yield { event: { case: 'filesystem', value: eventOf(c, req.includeEntry) } };
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
        const { sb, poller } = await watchTarget(ctx, req);
        const id = randomUUID();
        watchers.set(id, {
          sandboxId: sb.id,
          keyId: sb.principal.keyId,
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
        const sb = await openTarget(access, ctx);
        const w = ownedWatcher(sb, req.watcherId);
        const changes = await w.poller.poll();
        return { events: changes.map((c) => eventOf(c, w.includeEntry)) };
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
  return {
    impl,
    close() {
      clearInterval(sweeper);
      watchers.clear();
    },
  };
}

const FILE_TYPES: Record<FileInfo['type'], FileType> = {
  file: FileType.FILE,
  directory: FileType.DIRECTORY,
  symlink: FileType.SYMLINK,
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

/** envd's entry for a DSec `FileInfo`; owners are names only for root (DSec reports uids). */
export function entryOf(f: FileInfo): EntryInit {
  return {
    name: f.name,
    type: FILE_TYPES[f.type],
    path: f.path,
    size: BigInt(f.size),
    mode: f.mode & 0o777,
    permissions: permissionString(f.type, f.mode),
    owner: f.uid === 0 ? 'root' : String(f.uid),
    group: f.gid === 0 ? 'root' : String(f.gid),
    modifiedTime: timestampFromMs(Date.parse(f.mtime)),
    ...(f.target !== undefined ? { symlinkTarget: f.target } : {}),
  };
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

function eventOf(c: DirChange, includeEntry: boolean): EventInit {
  return {
    name: c.name,
    type: EVENT_TYPES[c.kind],
    ...(includeEntry && c.entry ? { entry: entryOf(c.entry) } : {}),
  };
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

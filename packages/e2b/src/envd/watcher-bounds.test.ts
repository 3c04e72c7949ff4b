import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ConnectError, Code, createContextValues } from '@connectrpc/connect';
import type { HandlerContext } from '@connectrpc/connect';
import type { FileInfo } from '@dsec/core';
import type { Principal } from '@dsec/iam';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';
import {
  filesystemService,
  MAX_WATCHERS,
  MAX_WATCHERS_PER_PROJECT,
  MAX_WATCHERS_PER_SANDBOX,
} from './filesystem-service.js';
import { envdTargetKey } from './rpc-context.js';

/** An access whose sandboxes all have an empty /w: watchers cost nothing but their entry. */
function fakeAccess(): SandboxAccess {
  const dir: FileInfo = {
    name: 'w',
    path: '/w',
    type: 'directory',
    size: 0,
    mode: 0o755,
    mtime: '2026-01-01T00:00:00.000Z',
    uid: 0,
    gid: 0,
  };
  return {
    open: async (principal: Principal, id: string): Promise<OpenedSandbox> =>
      ({
        id,
        principal,
        io: { statFile: async () => dir, listDir: async () => [] },
      }) as unknown as OpenedSandbox,
    resolvePath: async (_sb: OpenedSandbox, p: string) => p,
  } as unknown as SandboxAccess;
}

function ctxFor(projectId: string, sandboxId: string): HandlerContext {
  const principal: Principal = { keyId: `key-${projectId}`, projectId, role: 'admin' };
  return {
    values: createContextValues().set(envdTargetKey, { caller: { principal }, sandboxId } as never),
    signal: new AbortController().signal,
    requestHeader: new Headers(),
  } as unknown as HandlerContext;
}

const exhausted = (e: unknown) => e instanceof ConnectError && e.code === Code.ResourceExhausted;

test('attack: one project cannot take every watcher of the apiserver, nor evict another project’s', async () => {
  const svc = filesystemService({ access: fakeAccess(), watchIntervalMs: 1000 });
  const { impl } = svc;
  const create = (p: string, sb: string) =>
    impl.createWatcher(
      { path: '/w', recursive: false, includeEntry: false } as never,
      ctxFor(p, sb),
    ) as Promise<{ watcherId: string }>;
  try {
    // The victim's watcher, made first (the oldest: the one an eviction would drop).
    const victim = await create('prj-victim', 'sb-victim');
    // The attacker spreads watchers over its sandboxes up to the project's bound.
    const sandboxes = Math.ceil(MAX_WATCHERS_PER_PROJECT / MAX_WATCHERS_PER_SANDBOX);
    let made = 0;
    for (let s = 0; s < sandboxes; s++) {
      for (let i = 0; i < MAX_WATCHERS_PER_SANDBOX && made < MAX_WATCHERS_PER_PROJECT; i++) {
        await create('prj-evil', `sb-evil-${s}`);
        made++;
      }
    }
    await assert.rejects(create('prj-evil', `sb-evil-${sandboxes}`), exhausted);
    // Many projects filling the apiserver: refused once full, the oldest never evicted.
    let filled = 1 + made;
    for (let p = 0; filled < MAX_WATCHERS; p++) {
      for (let i = 0; i < MAX_WATCHERS_PER_PROJECT && filled < MAX_WATCHERS; i++) {
        await create(`prj-${p}`, `sb-${p}-${Math.floor(i / MAX_WATCHERS_PER_SANDBOX)}`);
        filled++;
      }
    }
    await assert.rejects(create('prj-late', 'sb-late'), exhausted);
    const events = (await impl.getWatcherEvents(
      { watcherId: victim.watcherId } as never,
      ctxFor('prj-victim', 'sb-victim'),
    )) as { events: unknown[] };
    assert.deepEqual(events.events, []);
  } finally {
    svc.close();
  }
});

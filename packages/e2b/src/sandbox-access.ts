import { posix } from 'node:path';
import { DsecError, toDsecError } from '@dsec/core';
import type { EdgeApi, SandboxIoApi } from '@dsec/core';
import type { SandboxService } from '@dsec/apiserver';
import type { Principal } from '@dsec/iam';
import { FileMetadata } from './envd/metadata.js';

/** Entries a per-apiserver cache keeps before it forgets its oldest. */
const CACHE_ENTRIES = 50_000;

/** A Map that forgets its oldest entry past a size (insertion order). */
export class BoundedMap<K, V> extends Map<K, V> {
  constructor(readonly limit: number = CACHE_ENTRIES) {
    super();
  }

  override set(key: K, value: V): this {
    if (!this.has(key) && this.size >= this.limit) this.delete(this.keys().next().value as K);
    return super.set(key, value);
  }
}

/** A sandbox an E2B caller may use, opened through the native service's authorisation. */
export interface OpenedSandbox {
  /** The DSec ID. */
  id: string;
  edge: EdgeApi;
  io: SandboxIoApi;
  principal: Principal;
}

/**
 * Opens sandboxes for in-sandbox calls and remembers what never changes
 * about them (the default user; whether a program exists is re-checked
 * rarely): every call still goes through `SandboxService.authorize`.
 */
export class SandboxAccess {
  readonly #service: SandboxService;
  readonly #initUsers = new BoundedMap<string, string>();
  readonly #programs = new BoundedMap<string, boolean>();
  /** E2B file metadata (xattrs in the sandbox), shared by the RPCs and `/files`. */
  readonly metadata = new FileMetadata();

  constructor(service: SandboxService) {
    this.#service = service;
  }

  /** Throws `sandbox_not_found` (forged, unknown, another project's) or `unavailable` (no in-sandbox interface). */
  async open(principal: Principal, id: string, signal?: AbortSignal): Promise<OpenedSandbox> {
    const { edge } = await this.#service.authorize(principal, id, signal);
    if (!edge.io) {
      throw new DsecError('unavailable', `edge ${edge.edgeId} does not run commands or files`);
    }
    return { id, edge, io: edge.io, principal };
  }

  /** The user calls run as when they name none (the sandbox's `initUser`). */
  async defaultUser(sb: OpenedSandbox, signal?: AbortSignal): Promise<string> {
    const known = this.#initUsers.get(sb.id);
    if (known !== undefined) return known;
    const info = await this.#service.get(sb.principal, sb.id, signal);
    this.#initUsers.set(sb.id, info.spec.initUser);
    return info.spec.initUser;
  }

  /**
   * An absolute path for an envd path: E2B resolves relative paths and `~`
   * against the user's home (`/root` for root, else `/home/<user>`).
   */
  async resolvePath(
    sb: OpenedSandbox,
    path: string,
    user: string | undefined,
    signal?: AbortSignal,
  ): Promise<string> {
    if (path.includes('\0') || path.length > 4096) {
      throw new DsecError('invalid_argument', 'path must be at most 4096 bytes without NUL', {
        field: 'path',
      });
    }
    if (path.startsWith('/')) return posix.normalize(path);
    const home = homeOf(user ?? (await this.defaultUser(sb, signal)));
    const rest = path === '~' ? '' : path.startsWith('~/') ? path.slice(2) : path;
    return posix.normalize(posix.join(home, rest));
  }

  /**
   * Whether the sandbox has ended (killed, stopped, failed, or no longer
   * there): asked of its edge, never answered from a cache.
   */
  async isGone(sb: OpenedSandbox, signal?: AbortSignal): Promise<boolean> {
    try {
      const info = await this.#service.get(sb.principal, sb.id, signal);
      return info.state === 'stopping' || info.state === 'stopped' || info.state === 'failed';
    } catch (err) {
      const code = toDsecError(err).code;
      if (code === 'sandbox_not_found' || code === 'sandbox_not_running') return true;
      throw err;
    }
  }

  /** Whether an absolute program path exists in the sandbox (cached: images do not lose programs). */
  async hasProgram(sb: OpenedSandbox, path: string, signal?: AbortSignal): Promise<boolean> {
    const key = `${sb.id}\n${path}`;
    const known = this.#programs.get(key);
    if (known !== undefined) return known;
    let found: boolean;
    try {
      const info = await sb.io.statFile(sb.id, path, { user: 'root', signal });
      found = info.type === 'file' || info.type === 'symlink';
    } catch (err) {
      if (toDsecError(err).code !== 'not_found') throw err;
      found = false;
    }
    this.#programs.set(key, found);
    return found;
  }

  forget(id: string): void {
    this.#initUsers.delete(id);
    this.metadata.forget(id);
  }
}

export function homeOf(user: string): string {
  return user === 'root' || user === '0' ? '/root' : `/home/${user}`;
}

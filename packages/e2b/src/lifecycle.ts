import { DsecError, isDsecError, toDsecError } from '@dsec/core';
import type { SandboxInfo } from '@dsec/core';
import type { SandboxService } from '@dsec/apiserver';
import type { Principal } from '@dsec/iam';
import { BoundedMap, SandboxAccess } from './sandbox-access.js';
import type { OpenedSandbox } from './sandbox-access.js';
import { toE2bSandboxId } from './ids.js';

/**
 * What E2B keeps about a sandbox's lifecycle and user, kept by DSec as
 * labels the E2B create sets (a tenant's `metadata` cannot name the
 * `e2b.dev/` prefix): who envd calls run as by default, whether a timeout
 * pauses instead of killing, whether the next request resumes a paused
 * sandbox, and whether its ports take traffic without a key.
 */

/** Every label the E2B layer sets; `metadata` may not use the prefix. */
export const E2B_LABEL_PREFIX = 'e2b.dev/';
/** The user envd calls default to (`user`, as in E2B's sandboxes, unless the template says). */
export const USER_LABEL = 'e2b.dev/user';
/** `pause`: the timeout pauses the sandbox (E2B's `autoPause`); absent: it is killed. */
export const ON_TIMEOUT_LABEL = 'e2b.dev/on-timeout';
/** `true`: the next request to a paused sandbox resumes it (E2B's `autoResume`). */
export const AUTO_RESUME_LABEL = 'e2b.dev/auto-resume';
/** `true`: its ports take traffic with no key (E2B's `network.allowPublicTraffic`). */
export const PUBLIC_TRAFFIC_LABEL = 'e2b.dev/public-traffic';
/** The E2B timeout (seconds) a resumed `autoPause` sandbox gets again. */
export const TIMEOUT_LABEL = 'e2b.dev/timeout';

/**
 * How much longer than the E2B timeout an `autoPause` sandbox's DSec TTL
 * runs: the pause happens at the E2B timeout, and the DSec TTL is the
 * backstop that stops the sandbox if no apiserver paused it (every apiserver
 * that served the sandbox restarted, say).
 */
export const AUTO_PAUSE_GRACE_S = 60;

export interface E2bLifecycle {
  onTimeout: 'kill' | 'pause';
  autoResume: boolean;
}

export function lifecycleOf(info: Pick<SandboxInfo, 'spec'>): E2bLifecycle {
  const labels = info.spec.labels;
  return {
    onTimeout: labels[ON_TIMEOUT_LABEL] === 'pause' ? 'pause' : 'kill',
    autoResume: labels[AUTO_RESUME_LABEL] === 'true',
  };
}

/** When the E2B timeout falls: the DSec TTL, less the grace of an `autoPause` sandbox. */
export function e2bEndAt(info: SandboxInfo): string {
  if (lifecycleOf(info).onTimeout !== 'pause') return info.expiresAt;
  return new Date(Date.parse(info.expiresAt) - AUTO_PAUSE_GRACE_S * 1000).toISOString();
}

/** The DSec TTL that stands for an E2B timeout of `seconds`. */
export function dsecTtl(info: Pick<SandboxInfo, 'spec'>, seconds: number): number {
  return lifecycleOf(info).onTimeout === 'pause'
    ? Math.min(seconds + AUTO_PAUSE_GRACE_S, 604_800)
    : seconds;
}

/**
 * In-sandbox access as E2B's sandboxes behave: calls default to the E2B
 * user (the `e2b.dev/user` label, the DSec `initUser` otherwise), and a
 * sandbox this apiserver paused (E2B's `pause`, or its timeout with
 * `autoPause`) answers as gone unless it was made with `autoResume`, where
 * DSec's edge resumes it on the call as it always does.
 */
export class E2bSandboxAccess extends SandboxAccess {
  readonly #service: SandboxService;
  readonly #users = new BoundedMap<string, string>();
  /** Whether a sandbox takes port traffic without a key (labels never change). */
  readonly #public = new BoundedMap<string, boolean>();
  /** Sandboxes paused through E2B that must not resume on the next request. */
  readonly #held = new BoundedMap<string, true>();

  constructor(service: SandboxService) {
    super(service);
    this.#service = service;
  }

  override async open(
    principal: Principal,
    id: string,
    signal?: AbortSignal,
  ): Promise<OpenedSandbox> {
    const sb = await super.open(principal, id, signal);
    if (this.#held.has(id)) {
      const info = await this.#service.get(principal, id, signal);
      if (info.state === 'paused') {
        throw new DsecError('sandbox_not_running', `sandbox ${toE2bSandboxId(id)} is paused`, {
          details: { state: 'paused' },
        });
      }
      this.#held.delete(id);
    }
    return sb;
  }

  /**
   * A sandbox for port traffic that carries no key: only one made with
   * `allowPublicTraffic` (`sandbox_not_found` otherwise, as for any unknown
   * ID). It is opened as its own project's, so nothing else is reachable
   * through it; envd's port never comes here (sandbox-routes.ts).
   */
  async openPublic(id: string, signal?: AbortSignal): Promise<OpenedSandbox | undefined> {
    if (this.#public.get(id) === false) return undefined;
    // A service without the keyless lookup serves no public ports (the key stays required).
    if (typeof (this.#service as Partial<SandboxService>).openWithoutKey !== 'function') {
      return undefined;
    }
    let opened;
    let seen = false;
    try {
      opened = await this.#service.openWithoutKey(
        id,
        (info) => {
          seen = true;
          return info.spec.labels[PUBLIC_TRAFFIC_LABEL] === 'true';
        },
        signal,
      );
    } catch (err) {
      if (!isDsecError(err, 'sandbox_not_found')) throw err;
      // A sandbox that is there and not public stays so: its keyless requests cost no lookup
      // again, and go on to the failed-authentication budget of their source.
      if (seen) this.#public.set(id, false);
      return undefined;
    }
    this.#public.set(id, true);
    const { edge, info } = opened;
    if (!edge.io) {
      throw new DsecError('unavailable', `edge ${edge.edgeId} does not run commands or files`);
    }
    // Keyless traffic resumes a paused sandbox only when its owner asked for that (autoResume),
    // whoever paused it: another apiserver, a native pause, this one before a restart.
    if (info.state === 'paused' && (this.#held.has(id) || !lifecycleOf(info).autoResume)) {
      throw new DsecError('sandbox_not_running', `sandbox ${toE2bSandboxId(id)} is paused`, {
        details: { state: 'paused' },
      });
    }
    // The principal of a keyless request is the sandbox's own project, with no key and no role
    // beyond member: it reaches this sandbox's ports and nothing else.
    const principal: Principal = {
      keyId: 'e2b-public-traffic',
      projectId: info.projectId,
      role: 'member',
    };
    return { id, edge, io: edge.io, principal };
  }

  override async defaultUser(sb: OpenedSandbox, signal?: AbortSignal): Promise<string> {
    const known = this.#users.get(sb.id);
    if (known !== undefined) return known;
    const info = await this.#service.get(sb.principal, sb.id, signal);
    const user = info.spec.labels[USER_LABEL] ?? info.spec.initUser;
    this.#users.set(sb.id, user);
    return user;
  }

  /** The sandbox was paused through E2B: hold it paused unless it auto-resumes. */
  paused(info: SandboxInfo): void {
    if (lifecycleOf(info).autoResume) this.#held.delete(info.id);
    else this.#held.set(info.id, true);
  }

  /** Whether requests to `id` must not resume it (this apiserver paused it, without autoResume). */
  holds(id: string): boolean {
    return this.#held.has(id);
  }

  resumed(id: string): void {
    this.#held.delete(id);
  }

  override forget(id: string): void {
    super.forget(id);
    this.#users.delete(id);
    this.#held.delete(id);
  }
}

/** How often a watched sandbox that is paused is looked at again (has traffic resumed it?). */
const PAUSED_RECHECK_MS = 2000;
/**
 * The longest a running watched sandbox goes unread: one deleted elsewhere (the native API,
 * another apiserver) leaves the watch list by then, not at its E2B timeout (up to a week), so
 * one tenant's dead entries cannot fill the bounded list and push out another's.
 */
const RUNNING_RECHECK_MS = 60_000;

/**
 * Sandboxes whose E2B timeout pauses them (`autoPause`), watched by the
 * apiserver that made, connected or re-timed them: at the timeout the
 * sandbox is paused with DSec's pause; once something resumed it (a
 * connect, or with `autoResume` the next request), it gets its E2B timeout
 * again from then, as E2B's do. Each look re-reads the sandbox, so a
 * timeout moved through another apiserver is honoured.
 */
export class AutoPauser {
  readonly #entries = new BoundedMap<
    string,
    { principal: Principal; at: number; pausedByUs: boolean }
  >();
  readonly #timer: NodeJS.Timeout;
  #sweeping: Promise<void> | undefined;

  constructor(
    readonly deps: {
      service: SandboxService;
      access: E2bSandboxAccess;
      now?: () => number;
      intervalMs?: number;
      onError?: (id: string, err: unknown) => void;
    },
  ) {
    this.#timer = setInterval(() => void this.sweep(), deps.intervalMs ?? 1000);
    this.#timer.unref();
  }

  #now(): number {
    return (this.deps.now ?? Date.now)();
  }

  /** Watch (or re-time) an autoPause sandbox; others are ignored. */
  watch(principal: Principal, info: SandboxInfo): void {
    if (lifecycleOf(info).onTimeout !== 'pause') return;
    if (info.state === 'paused') {
      this.#entries.set(info.id, {
        principal,
        at: this.#now() + PAUSED_RECHECK_MS,
        pausedByUs: true,
      });
    } else if (info.state === 'running' || info.state === 'creating') {
      this.#entries.set(info.id, {
        principal,
        at: Math.min(Date.parse(e2bEndAt(info)), this.#now() + RUNNING_RECHECK_MS),
        pausedByUs: false,
      });
    } else {
      this.#entries.delete(info.id);
    }
  }

  forget(id: string): void {
    this.#entries.delete(id);
  }

  get size(): number {
    return this.#entries.size;
  }

  /** One look at every watched sandbox whose time has come; concurrent calls share one sweep. */
  sweep(): Promise<void> {
    this.#sweeping ??= this.#sweep().finally(() => (this.#sweeping = undefined));
    return this.#sweeping;
  }

  async #sweep(): Promise<void> {
    const now = this.#now();
    for (const [id, e] of [...this.#entries]) {
      if (e.at > now) continue;
      try {
        await this.#look(id, e, now);
      } catch (err) {
        const code = toDsecError(err).code;
        if (code === 'sandbox_not_found' || code === 'sandbox_not_running') {
          this.#entries.delete(id);
        } else {
          this.deps.onError?.(id, err);
        }
      }
    }
  }

  async #look(
    id: string,
    e: { principal: Principal; at: number; pausedByUs: boolean },
    now: number,
  ): Promise<void> {
    const { service, access } = this.deps;
    let info = await service.get(e.principal, id);
    if (info.state === 'paused') {
      e.pausedByUs = true;
      e.at = now + PAUSED_RECHECK_MS;
      return;
    }
    if (info.state !== 'running') {
      this.#entries.delete(id);
      return;
    }
    if (e.pausedByUs) {
      // Resumed since we paused it: the E2B timeout runs again from now.
      // (Never shorter than what a connect through another apiserver gave it.)
      const timeout = Number(info.spec.labels[TIMEOUT_LABEL] ?? '300');
      if (now + timeout * 1000 > Date.parse(e2bEndAt(info))) {
        info = await service.setTimeout(e.principal, id, dsecTtl(info, timeout));
      }
      e.pausedByUs = false;
      access.resumed(id);
    }
    const at = Date.parse(e2bEndAt(info));
    if (at > now) {
      e.at = Math.min(at, now + RUNNING_RECHECK_MS);
      return;
    }
    const paused = await service.pause(e.principal, id);
    access.paused(paused);
    e.pausedByUs = true;
    e.at = now + PAUSED_RECHECK_MS;
  }

  close(): void {
    clearInterval(this.#timer);
  }
}

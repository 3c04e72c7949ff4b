import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError } from '@dsec/core';

/**
 * The cgroup freezer of one sandbox: v1 (`freezer.state`, this machine's
 * hybrid layout) or v2 (`cgroup.freeze`). Everything in the sandbox's cgroup
 * stops — its processes and its command daemon — so its writable layer holds
 * still while a snapshot reads it. `dirs` are the sandbox's cgroup
 * directories (`CgroupDriver.dirs`); the freezer's is found among them.
 */
export class Freezer {
  readonly #v1: string | undefined;
  readonly #v2: string | undefined;

  constructor(dirs: readonly string[]) {
    this.#v1 = dirs.map((d) => join(d, 'freezer.state')).find((f) => existsSync(f));
    this.#v2 = this.#v1
      ? undefined
      : dirs.map((d) => join(d, 'cgroup.freeze')).find((f) => existsSync(f));
  }

  get available(): boolean {
    return this.#v1 !== undefined || this.#v2 !== undefined;
  }

  /** True when the cgroup is frozen or freezing. */
  frozen(): boolean {
    if (this.#v1) return readFileSync(this.#v1, 'utf8').trim() !== 'THAWED';
    if (this.#v2) return readFileSync(this.#v2, 'utf8').trim() === '1';
    return false;
  }

  /**
   * Freezes and waits until every task is stopped (v1 reports `FREEZING`
   * while a task in an uninterruptible sleep holds out; writing `FROZEN`
   * again retries it). Past `timeoutMs` it thaws again and throws
   * `unavailable`: a snapshot of a half-frozen sandbox would not be consistent.
   */
  async freeze(timeoutMs = 10_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    if (this.#v1) {
      for (;;) {
        writeFileSync(this.#v1, 'FROZEN');
        if (readFileSync(this.#v1, 'utf8').trim() === 'FROZEN') return;
        if (Date.now() > deadline) break;
        await sleep(1);
      }
    } else if (this.#v2) {
      writeFileSync(this.#v2, '1');
      const events = join(this.#v2, '..', 'cgroup.events');
      for (;;) {
        if (/^frozen 1$/m.test(readFileSync(events, 'utf8'))) return;
        if (Date.now() > deadline) break;
        await sleep(1);
      }
    } else {
      throw new DsecError('unavailable', 'the sandbox has no cgroup freezer');
    }
    this.thaw();
    throw new DsecError('unavailable', `the sandbox did not freeze within ${timeoutMs} ms`);
  }

  thaw(): void {
    if (this.#v1) writeFileSync(this.#v1, 'THAWED');
    else if (this.#v2) writeFileSync(this.#v2, '0');
  }
}

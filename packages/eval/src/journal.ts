import { appendFileSync, readFileSync, writeFileSync } from 'node:fs';
import { DsecError } from '@dsec/core';

/** What the journal knows about one task. */
export interface TaskJournal {
  attempt: number;
  sandboxId: string | undefined;
  /** The attempt's grading sandbox (patch grading), once created. */
  graderSandboxId: string | undefined;
  /** Request IDs of steps that finished (the sandbox's log must still hold them on resume). */
  steps: Set<string>;
  /** Agent-side state recorded before it was acted on (model turns), by key. */
  memos: Map<string, unknown>;
  done: boolean;
}

export interface RunHeader {
  runId: string;
  agent: string;
  labels: Record<string, string>;
  tasksFile: string;
  startedAt: string;
}

type Entry =
  | ({ t: 'run' } & RunHeader)
  | { t: 'attempt'; id: string; attempt: number; reason?: string | undefined }
  | { t: 'sandbox'; id: string; attempt: number; sandboxId: string }
  | { t: 'grader'; id: string; attempt: number; sandboxId: string }
  | { t: 'step'; id: string; rid: string }
  | { t: 'memo'; id: string; attempt: number; key: string; value: unknown }
  | { t: 'done'; id: string }
  | { t: 'paused'; at: string }
  | { t: 'resumed'; at: string };

/**
 * The driver's side of a rollout's state, next to `--out` (paper 6.2): the
 * run ID, each task's sandbox (and grading sandbox) and attempt, the steps it finished and what
 * its agent decided (model turns) before acting on it. Append-only JSON
 * lines, written synchronously before the step they describe goes on, so a
 * driver killed at any point leaves a journal that a `--resume` trusts; a
 * torn last line is ignored.
 */
export class Journal {
  readonly path: string;
  readonly header: RunHeader;
  readonly #tasks = new Map<string, TaskJournal>();

  private constructor(path: string, header: RunHeader) {
    this.path = path;
    this.header = header;
  }

  /** Starts a new journal (replacing any file at `path`). */
  static create(path: string, header: RunHeader): Journal {
    writeFileSync(path, JSON.stringify({ t: 'run', ...header }) + '\n', { mode: 0o600 });
    return new Journal(path, header);
  }

  /** Reads an existing journal; `not_found` when there is none. */
  static open(path: string): Journal {
    let text: string;
    try {
      text = readFileSync(path, 'utf8');
    } catch (err) {
      throw new DsecError('not_found', `no journal at ${path}: nothing to resume`, {
        field: 'resume',
        cause: err,
      });
    }
    const lines = text.split('\n');
    let journal: Journal | undefined;
    for (const line of lines) {
      if (line.trim() === '') continue;
      let e: Entry;
      try {
        e = JSON.parse(line) as Entry;
      } catch {
        continue; // a torn line from a killed driver
      }
      if (e.t === 'run') {
        if (!journal) journal = new Journal(path, omitT(e));
        continue;
      }
      if (journal) journal.#apply(e);
    }
    if (!journal) {
      throw new DsecError('invalid_argument', `${path} is not an eval journal`, {
        field: 'resume',
      });
    }
    return journal;
  }

  task(id: string): TaskJournal {
    let t = this.#tasks.get(id);
    if (!t) {
      t = {
        attempt: 1,
        sandboxId: undefined,
        graderSandboxId: undefined,
        steps: new Set(),
        memos: new Map(),
        done: false,
      };
      this.#tasks.set(id, t);
    }
    return t;
  }

  newAttempt(id: string, reason: string): number {
    const attempt = this.task(id).attempt + 1;
    this.#write({ t: 'attempt', id, attempt, reason });
    return attempt;
  }

  sandbox(id: string, sandboxId: string): void {
    this.#write({ t: 'sandbox', id, attempt: this.task(id).attempt, sandboxId });
  }

  /** The attempt's grading sandbox: written before any grading step runs in it. */
  grader(id: string, sandboxId: string): void {
    this.#write({ t: 'grader', id, attempt: this.task(id).attempt, sandboxId });
  }

  step(id: string, rid: string): void {
    if (this.task(id).steps.has(rid)) return;
    this.#write({ t: 'step', id, rid });
  }

  memo(id: string, key: string, value: unknown): void {
    this.#write({ t: 'memo', id, attempt: this.task(id).attempt, key, value });
  }

  done(id: string): void {
    this.#write({ t: 'done', id });
  }

  mark(t: 'paused' | 'resumed'): void {
    this.#write({ t, at: new Date().toISOString() });
  }

  #write(e: Entry): void {
    appendFileSync(this.path, JSON.stringify(e) + '\n');
    this.#apply(e);
  }

  #apply(e: Entry): void {
    switch (e.t) {
      case 'attempt': {
        const t = this.task(e.id);
        t.attempt = e.attempt;
        t.sandboxId = undefined;
        t.graderSandboxId = undefined;
        t.steps.clear();
        t.memos.clear();
        break;
      }
      case 'sandbox': {
        const t = this.task(e.id);
        if (e.attempt === t.attempt) t.sandboxId = e.sandboxId;
        break;
      }
      case 'grader': {
        const t = this.task(e.id);
        if (e.attempt === t.attempt) t.graderSandboxId = e.sandboxId;
        break;
      }
      case 'step':
        this.task(e.id).steps.add(e.rid);
        break;
      case 'memo': {
        const t = this.task(e.id);
        if (e.attempt === t.attempt) t.memos.set(e.key, e.value);
        break;
      }
      case 'done':
        this.task(e.id).done = true;
        break;
      default:
        break;
    }
  }
}

function omitT<T extends { t: string }>(e: T): Omit<T, 't'> {
  const { t: _t, ...rest } = e;
  return rest;
}

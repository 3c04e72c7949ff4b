import type { Command } from 'commander';
import { DsecError } from '@dsec/sdk';
import type { DSecClient, JobResult, SandboxInfo } from '@dsec/sdk';
import { contextOf } from '../context.js';
import type { CliContext } from '../context.js';
import { formatRelative } from '../format.js';
import { collect, collectKeyValue, parseInteger } from '../parse.js';
import { reportError } from '../report-error.js';

/** What `pause`, `resume`, `rm` and `timeout` act on: IDs, or every sandbox with the labels. */
interface Selection {
  label?: Record<string, string>;
}

/**
 * `dsec sandbox pause|resume|timeout|snapshot|fork` (issue 11). `pause`,
 * `resume` and `timeout` take sandbox IDs or `--label k=v` (a whole job).
 */
export function registerSandboxLifecycle(sandbox: Command): void {
  sandbox
    .command('pause')
    .description(
      'pause sandboxes: processes stop, memory goes back to the host, state is kept; the next exec resumes',
    )
    .argument('[id...]', 'sandbox IDs')
    .option(
      '--label <K=V>',
      'every live sandbox with this label (repeatable: all must match)',
      collectKeyValue,
    )
    .action(async (ids: string[], opts: Selection, command: Command) => {
      const ctx = contextOf(command);
      await each(command, ids, opts, {
        one: (c, id) => c.sandbox(id).pause({ signal: ctx.signal }),
        job: (c, labels) => c.pauseJob(labels, { signal: ctx.signal }),
      });
    });

  sandbox
    .command('resume')
    .description('resume paused sandboxes (running ones are left as they are)')
    .argument('[id...]', 'sandbox IDs')
    .option(
      '--label <K=V>',
      'every live sandbox with this label (repeatable: all must match)',
      collectKeyValue,
    )
    .action(async (ids: string[], opts: Selection, command: Command) => {
      const ctx = contextOf(command);
      await each(command, ids, opts, {
        one: (c, id) => c.sandbox(id).resume({ signal: ctx.signal }),
        job: (c, labels) => c.resumeJob(labels, { signal: ctx.signal }),
      });
    });

  sandbox
    .command('timeout')
    .description('set when sandboxes stop: N seconds from now, later or sooner than before')
    .argument('[id...]', 'sandbox IDs')
    .requiredOption('--seconds <n>', 'seconds from now (1–604800)', parseInteger)
    .option(
      '--label <K=V>',
      'every live sandbox with this label (repeatable: all must match)',
      collectKeyValue,
    )
    .action(async (ids: string[], opts: Selection & { seconds: number }, command: Command) => {
      const ctx = contextOf(command);
      await each(command, ids, opts, {
        one: (c, id) => c.sandbox(id).setTimeout(opts.seconds * 1000, { signal: ctx.signal }),
        job: (c, labels) => c.extendJob(labels, opts.seconds, { signal: ctx.signal }),
        line: (info) => `${info.id}  expires ${info.expiresAt} (${formatRelative(info.expiresAt)})`,
      });
    });

  sandbox
    .command('snapshot')
    .description(
      "capture a sandbox's filesystem as an image `sandbox create --image` accepts; prints its name",
    )
    .argument('<id>', 'sandbox ID')
    .requiredOption('--name <name>', 'image name, name or name:version')
    .option(
      '--scrub <path>',
      'absolute path to leave out, /dir/** for a tree (repeatable)',
      collect,
    )
    .action(async (id: string, opts: { name: string; scrub?: string[] }, command: Command) => {
      const ctx = contextOf(command);
      const snap = await ctx
        .client()
        .sandbox(id)
        .snapshot({ name: opts.name, scrub: opts.scrub, signal: ctx.signal });
      if (ctx.json) ctx.printJson(snap);
      else ctx.out(snap.image);
    });

  sandbox
    .command('fork')
    .description(
      "start K sandboxes from a sandbox's current filesystem, with its spec; prints their IDs",
    )
    .argument('<id>', 'sandbox ID')
    .requiredOption('--count <k>', 'how many (1–64)', parseInteger)
    .action(async (id: string, opts: { count: number }, command: Command) => {
      const ctx = contextOf(command);
      const forks = await ctx.client().sandbox(id).fork(opts.count, { signal: ctx.signal });
      const ids = forks.map((f) => f.id);
      if (ctx.json) ctx.printJson({ ids });
      else for (const f of ids) ctx.out(f);
    });
}

/**
 * `dsec sandbox rm --label`: stops every live sandbox of a job. Prints what
 * `rm ID…` prints (`{ removed }`), failures on stderr.
 */
export async function removeByLabel(
  ctx: CliContext,
  labels: Record<string, string>,
): Promise<void> {
  const r = await ctx.client().stopJob(labels, { signal: ctx.signal });
  const removed = r.sandboxes.map((s) => s.id);
  if (ctx.json) ctx.printJson({ removed });
  else for (const id of removed) ctx.out(id);
  reportFailures(ctx, r);
}

/** IDs or a label selector, exactly one of them; a usage error otherwise. */
export function selectionOf(
  command: Command,
  ids: string[],
  labels: Record<string, string> | undefined,
): 'ids' | 'labels' {
  const hasLabels = labels !== undefined && Object.keys(labels).length > 0;
  if (hasLabels === ids.length > 0) {
    command.error('error: give sandbox IDs or --label K=V (one of them)');
  }
  return hasLabels ? 'labels' : 'ids';
}

async function each(
  command: Command,
  ids: string[],
  opts: Selection,
  how: {
    one: (client: DSecClient, id: string) => Promise<SandboxInfo>;
    job: (client: DSecClient, labels: Record<string, string>) => Promise<JobResult>;
    /** The human line of a sandbox acted on by ID; default its ID. */
    line?: (info: SandboxInfo) => string;
  },
): Promise<void> {
  const ctx = contextOf(command);
  const client = ctx.client();
  if (selectionOf(command, ids, opts.label) === 'labels') {
    const result = await how.job(client, opts.label!);
    if (ctx.json) ctx.printJson(result);
    else for (const s of result.sandboxes) ctx.out(s.id);
    reportFailures(ctx, result);
    return;
  }
  const outcomes = await Promise.allSettled(ids.map((id) => how.one(client, id)));
  const result: JobResult = { sandboxes: [], failed: [] };
  const lines: string[] = [];
  outcomes.forEach((o, i) => {
    const id = ids[i] ?? '';
    if (o.status === 'fulfilled') {
      result.sandboxes.push({ id, state: o.value.state });
      lines.push(how.line ? how.line(o.value) : id);
    } else {
      const e =
        o.reason instanceof DsecError ? o.reason : new DsecError('internal', String(o.reason));
      result.failed.push({ id, code: e.code, message: e.message });
    }
  });
  if (ctx.json) ctx.printJson(result);
  else for (const l of lines) ctx.out(l);
  reportFailures(ctx, result);
}

function reportFailures(ctx: CliContext, r: JobResult): void {
  for (const f of r.failed) {
    ctx.exitCode = reportError(new DsecError(f.code, `${f.id}: ${f.message}`), ctx);
  }
}

import { join } from 'node:path';
import type { Command } from 'commander';
import { loadClusterConfig } from '@dsec/cluster';
import { doctorFailed, runDoctor, type DoctorCheck } from '@dsec/edge';
import { contextOf } from '../context.js';

/**
 * `dsec doctor [--json]`: checks what DSec needs on this host (packages/edge
 * doctor.ts) and says how to fix each failure. Exits 1 when a required check
 * fails; failed optional checks (KVM, swap for pause, …) only degrade a
 * feature. `--json` prints `{ checks: [{ name, ok, detail, fix }] }`.
 */
export function register(program: Command): void {
  program
    .command('doctor')
    .description(
      'check this host for what DSec needs (mounts, cgroups, runtime, …) and how to fix it',
    )
    .option('--shell <path>', 'the static shell sandboxes get', '/bin/busybox')
    .option(
      '--config <file>',
      'probe the state dir a config file names (its `up.stateDir`, else `edge.stateDir`)',
    )
    .action(async (opts: { shell: string; config?: string }, command: Command) => {
      const ctx = contextOf(command);
      const config = opts.config ? await loadClusterConfig(opts.config) : {};
      const stateDir = config.up?.stateDir
        ? join(config.up.stateDir, 'edge')
        : (config.edge?.stateDir ?? join(ctx.options.stateDir, 'edge'));
      const checks = await runDoctor({ stateDir, shellBinary: opts.shell });
      if (ctx.json) {
        ctx.printJson({
          checks: checks.map(({ name, ok, detail, fix }) => ({ name, ok, detail, fix })),
        });
      } else {
        ctx.out(formatChecks(checks));
      }
      if (doctorFailed(checks)) ctx.exitCode = 1;
    });
}

/** One line per check (`ok`, `FAIL` for required, `warn` for optional), the fix indented under a failure. */
export function formatChecks(checks: DoctorCheck[]): string {
  const width = Math.max(...checks.map((c) => c.name.length));
  const lines: string[] = [];
  for (const c of checks) {
    const mark = c.ok ? 'ok  ' : c.required ? 'FAIL' : 'warn';
    lines.push(`${mark}  ${c.name.padEnd(width)}  ${c.detail}`);
    if (!c.ok) lines.push(`      ${''.padEnd(width)}  fix: ${c.fix}`);
  }
  const failed = checks.filter((c) => c.required && !c.ok).length;
  lines.push(
    failed
      ? `${failed} required check${failed === 1 ? '' : 's'} failed`
      : 'this host can run DSec' +
          (checks.some((c) => !c.ok) ? ' (some optional features are off: see warn)' : ''),
  );
  return lines.join('\n');
}

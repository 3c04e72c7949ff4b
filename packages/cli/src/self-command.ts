import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

/**
 * How to start this CLI again as a child process (`dsec up --edges N`,
 * `dsec bench cluster`): the bundle next to this module when built, else the
 * source entry under the loader this process runs with (tsx).
 */
export function dsecCommand(): string[] {
  const bundled = fileURLToPath(new URL('./main.js', import.meta.url));
  if (existsSync(bundled)) return [process.execPath, bundled];
  const source = fileURLToPath(new URL('./run.ts', import.meta.url));
  return [process.execPath, ...loaderFlags(process.execArgv), source];
}

/** The loader flags of `execArgv` (`--import tsx`, `--conditions=…`), not a test runner's. */
function loaderFlags(execArgv: string[]): string[] {
  const out: string[] = [];
  for (let i = 0; i < execArgv.length; i++) {
    const a = execArgv[i]!;
    if (/^--(import|require|loader|conditions|experimental-loader)=/.test(a)) out.push(a);
    else if (
      /^--(import|require|loader|conditions|experimental-loader)$/.test(a) ||
      a === '-r' ||
      a === '-C'
    ) {
      out.push(a, execArgv[++i] ?? '');
    }
  }
  return out;
}

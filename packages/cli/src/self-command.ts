import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

/**
 * How to start this CLI again as a child process (`dsec up --edges N`,
 * `dsec bench cluster`): `bin/dsec` when running from the built bundle
 * (packages/cli/dist/main.js only exports `main`; the bin runs it), else the
 * source entry under the loader this process runs with (tsx).
 */
export function dsecCommand(): string[] {
  const here = fileURLToPath(import.meta.url);
  if (here.endsWith('/dist/main.js')) {
    const bin = fileURLToPath(new URL('../../../bin/dsec', import.meta.url));
    if (existsSync(bin)) return [process.execPath, bin];
  }
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

/**
 * Runs the CLI from source (`node --import tsx packages/cli/src/run.ts …`):
 * what `dsec up --edges N` starts its children with when the bundle is not
 * built. `bin/dsec` is the entry of the built CLI.
 */
import { main } from './main.js';

process.exitCode = await main(process.argv.slice(2));

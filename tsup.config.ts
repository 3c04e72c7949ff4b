import { defineConfig } from 'tsup';

// One bundle for the CLI (workspace packages inlined, npm dependencies kept
// external) so `bin/dsec` starts fast without a TypeScript loader.
export default defineConfig({
  // `blobd` is the blob daemon process the edge spawns (next to main.js),
  // `exec-load` the client process of `dsec bench exec`'s load run and
  // `flood` the attacker of `dsec bench bounds`;
  // self-contained bundles, no shared chunks.
  entry: {
    main: 'packages/cli/src/main.ts',
    blobd: 'packages/edge/src/ondemand/blobd-main.ts',
    'exec-load': 'packages/cli/src/bench/exec-load-client.ts',
    flood: 'packages/cli/src/bench/flood-client.ts',
  },
  splitting: false,
  outDir: 'packages/cli/dist',
  format: ['esm'],
  platform: 'node',
  target: 'node20',
  sourcemap: true,
  clean: true,
  esbuildOptions(options) {
    options.conditions = ['dsec-source'];
  },
  noExternal: [/^@dsec\//],
  // Keep `node:` prefixes: `node:test` has no bare alias.
  removeNodeProtocol: false,
});

import { defineConfig } from 'tsup';

// One bundle for the CLI (workspace packages inlined, npm dependencies kept
// external) so `bin/dsec` starts fast without a TypeScript loader.
export default defineConfig({
  entry: { main: 'packages/cli/src/main.ts' },
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

import { defineConfig } from 'tsup';

// The published build of @dsec/sdk: one ESM file and its type declarations,
// standalone. The runtime pieces it takes from @dsec/core (DsecError and
// friends) are bundled in, types included, so the package depends on nothing
// but Node. `npm pack` runs it (prepack).
export default defineConfig({
  entry: { index: 'src/index.ts' },
  outDir: 'dist',
  format: ['esm'],
  platform: 'node',
  target: 'node20',
  sourcemap: true,
  clean: true,
  splitting: false,
  treeshake: true,
  noExternal: [/^@dsec\//],
  dts: {
    // The declarations of @dsec/core's pieces are inlined too: its package
    // has no built types to point at, so the build maps it to its sources.
    compilerOptions: { paths: { '@dsec/core': ['../core/src/index.ts'] } },
  },
  esbuildOptions(options) {
    options.conditions = ['dsec-source'];
  },
  removeNodeProtocol: false,
});

// Builds the dashboard into dist/ for the apiserver to serve at /ui/
// (packages/apiserver/src/routes/ui.ts). Preact's JSX through esbuild's
// automatic runtime: no framework plug-in needed.
import { defineConfig } from 'vite';

export default defineConfig({
  base: '/ui/',
  oxc: { jsx: { runtime: 'automatic', importSource: 'preact' } },
  build: {
    outDir: 'dist',
    emptyOutDir: true,
    target: 'es2022',
    sourcemap: false,
    // Report gzip sizes so a growing bundle shows in the build log.
    reportCompressedSize: true,
    chunkSizeWarningLimit: 400,
  },
});

import { writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { buildOpenApiDocument } from './openapi.js';
import { API_VERSION } from './server.js';

/**
 * `npm run openapi` (root; or `-w @dsec/apiserver`): writes docs/openapi.json
 * from the server's schemas. `openapi.test.ts` fails while the committed copy
 * differs from what this writes.
 */
export const OPENAPI_DOC_PATH = fileURLToPath(
  new URL('../../../docs/openapi.json', import.meta.url),
);

/** The document as committed: JSON formatted by the repository's prettier settings. */
export async function committedForm(): Promise<string> {
  // A dev tool, loaded only here: the server itself serves the document unformatted.
  const prettier = await import('prettier');
  const options = (await prettier.resolveConfig(OPENAPI_DOC_PATH)) ?? {};
  return prettier.format(JSON.stringify(buildOpenApiDocument(API_VERSION)), {
    ...options,
    parser: 'json',
  });
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  writeFileSync(OPENAPI_DOC_PATH, await committedForm());
  process.stdout.write(`wrote ${OPENAPI_DOC_PATH}\n`);
}

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { WIRE_TYPES_PATH, wireTypes } from './generate.js';

test('gen/openapi.ts is what openapi-typescript makes of docs/openapi.json (else run `npm run openapi`)', async () => {
  const committed = readFileSync(WIRE_TYPES_PATH, 'utf8');
  assert.ok(
    committed === (await wireTypes()),
    'packages/sdk/src/gen/openapi.ts differs from docs/openapi.json: run `npm run openapi` and commit the result',
  );
});

import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { createTestApi } from './testing/index.js';

const CREATE_FIELDS = [
  'backend',
  'image',
  'workspace',
  'toolkits',
  'memoryLimitMb',
  'cpuCoresLimit',
  'pidsLimit',
  'ttlSeconds',
  'networkRules',
  'initUser',
  'env',
  'labels',
  'projectId',
  'requestId',
  '__proto__',
  'privileged',
];
const COMMAND_FIELDS = [
  'argv',
  'shell',
  'env',
  'cwd',
  'user',
  'stdin',
  'timeoutMs',
  'maxOutputBytes',
  'hostPid',
];

/** Values that stress validators: edges of ranges, odd strings, wrong shapes. */
const nasty = fc.oneof(
  fc.jsonValue({ maxDepth: 3 }),
  fc.constantFrom(
    -1,
    0,
    1,
    15,
    16,
    1e308,
    -1e308,
    0.001,
    2 ** 53,
    '',
    '\u0000',
    '../..',
    'base',
    'base:1',
    null,
    true,
    [],
  ),
  fc.string({ unit: 'binary', maxLength: 50 }),
  fc.array(fc.string({ unit: 'binary', maxLength: 10 }), { maxLength: 5 }),
  fc.dictionary(
    fc.string({ maxLength: 8 }),
    fc.oneof(fc.string({ unit: 'binary', maxLength: 8 }), fc.boolean(), fc.integer()),
  ),
);

function bodies(fields: string[]) {
  return fc.oneof(
    fc.jsonValue({ maxDepth: 4 }),
    fc.dictionary(fc.constantFrom(...fields), nasty, { maxKeys: 6 }),
    fc
      .record({ image: fc.constant('base') })
      .chain((base) =>
        fc
          .dictionary(fc.constantFrom(...fields), nasty, { maxKeys: 3 })
          .map((extra) => ({ ...base, ...extra })),
      ),
  );
}

test('random JSON never yields a 5xx, and failed creates hold no quota', async (t) => {
  const a = await createTestApi();
  t.after(() => a.close());
  const auth = { authorization: `Bearer ${a.rootKey}`, 'content-type': 'application/json' };
  const target = await a.app.inject({
    method: 'POST',
    url: '/v1/sandboxes',
    headers: auth,
    payload: { image: 'base' },
  });
  const id = target.json().id as string;

  await fc.assert(
    fc.asyncProperty(bodies(CREATE_FIELDS), async (body) => {
      const r = await a.app.inject({
        method: 'POST',
        url: '/v1/sandboxes',
        headers: auth,
        payload: JSON.stringify(body),
      });
      assert.ok(r.statusCode < 500, `${r.statusCode} ${r.body} for ${JSON.stringify(body)}`);
      if (r.statusCode >= 400) assert.equal(typeof r.json().error.code, 'string');
    }),
    { numRuns: 400 },
  );
  await fc.assert(
    fc.asyncProperty(bodies(COMMAND_FIELDS), fc.boolean(), async (body, stream) => {
      const r = await a.app.inject({
        method: 'POST',
        url: `/v1/sandboxes/${id}/commands`,
        headers: stream ? { ...auth, accept: 'application/x-ndjson' } : auth,
        payload: JSON.stringify(body),
      });
      assert.ok(r.statusCode < 500, `${r.statusCode} ${r.body} for ${JSON.stringify(body)}`);
    }),
    { numRuns: 400 },
  );
  // Nothing half-created: every reservation belongs to a sandbox that exists.
  const listed = await a.app.inject({
    method: 'GET',
    url: '/v1/sandboxes',
    headers: { authorization: auth.authorization },
  });
  assert.equal((await a.iam.usage(a.rootProjectId)).sandboxes, listed.json().sandboxes.length);
});

/**
 * Issue 24 item 9: `initUser: "9999999999"` was accepted and every command
 * of the sandbox then failed. A user is a name or a uid of the sandbox's own
 * range (0–65535) wherever the API takes one: create, commands, sessions,
 * files, terminals; anything else is `invalid_argument` naming the field.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createTestApi } from './testing/index.js';

const OUT_OF_RANGE = ['9999999999', '65536', '100000', '4294967294'];

test('initUser outside the sandbox’s ids is refused at create, naming the field', async () => {
  const api = await createTestApi();
  try {
    const create = (initUser: string) =>
      api.app.inject({
        method: 'POST',
        url: '/v1/sandboxes',
        headers: { authorization: `Bearer ${api.rootKey}` },
        payload: { image: 'busybox', initUser },
      });
    for (const initUser of OUT_OF_RANGE) {
      const r = await create(initUser);
      assert.equal(r.statusCode, 400, `${initUser}: ${r.body}`);
      const { error } = r.json<{ error: { code: string; field: string } }>();
      assert.equal(error.code, 'invalid_argument');
      assert.equal(error.field, 'initUser');
    }
    for (const initUser of ['0', '1000', '65535', 'user']) {
      const r = await create(initUser);
      assert.equal(r.statusCode, 201, `${initUser}: ${r.body}`);
    }
  } finally {
    await api.close();
  }
});

test('a user outside the sandbox’s ids is refused by commands, sessions, files and terminals', async () => {
  const api = await createTestApi();
  try {
    const auth = { authorization: `Bearer ${api.rootKey}` };
    const sb = await api.app.inject({
      method: 'POST',
      url: '/v1/sandboxes',
      headers: auth,
      payload: { image: 'busybox' },
    });
    const id = sb.json<{ id: string }>().id;
    const user = OUT_OF_RANGE[0]!;
    const calls = [
      { method: 'POST', url: `/v1/sandboxes/${id}/commands`, payload: { argv: ['id'], user } },
      {
        method: 'POST',
        url: `/v1/sandboxes/${id}/sessions/s/run`,
        payload: { line: 'id', user },
      },
      { method: 'GET', url: `/v1/sandboxes/${id}/files/stat?path=/etc&user=${user}` },
    ] as const;
    for (const c of calls) {
      const r = await api.app.inject({ ...c, headers: auth });
      assert.equal(r.statusCode, 400, `${c.url}: ${r.body}`);
      const { error } = r.json<{ error: { code: string; field: string } }>();
      assert.equal(error.code, 'invalid_argument', c.url);
      assert.equal(error.field, 'user', c.url);
    }
  } finally {
    await api.close();
  }
});

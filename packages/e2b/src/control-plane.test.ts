import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ApiMetrics, CallerLimits, SandboxService } from '@dsec/apiserver';
import { createTestApi, FakeEdge, ScriptedEdge } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { isDsecError } from '@dsec/core';
import { e2bKeyForm, fromE2bKeyForm } from '@dsec/iam';
import { PowerOfKPlacer } from '@dsec/placement';
import {
  createBodyOf,
  egressTarget,
  MAX_MCP_BYTES,
  metadataFilter,
  TEMPLATE_LABEL,
} from './control-plane.js';
import { toDsecSandboxId } from './ids.js';
import { USER_LABEL } from './lifecycle.js';
import { registerE2bRoutes } from './register.js';

/** An apiserver over a fake edge with the E2B routes, for `inject()`. */
async function withApi(
  fn: (
    api: TestApi,
    call: (method: string, url: string, body?: unknown, key?: string) => Promise<Res>,
  ) => Promise<void>,
  edge: { platformImages?: string[] } = {},
): Promise<void> {
  const api = await createTestApi({
    edges: [
      new FakeEdge({
        edgeId: 'edge-a',
        capacity: { memoryMb: 1 << 20, cpuCores: 1000, sandboxes: 100 },
        ...edge,
      }),
    ],
  });
  const service = new SandboxService({
    iam: api.iam,
    edges: api.edges,
    watcher: api.watcher,
    placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
    ids: api.ids,
    metrics: new ApiMetrics(),
  });
  registerE2bRoutes(api.app, {
    service,
    iam: api.iam,
    templates: { base: 'busybox', big: { image: 'python', memoryLimitMb: 2048, cpuCoresLimit: 2 } },
    sandboxDomain: 'sbx.test',
  });
  const call = async (method: string, url: string, body?: unknown, key = api.rootKey) => {
    const res = await api.app.inject({
      method: method as 'GET',
      url,
      headers: {
        'x-api-key': key,
        ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
      },
      ...(body !== undefined ? { payload: JSON.stringify(body) } : {}),
    });
    return {
      status: res.statusCode,
      headers: res.headers,
      json: res.body ? (JSON.parse(res.body) as Record<string, unknown> & unknown[]) : undefined,
    };
  };
  try {
    await fn(api, call);
  } finally {
    await api.close();
  }
}

interface Res {
  status: number;
  headers: Record<string, unknown>;
  json: (Record<string, unknown> & unknown[]) | undefined;
}

test('create maps the template, metadata, envs, timeout and network onto a native create', async () => {
  await withApi(async (api, call) => {
    const res = await call('POST', '/v2/sandboxes', {
      templateID: 'python:3.12/task-7+git',
      timeout: 90,
      metadata: { job: 'rl-1' },
      envVars: { A: '1' },
      network: { allowOut: ['pypi.org', '10.0.0.0/8'], denyOut: ['10.1.0.0/16'] },
      autoPause: false,
      secure: true,
    });
    assert.equal(res.status, 201);
    const body = res.json!;
    assert.equal(body.templateID, 'python:3.12/task-7+git');
    assert.equal(body.envdAccessToken, api.rootKey);
    assert.equal(body.domain, 'sbx.test');
    assert.equal(body.envdVersion, '0.6.4');
    const edge = api.edges.get('edge-a')!;
    const info = await edge.getSandbox(toDsecSandboxId(body.sandboxID as string));
    assert.equal(info.spec.image, 'python:3.12');
    assert.equal(info.spec.workspace, 'task-7');
    assert.deepEqual(info.spec.toolkits, ['git']);
    assert.equal(info.spec.ttlSeconds, 90);
    assert.deepEqual(info.spec.env, { A: '1' });
    assert.deepEqual(info.spec.labels, {
      job: 'rl-1',
      [TEMPLATE_LABEL]: 'python:3.12/task-7+git',
      [USER_LABEL]: 'user',
    });
    // E2B's sandboxes run as `user`: uid 1000, named by the passwd entry the create makes.
    assert.equal(info.spec.initUser, '1000:1000');
    assert.deepEqual(info.spec.networkAllow, [{ domain: 'pypi.org' }, { cidr: '10.0.0.0/8' }]);
    assert.deepEqual(info.spec.networkDeny, [{ cidr: '10.1.0.0/16' }]);

    // A defined name carries its own limits; v1's path creates too.
    const big = await call('POST', '/sandboxes', { templateID: 'big' });
    assert.equal(big.status, 201);
    const detail = await call('GET', `/sandboxes/${big.json!.sandboxID as string}`);
    assert.equal(detail.json!.memoryMB, 2048);
    assert.equal(detail.json!.cpuCount, 2);
    assert.equal(detail.json!.templateID, 'big');
    assert.deepEqual(detail.json!.metadata, {});

    // E2B's SDK starts the template's mcp-gateway itself; create only accepts the config.
    const withMcp = await call('POST', '/v2/sandboxes', {
      templateID: 'base',
      mcp: { github: { githubPersonalAccessToken: 'x' } },
    });
    assert.equal(withMcp.status, 201, JSON.stringify(withMcp.json));

    for (const [bad, field] of [
      [{}, 'templateID'],
      [{ templateID: 'base', autoPause: 'yes' }, 'autoPause'],
      [{ templateID: 'base', autoResume: { enabled: 1 } }, 'autoResume.enabled'],
      [{ templateID: 'base', network: { allowPublicTraffic: 'on' } }, 'network.allowPublicTraffic'],
      [{ templateID: 'base', metadata: { [USER_LABEL]: 'root' } }, `metadata.${USER_LABEL}`],
      [{ templateID: 'base', mcp: ['x'] }, 'mcp'],
      [{ templateID: 'base', mcp: 'x' }, 'mcp'],
      [{ templateID: 'base', mcp: { x: 'y'.repeat(MAX_MCP_BYTES) } }, 'mcp'],
      [{ templateID: 'base', metadata: { [TEMPLATE_LABEL]: 'x' } }, `metadata.${TEMPLATE_LABEL}`],
      [{ templateID: 'base', metadata: { k: 1 } }, 'metadata.k'],
      [{ templateID: 'base', envVars: { '1BAD': 'x' } }, 'envVars.1BAD'],
      [{ templateID: 'base', timeout: -1 }, 'timeout'],
      [{ templateID: 'base', network: { egressProxy: { address: 'p:1' } } }, 'network.egressProxy'],
    ] as const) {
      const r = await call('POST', '/v2/sandboxes', bad);
      assert.equal(r.status, 400, JSON.stringify(bad));
      assert.equal(r.json!.code, 400);
      assert.equal(r.json!.error_code, 'invalid_argument');
      assert.match(
        String(r.json!.message),
        new RegExp(field.replace('.', '\\.')),
        JSON.stringify(r.json),
      );
    }
  });
});

test('list pages newest first (or oldest), filters by metadata, template and state', async () => {
  await withApi(async (_api, call) => {
    const made: string[] = [];
    for (let i = 0; i < 5; i++) {
      const r = await call('POST', '/v2/sandboxes', {
        templateID: i === 0 ? 'busybox' : 'base',
        metadata: { n: String(i), parity: i % 2 ? 'odd' : 'even' },
      });
      made.push(r.json!.sandboxID as string);
      await new Promise((r) => setTimeout(r, 3)); // distinct creation times
    }
    const pages = async (query: string) => {
      const seen: string[] = [];
      let token: string | undefined;
      for (let n = 0; n < 10; n++) {
        const r = await call('GET', `/v2/sandboxes?${query}${token ? `&nextToken=${token}` : ''}`);
        assert.equal(r.status, 200);
        seen.push(...(r.json as unknown as { sandboxID: string }[]).map((s) => s.sandboxID));
        token = r.headers['x-next-token'] as string | undefined;
        if (!token) return seen;
      }
      throw new Error('too many pages');
    };
    assert.deepEqual(await pages('limit=2'), [...made].reverse());
    assert.deepEqual(await pages('limit=2&order=asc'), made);
    const metadata = encodeURIComponent(new URLSearchParams({ parity: 'odd' }).toString());
    assert.deepEqual(await pages(`metadata=${metadata}`), [made[3], made[1]]);
    assert.deepEqual(await pages('template=busybox'), [made[0]]);
    assert.deepEqual(await pages('state=paused'), []);
    assert.deepEqual((await pages('state=running,paused')).length, 5);
    const v1 = await call('GET', '/sandboxes');
    assert.equal((v1.json as unknown as unknown[]).length, 5);
    for (const q of [
      'limit=0',
      'limit=101',
      'order=up',
      'state=stopped',
      'nextToken=zz',
      'startedAfter=x',
    ]) {
      assert.equal((await call('GET', `/v2/sandboxes?${q}`)).status, 400, q);
    }
    const after = await call(
      'GET',
      `/v2/sandboxes?startedAfter=${new Date(Date.now() + 60_000).toISOString()}`,
    );
    assert.deepEqual(after.json, []);
  });
});

test('get, timeout, connect, kill and metrics; unknown IDs are 404, missing keys 401', async () => {
  await withApi(async (api, call) => {
    const id = (await call('POST', '/v2/sandboxes', { templateID: 'base', timeout: 600 })).json!
      .sandboxID as string;
    assert.equal((await call('POST', `/sandboxes/${id}/timeout`, { timeout: 30 })).status, 204);
    const got = await call('GET', `/sandboxes/${id}`);
    // The caller's own key, as create and connect answer it (the Python SDK's connect reads it here).
    assert.equal(got.json!.envdAccessToken, api.rootKey);
    const end = Date.parse(got.json!.endAt as string);
    assert.ok(Math.abs(end - Date.now() - 30_000) < 5_000);
    // Connect only lengthens the TTL.
    const c1 = await call('POST', `/v2/sandboxes/${id}/connect`, { timeout: 10 });
    assert.equal(c1.status, 200);
    assert.equal(Date.parse((await call('GET', `/sandboxes/${id}`)).json!.endAt as string), end);
    await call('POST', `/v2/sandboxes/${id}/connect`, { timeout: 120 });
    assert.ok(Date.parse((await call('GET', `/sandboxes/${id}`)).json!.endAt as string) > end);
    const metrics = await call('GET', `/sandboxes/${id}/metrics`);
    assert.equal((metrics.json as unknown as { memUsed: number }[])[0]?.memUsed, 24 * 1024 * 1024);

    assert.equal((await call('GET', '/sandboxes/sbaaaa')).status, 404);
    assert.equal((await call('GET', '/sandboxes/not-an-id')).status, 404);
    const anon = await api.app.inject({ method: 'GET', url: '/v2/sandboxes' });
    assert.equal(anon.statusCode, 401);
    assert.equal((JSON.parse(anon.body) as { code: number }).code, 401);

    // Another project's key: the sandbox is not found.
    const admin = await api.iam.authenticate(api.rootKey);
    const other = await api.iam.createProject(admin, { name: 'other' });
    const { key } = await api.iam.createKey(admin, { projectId: other.id });
    assert.equal((await call('GET', `/sandboxes/${id}`, undefined, key)).status, 404);
    assert.equal((await call('DELETE', `/sandboxes/${id}`, undefined, key)).status, 404);
    assert.deepEqual((await call('GET', '/v2/sandboxes', undefined, key)).json, []);

    assert.equal((await call('DELETE', `/sandboxes/${id}`)).status, 204);
    assert.equal((await call('DELETE', `/sandboxes/${id}`)).status, 404);
    assert.equal((await call('POST', `/v2/sandboxes/${id}/connect`, {})).status, 404);
  });
});

test("an E2B template naming another tenant's snapshot is not found; its own is", async () => {
  await withApi(
    async (api, call) => {
      const admin = await api.iam.authenticate(api.rootKey);
      const keys: string[] = [];
      for (const name of ['a', 'b']) {
        const p = await api.iam.createProject(admin, { name });
        keys.push((await api.iam.createKey(admin, { projectId: p.id })).key);
      }
      const [a, b] = keys as [string, string];
      const src = (await call('POST', '/v2/sandboxes', { templateID: 'busybox' }, a)).json!
        .sandboxID as string;
      const snap = await call('POST', `/sandboxes/${src}/snapshots`, { name: 'a-snap' }, a);
      assert.equal(snap.status, 201, JSON.stringify(snap.json));
      const own = await call('POST', '/v2/sandboxes', { templateID: 'a-snap' }, a);
      assert.equal(own.status, 201, JSON.stringify(own.json));
      for (const templateID of ['a-snap', 'busybox/a-snap', 'busybox+a-snap']) {
        const theirs = await call('POST', '/v2/sandboxes', { templateID }, b);
        assert.equal(theirs.status, 404, `${templateID}: ${JSON.stringify(theirs.json)}`);
      }
    },
    { platformImages: ['busybox'] },
  );
});

test('pause answers 204, then 409 while paused; connect resumes (201)', async (t) => {
  await withApi(async (_api, call) => {
    const id = (await call('POST', '/v2/sandboxes', { templateID: 'base' })).json!
      .sandboxID as string;
    const first = await call('POST', `/sandboxes/${id}/pause`, {});
    if (first.status === 503) {
      t.skip(`no lifecycle on this tree: ${String(first.json?.message)}`);
      return;
    }
    assert.equal(first.status, 204);
    assert.equal((await call('GET', `/sandboxes/${id}`)).json!.state, 'paused');
    assert.equal((await call('POST', `/sandboxes/${id}/pause`, {})).status, 409);
    const listed = await call('GET', '/v2/sandboxes?state=paused');
    assert.equal((listed.json as unknown as unknown[]).length, 1);
    assert.equal((await call('POST', `/v2/sandboxes/${id}/connect`, { timeout: 60 })).status, 201);
    assert.equal((await call('GET', `/sandboxes/${id}`)).json!.state, 'running');
    assert.equal((await call('POST', `/sandboxes/${id}/resume`, {})).status, 409);
  });
});

test('E2B network entries become CIDRs or domains; metadata filters decode both levels', () => {
  assert.deepEqual(egressTarget('1.2.3.4', 'f'), { cidr: '1.2.3.4' });
  assert.deepEqual(egressTarget('::/0', 'f'), { cidr: '::/0' });
  assert.deepEqual(egressTarget('fd00::1/128', 'f'), { cidr: 'fd00::1/128' });
  assert.deepEqual(egressTarget('*.github.com', 'f'), { domain: '*.github.com' });
  assert.deepEqual(egressTarget('cafe.de', 'f'), { domain: 'cafe.de' });
  assert.throws(
    () => egressTarget(3, 'f'),
    (e) => isDsecError(e, 'invalid_argument'),
  );
  assert.deepEqual(metadataFilter('a=1&b%26c=d%3De'), { a: '1', 'b&c': 'd=e' });
  assert.deepEqual(metadataFilter(new URLSearchParams({ 'x%20y': 'a%26b' }).toString()), {
    'x y': 'a&b',
  });
  assert.deepEqual(metadataFilter(undefined), {});
  assert.deepEqual(
    createBodyOf({ templateID: 'base', allow_internet_access: true }, { base: 'busybox' })
      .networkAllow,
    [{ cidr: '0.0.0.0/0' }, { cidr: '::/0' }],
  );
  assert.deepEqual(
    createBodyOf(
      { templateID: 't', allow_internet_access: false },
      { t: { image: 'x', networkAllow: [{ domain: 'a.org' }] } },
    ),
    {
      image: 'x',
      networkAllow: [{ domain: 'a.org' }],
      networkDeny: [{ cidr: '0.0.0.0/0' }, { cidr: '::/0' }],
      env: {},
      initUser: '1000:1000',
      labels: { [TEMPLATE_LABEL]: 't', [USER_LABEL]: 'user' },
    },
  );
});

test('control-plane requests count against the requests in flight of their key, as /v1 ones do', async () => {
  // issue 24 point 4: `maxRequestsPerKey` bounds one key's requests at once on every door.
  const edge = new ScriptedEdge();
  edge.hangCreates = true;
  const api = await createTestApi({ edges: [edge] });
  const limits = new CallerLimits({ maxRequestsPerKey: 1 });
  registerE2bRoutes(api.app, {
    service: new SandboxService({
      iam: api.iam,
      edges: api.edges,
      watcher: api.watcher,
      placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
      ids: api.ids,
      metrics: new ApiMetrics(),
    }),
    iam: api.iam,
    limits,
  });
  const headers = { 'x-api-key': api.rootKey, 'content-type': 'application/json' };
  try {
    // One create hangs on the edge: the key's one request in flight.
    const hanging = api.app.inject({
      method: 'POST',
      url: '/sandboxes',
      headers,
      payload: JSON.stringify({ templateID: 'busybox' }),
    });
    await new Promise((r) => setTimeout(r, 200));
    const second = await api.app.inject({ method: 'GET', url: '/sandboxes', headers });
    assert.equal(second.statusCode, 429, second.body);
    assert.equal((JSON.parse(second.body) as { error_code: string }).error_code, 'rate_limited');
    assert.ok(second.headers['retry-after']);
    // Another key is not affected.
    const other = await api.iam.createKey(await api.iam.authenticate(api.rootKey), {
      projectId: api.rootProjectId,
    });
    const third = await api.app.inject({
      method: 'GET',
      url: '/sandboxes',
      headers: { 'x-api-key': other.key },
    });
    assert.equal(third.statusCode, 200, third.body);
    void hanging.catch(() => undefined);
  } finally {
    await api.close();
  }
});

test("a key in E2B's format (e2b_ + hex) is the same key; a look-alike or another key's spelling is not", async () => {
  await withApi(async (api, call) => {
    const e2bKey = e2bKeyForm(api.rootKey)!;
    assert.match(e2bKey, /^e2b_[0-9a-f]{64}$/);
    assert.equal(fromE2bKeyForm(e2bKey), api.rootKey);
    assert.equal((await call('GET', '/v2/sandboxes', undefined, e2bKey)).status, 200);
    const created = await call('POST', '/v2/sandboxes', { templateID: 'base' }, e2bKey);
    assert.equal(created.status, 201, JSON.stringify(created.json));
    // One hex digit changed, upper case, short, long: unauthenticated, not another key's access.
    const flipped = e2bKey.slice(0, -1) + (e2bKey.endsWith('0') ? '1' : '0');
    for (const bad of [flipped, e2bKey.toUpperCase(), e2bKey.slice(0, -2), `${e2bKey}00`]) {
      assert.equal((await call('GET', '/v2/sandboxes', undefined, bad)).status, 401, bad);
    }
    assert.equal(e2bKeyForm('not-a-key'), undefined);
    assert.equal(
      e2bKeyForm(`dsk_${'A'.repeat(42)}B`),
      undefined,
      'spare bits set: not a key we made',
    );
  });
});

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ApiMetrics, SandboxService } from '@dsec/apiserver';
import { createTestApi, FakeEdge, ScriptedEdge } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { DsecError } from '@dsec/core';
import type { CommandResult, CommandSpec, LayerInfo, RunCommandOptions } from '@dsec/core';
import type { Principal } from '@dsec/iam';
import { PowerOfKPlacer } from '@dsec/placement';
import type { E2bImages } from './control-plane.js';
import { toDsecSandboxId } from './ids.js';
import {
  AUTO_PAUSE_GRACE_S,
  AUTO_RESUME_LABEL,
  AutoPauser,
  E2bSandboxAccess,
  ON_TIMEOUT_LABEL,
  PUBLIC_TRAFFIC_LABEL,
  TIMEOUT_LABEL,
  USER_LABEL,
} from './lifecycle.js';
import { registerE2bRoutes } from './register.js';
import { USER_SETUP_SCRIPT } from './user-setup.js';

type Res = {
  status: number;
  headers: Record<string, unknown>;
  json: (Record<string, unknown> & unknown[]) | undefined;
};
type Call = (
  method: string,
  url: string,
  body?: unknown,
  key?: string,
  headers?: Record<string, string>,
) => Promise<Res>;

/** A fake edge that records the commands it runs. */
class RecordingEdge extends FakeEdge {
  readonly runs: { id: string; spec: CommandSpec }[] = [];

  override async runCommand(
    id: string,
    command: CommandSpec,
    options?: RunCommandOptions,
  ): Promise<CommandResult> {
    this.runs.push({ id, spec: command });
    return super.runCommand(id, command, options);
  }

  listCommands(id: string): { spec: CommandSpec }[] {
    return this.runs.filter((r) => r.id === id);
  }
}

function layer(name: string, project: string | undefined, kind = 'snapshot'): LayerInfo {
  return {
    name,
    version: 'latest',
    kind: kind as LayerInfo['kind'],
    digest: 'sha256:0',
    sizeBytes: 1,
    contentBytes: 1,
    fileCount: 1,
    createdAt: '2026-12-01T00:00:00.000Z',
    source: kind === 'snapshot' ? 'snapshot' : 'dir',
    ...(project !== undefined ? { project } : {}),
  };
}

/** An apiserver over a fake edge with the E2B routes and an image list of `layers`. */
async function withApi(
  fn: (ctx: { api: TestApi; call: Call; edge: FakeEdge; removed: string[] }) => Promise<void>,
  layers: (projectId: string) => LayerInfo[] = () => [],
  edge: FakeEdge = new RecordingEdge({
    edgeId: 'edge-a',
    capacity: { memoryMb: 1 << 20, cpuCores: 1000, sandboxes: 100 },
  }),
): Promise<void> {
  const api = await createTestApi({ edges: [edge] });
  const service = new SandboxService({
    iam: api.iam,
    edges: api.edges,
    watcher: api.watcher,
    placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
    ids: api.ids,
    metrics: new ApiMetrics(),
  });
  const removed: string[] = [];
  const images: E2bImages = {
    list: async (p: Principal) => layers(p.projectId),
    remove: async (p: Principal, ref: string) => {
      const own = layers(p.projectId).find(
        (l) => l.project === p.projectId && `${l.name}:${l.version}` === ref,
      );
      if (!own) throw new DsecError('image_not_found', `no layer ${ref}`);
      removed.push(`${p.projectId}/${ref}`);
    },
  };
  registerE2bRoutes(api.app, {
    service,
    iam: api.iam,
    images,
    templates: {
      base: 'busybox',
      rooted: { image: 'busybox', user: 'root' },
      ubuntu: { image: 'busybox', initUser: 'ubuntu' },
    },
  });
  const call: Call = async (method, url, body, key = api.rootKey, headers = {}) => {
    const res = await api.app.inject({
      method: method as 'GET',
      url,
      headers: {
        ...(key ? { 'x-api-key': key } : {}),
        ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
        ...headers,
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
    await fn({ api, call, edge, removed });
  } finally {
    await api.close();
  }
}

test("sandboxes run as E2B's user: made in the sandbox by root at create; a template may name root or its own user", async () => {
  await withApi(async ({ call, edge: fake }) => {
    const edge = fake as RecordingEdge;
    const made = await call('POST', '/v2/sandboxes', { templateID: 'base' });
    assert.equal(made.status, 201);
    const id = toDsecSandboxId(made.json!.sandboxID as string);
    const info = await edge.getSandbox(id);
    assert.equal(info.spec.initUser, '1000:1000');
    assert.equal(info.spec.labels[USER_LABEL], 'user');
    // FakeEdge records commands: the setup ran once, as root, in the sandbox.
    const cmds = edge.listCommands(id);
    assert.equal(cmds.length, 1);
    assert.equal(cmds[0]!.spec.user, 'root');
    assert.equal(cmds[0]!.spec.shell, USER_SETUP_SCRIPT);

    const rooted = await call('POST', '/v2/sandboxes', { templateID: 'rooted' });
    const rid = toDsecSandboxId(rooted.json!.sandboxID as string);
    assert.equal((await edge.getSandbox(rid)).spec.initUser, 'root');
    assert.equal(edge.listCommands(rid).length, 0, 'no setup for root');

    const ubuntu = await call('POST', '/v2/sandboxes', { templateID: 'ubuntu' });
    const uid = toDsecSandboxId(ubuntu.json!.sandboxID as string);
    assert.equal((await edge.getSandbox(uid)).spec.initUser, 'ubuntu');
    assert.equal((await edge.getSandbox(uid)).spec.labels[USER_LABEL], 'ubuntu');
    assert.equal(edge.listCommands(uid).length, 0, "a named user is the image's");

    // The labels stay internal: metadata shows none of them.
    const got = await call('GET', `/sandboxes/${made.json!.sandboxID as string}`);
    assert.deepEqual(got.json!.metadata, {});
  });
});

test("unknown routes under E2B's paths answer in E2B's shape, authenticated first", async () => {
  await withApi(async ({ call }) => {
    for (const [method, url] of [
      ['GET', '/v3/templates'],
      ['POST', '/v3/templates'],
      ['GET', '/templates/abc/builds/b1/status'],
      ['GET', '/sandboxes/sbaaaa/logs'],
      ['POST', '/v2/sandboxes/sbaaaa/nothing'],
      ['GET', '/volumes'],
      ['PUT', '/sandboxes'],
      ['GET', '/teams'],
    ] as const) {
      const r = await call(method, url);
      assert.equal(r.status, 404, `${method} ${url}`);
      assert.equal(r.json!.code, 404);
      assert.equal(typeof r.json!.message, 'string');
      assert.match(String(r.json!.message), /E2B API has no/);
      const anon = await call(method, url, undefined, '');
      assert.equal(anon.status, 401, `${method} ${url} without a key`);
      assert.equal(anon.json!.code, 401);
      assert.equal(typeof anon.json!.message, 'string');
    }
    // The routes that exist still answer.
    assert.equal((await call('GET', '/v2/sandboxes')).status, 200);
    assert.equal((await call('GET', '/sandboxes')).status, 200);
  });
});

test('a killed sandbox is not found (404) to fork, connect, resume, pause, snapshot, metrics and timeout', async () => {
  await withApi(async ({ call }) => {
    const made = await call('POST', '/v2/sandboxes', { templateID: 'base' });
    const sid = made.json!.sandboxID as string;
    assert.equal((await call('DELETE', `/sandboxes/${sid}`)).status, 204);
    for (const [method, url, body] of [
      ['POST', `/sandboxes/${sid}/fork`, {}],
      ['POST', `/sandboxes/${sid}/connect`, { timeout: 10 }],
      ['POST', `/v2/sandboxes/${sid}/connect`, { timeout: 10 }],
      ['POST', `/sandboxes/${sid}/resume`, {}],
      ['POST', `/sandboxes/${sid}/pause`, {}],
      ['POST', `/sandboxes/${sid}/snapshots`, {}],
      ['GET', `/sandboxes/${sid}/metrics`, undefined],
      ['POST', `/sandboxes/${sid}/timeout`, { timeout: 10 }],
    ] as const) {
      const r = await call(method, url, body);
      assert.equal(r.status, 404, `${method} ${url}`);
      assert.equal(r.json!.code, 404);
    }
  });
});

test('getMetrics honours start and end; bad times are refused', async () => {
  await withApi(async ({ call }) => {
    const sid = (await call('POST', '/v2/sandboxes', { templateID: 'base' })).json!
      .sandboxID as string;
    const now = Math.floor(Date.now() / 1000);
    const all = await call('GET', `/sandboxes/${sid}/metrics`);
    assert.equal(all.status, 200);
    assert.equal(all.json!.length, 1, 'one sample, now');
    const inWindow = await call(
      'GET',
      `/sandboxes/${sid}/metrics?start=${now - 3600}&end=${now + 3600}`,
    );
    assert.equal(inWindow.json!.length, all.json!.length);
    const past = await call(
      'GET',
      `/sandboxes/${sid}/metrics?start=${now - 7200}&end=${now - 3600}`,
    );
    assert.deepEqual(past.json, []);
    const future = await call('GET', `/sandboxes/${sid}/metrics?start=${now + 3600}`);
    assert.deepEqual(future.json, []);
    for (const q of ['start=abc', 'end=-1', `start=${now}&end=${now - 10}`, 'start=1.5']) {
      const r = await call('GET', `/sandboxes/${sid}/metrics?${q}`);
      assert.equal(r.status, 400, q);
      assert.equal(r.json!.code, 400);
    }
  });
});

test("GET /snapshots lists the caller's project's snapshots only, filtered and paged; DELETE /templates removes one", async () => {
  let projectA = '';
  const names = Array.from({ length: 5 }, (_, i) => `snap-${i}`);
  await withApi(
    async ({ api, call, removed }) => {
      projectA = api.rootProjectId;
      const page1 = await call('GET', '/snapshots?limit=2');
      assert.equal(page1.status, 200);
      assert.deepEqual(
        page1.json!.map((s) => (s as { snapshotID: string }).snapshotID),
        ['snap-0:latest', 'snap-1:latest'],
      );
      assert.deepEqual((page1.json![0] as { names: string[] }).names, ['snap-0:latest']);
      const token = page1.headers['x-next-token'] as string;
      assert.ok(token);
      const rest = await call('GET', `/snapshots?limit=100&nextToken=${token}`);
      assert.deepEqual(
        rest.json!.map((s) => (s as { snapshotID: string }).snapshotID),
        ['snap-2:latest', 'snap-3:latest', 'snap-4:latest'],
        "no base layer, no other project's snapshot",
      );
      assert.equal(rest.headers['x-next-token'], undefined);
      const named = await call('GET', '/snapshots?name=snap-3');
      assert.equal(named.json!.length, 1);
      for (const q of ['limit=0', 'limit=101', 'nextToken=%2e%2e', 'sandboxID=bad!']) {
        const r = await call('GET', `/snapshots?${q}`);
        assert.ok(r.status === 400 || r.status === 404, q);
        assert.equal(typeof r.json!.message, 'string');
      }
      // Deleting: the caller's own; another project's or a platform layer is not found.
      assert.equal((await call('DELETE', '/templates/snap-1:latest')).status, 204);
      assert.deepEqual(removed, [`${projectA}/snap-1:latest`]);
      for (const ref of ['other-snap:latest', 'busybox:latest', 'nope', '..%2f..%2fetc']) {
        const r = await call('DELETE', `/templates/${ref}`);
        assert.equal(r.status, 404, ref);
        assert.equal(r.json!.code, 404);
      }
      assert.equal(removed.length, 1);
    },
    (p) => [
      layer('busybox', undefined, 'base'),
      ...names.map((n) => layer(n, p)),
      layer('other-snap', 'prj-someone-else'),
    ],
  );
});

test('autoPause: the DSec TTL is the backstop after the E2B timeout; the sweep pauses at the timeout and re-times on resume', async () => {
  const clock = { now: Date.parse('2026-12-01T00:00:00.000Z') };
  const clocked = new RecordingEdge({ edgeId: 'edge-a', now: () => clock.now });
  await withApi(
    async ({ api, call, edge }) => {
      const made = await call('POST', '/v2/sandboxes', {
        templateID: 'base',
        timeout: 30,
        autoPause: true,
        autoResume: { enabled: true },
      });
      assert.equal(made.status, 201);
      const id = toDsecSandboxId(made.json!.sandboxID as string);
      const info = await edge.getSandbox(id);
      assert.equal(info.spec.ttlSeconds, 30 + AUTO_PAUSE_GRACE_S);
      assert.equal(info.spec.labels[ON_TIMEOUT_LABEL], 'pause');
      assert.equal(info.spec.labels[AUTO_RESUME_LABEL], 'true');
      assert.equal(info.spec.labels[TIMEOUT_LABEL], '30');
      const got = await call('GET', `/sandboxes/${made.json!.sandboxID as string}`);
      assert.deepEqual(got.json!.lifecycle, { onTimeout: 'pause', autoResume: true });
      assert.equal(
        Date.parse(got.json!.endAt as string),
        Date.parse(info.expiresAt) - AUTO_PAUSE_GRACE_S * 1000,
      );

      // A sweeper with its own clock (no wall-clock threshold): nothing before the timeout.
      const service = new SandboxService({
        iam: api.iam,
        edges: api.edges,
        watcher: api.watcher,
        placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
        ids: api.ids,
        metrics: new ApiMetrics(),
      });
      const principal = await api.iam.authenticate(api.rootKey);
      clock.now = Date.parse(info.expiresAt) - (AUTO_PAUSE_GRACE_S + 5) * 1000;
      const access = new E2bSandboxAccess(service);
      const pauser = new AutoPauser({
        service,
        access,
        now: () => clock.now,
        intervalMs: 3_600_000,
      });
      try {
        pauser.watch(principal, info);
        await pauser.sweep();
        assert.equal((await edge.getSandbox(id)).state, 'running');
        clock.now += 10_000;
        await pauser.sweep();
        assert.equal((await edge.getSandbox(id)).state, 'paused');
        assert.equal(pauser.size, 1, 'still watched: a resume gives it its timeout again');
        assert.equal(access.holds(id), false, 'autoResume: requests may resume it');
        await edge.resumeSandbox(id);
        clock.now += 5_000;
        await pauser.sweep();
        const after = await edge.getSandbox(id);
        assert.equal(after.state, 'running');
        assert.equal(
          Date.parse(after.expiresAt) - clock.now,
          (30 + AUTO_PAUSE_GRACE_S) * 1000,
          'the E2B timeout (30 s) and the grace run again from the resume',
        );
      } finally {
        pauser.close();
      }

      // Without autoPause the timeout is the TTL; the sweep ignores the sandbox.
      const plain = await call('POST', '/v2/sandboxes', { templateID: 'base', timeout: 30 });
      const pid = toDsecSandboxId(plain.json!.sandboxID as string);
      assert.equal((await edge.getSandbox(pid)).spec.ttlSeconds, 30);
      assert.deepEqual(
        (await call('GET', `/sandboxes/${plain.json!.sandboxID as string}`)).json!.lifecycle,
        {
          onTimeout: 'kill',
          autoResume: false,
        },
      );
    },
    () => [],
    clocked,
  );
});

test('envd while paused: /health is 502; without autoResume calls are refused until connect, with it they resume', async () => {
  await withApi(
    async ({ api, call, edge }) => {
      // In-sandbox requests are addressed before routing: through a listening server.
      const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
      const envd = async (sid: string, path: string) => {
        const res = await fetch(new URL(path, url), {
          headers: { 'e2b-sandbox-id': sid, 'x-access-token': api.rootKey },
        });
        const text = await res.text();
        return {
          status: res.status,
          json: text ? (JSON.parse(text) as Record<string, unknown>) : undefined,
        };
      };
      const plain = (await call('POST', '/v2/sandboxes', { templateID: 'base' })).json!
        .sandboxID as string;
      assert.equal((await envd(plain, '/health')).status, 204);
      assert.equal((await call('POST', `/sandboxes/${plain}/pause`)).status, 204);
      assert.equal((await envd(plain, '/health')).status, 502);
      const refused = await envd(plain, '/files?path=/etc/hostname');
      assert.equal(refused.status, 502);
      assert.equal(refused.json!.error_code, 'sandbox_not_running');
      assert.equal((await edge.getSandbox(toDsecSandboxId(plain))).state, 'paused', 'not resumed');
      assert.equal(
        (await call('POST', `/v2/sandboxes/${plain}/connect`, { timeout: 60 })).status,
        201,
      );
      assert.equal((await envd(plain, '/health')).status, 204);

      const auto = (
        await call('POST', '/v2/sandboxes', { templateID: 'base', autoResume: { enabled: true } })
      ).json!.sandboxID as string;
      assert.equal((await call('POST', `/sandboxes/${auto}/pause`)).status, 204);
      assert.equal((await envd(auto, '/health')).status, 204, 'the request resumed it');
      assert.equal((await edge.getSandbox(toDsecSandboxId(auto))).state, 'running');
    },
    () => [],
    new ScriptedEdge(),
  );
});

test('allowPublicTraffic is recorded and answered; off by default, the traffic token is the key', async () => {
  await withApi(async ({ api, call, edge }) => {
    const priv = await call('POST', '/v2/sandboxes', { templateID: 'base' });
    assert.equal(priv.json!.trafficAccessToken, api.rootKey);
    const pub = await call('POST', '/v2/sandboxes', {
      templateID: 'base',
      network: { allowPublicTraffic: true },
    });
    assert.equal(pub.json!.trafficAccessToken, null);
    const id = toDsecSandboxId(pub.json!.sandboxID as string);
    assert.equal((await edge.getSandbox(id)).spec.labels[PUBLIC_TRAFFIC_LABEL], 'true');
    const got = await call('GET', `/sandboxes/${pub.json!.sandboxID as string}`);
    assert.deepEqual(got.json!.network, { allowPublicTraffic: true });
  });
});

/**
 * docs/observability.md lists every metric the edge and the apiserver
 * register and every lifecycle event the edge logs; the Grafana dashboard
 * queries only metrics that exist.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { ApiMetrics } from '@dsec/apiserver';
import { EdgeMetrics } from '@dsec/edge';

const repo = (path: string) => fileURLToPath(new URL(`../../../${path}`, import.meta.url));

function registered(): Set<string> {
  const names = new Set<string>();
  for (const r of [new EdgeMetrics().registry, new ApiMetrics().registry])
    for (const m of r.getMetricsAsArray()) names.add(m.name);
  return names;
}

test('every registered metric is documented, and the docs name no other', async () => {
  const doc = await readFile(repo('docs/observability.md'), 'utf8');
  const names = registered();
  for (const name of names) assert.ok(doc.includes(`\`${name}\``), `${name} is not documented`);
  for (const [, name] of doc.matchAll(/`(dsec_[a-z0-9_]+)`/g))
    assert.ok(names.has(name!), `the docs name ${name}, which nothing registers`);
});

test('the Grafana dashboard queries only registered metrics', async () => {
  const dashboard = JSON.parse(await readFile(repo('deploy/grafana/dsec.json'), 'utf8')) as {
    panels: { targets?: { expr: string }[] }[];
  };
  const names = registered();
  const used = new Set<string>();
  for (const p of dashboard.panels)
    for (const t of p.targets ?? [])
      for (const [name] of t.expr.matchAll(/dsec_[a-z0-9_]+/g))
        used.add(name.replace(/_(bucket|sum|count)$/, ''));
  assert.ok(used.size >= 10);
  for (const name of used) assert.ok(names.has(name), `the dashboard queries unknown ${name}`);
});

test('every lifecycle event the edge logs is documented', async () => {
  const doc = await readFile(repo('docs/observability.md'), 'utf8');
  for (const file of [
    'packages/edge/src/edge.ts',
    'packages/edge/src/backends/container/container-backend.ts',
    'packages/edge/src/lifecycle/lifecycle.ts',
  ]) {
    const source = await readFile(repo(file), 'utf8');
    const messages = [...source.matchAll(/log\?\.\(\s*(?:[^,']*\?\s*)?'([^']+)'/g)].map(
      (m) => m[1]!,
    );
    assert.ok(messages.length > 0, file);
    for (const msg of messages) assert.ok(doc.includes(msg), `${file}: "${msg}" is not documented`);
  }
});

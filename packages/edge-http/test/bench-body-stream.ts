/**
 * Throughput of a streamed request body (`writeStdin`) through `RemoteEdge` →
 * `serveEdge`, into a consumer that only counts (docs/edge-protocol.md "Cost").
 * Not a test: it prints numbers and asserts nothing.
 *
 *   node --conditions=dsec-source --import tsx packages/edge-http/test/bench-body-stream.ts \
 *     [--mib 256] [--runs 3] [--impl DIR]
 *
 * `--impl DIR` as in bench-exec-round-trip.ts (another version's `src` for before/after runs).
 */
import { resolve } from 'node:path';
import { Readable } from 'node:stream';
import { parseArgs } from 'node:util';
import type { EdgeApi, SandboxIoApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import * as current from '@dsec/edge-http';

const { values } = parseArgs({
  options: {
    mib: { type: 'string', default: '256' },
    runs: { type: 'string', default: '3' },
    impl: { type: 'string' },
  },
});
const { newEdgeSecret, RemoteEdge, serveEdge } = (
  values.impl ? await import(resolve(values.impl, 'index.ts')) : current
) as typeof current;
const total = Number(values.mib) * 2 ** 20;

const fake = new FakeEdge({ edgeId: 'bench' });
const io: Partial<SandboxIoApi> = {
  writeStdin: async (_id, _cid, data) => {
    let bytes = 0;
    if (data && !Buffer.isBuffer(data)) for await (const c of data) bytes += (c as Buffer).length;
    return { bytes };
  },
};
const edge: EdgeApi = {
  edgeId: 'bench',
  status: (s) => fake.status(s),
  createSandbox: (r, s) => fake.createSandbox(r, s),
  getSandbox: (id, s) => fake.getSandbox(id, s),
  listSandboxes: (f, s) => fake.listSandboxes(f, s),
  stopSandbox: (id, s) => fake.stopSandbox(id, s),
  runCommand: (id, c, o) => fake.runCommand(id, c, o),
  io: io as SandboxIoApi,
};
const secret = newEdgeSecret();
const server = await serveEdge({ edge, secret });
const client = new RemoteEdge({ edgeId: 'bench', url: server.url, secret });
const chunk = Buffer.alloc(64 * 1024, 0x61);
for (let run = 0; run < Number(values.runs); run++) {
  let sent = 0;
  const body = new Readable({
    read() {
      if (sent >= total) return void this.push(null);
      sent += chunk.length;
      this.push(chunk);
    },
  });
  const cpu = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  const { bytes } = await client.io.writeStdin('sb', 'cmd', body, { eof: true });
  const ms = Number(process.hrtime.bigint() - t0) / 1e6;
  const used = process.cpuUsage(cpu);
  console.log(
    `${values.impl ?? 'current'}: ${bytes / 2 ** 20} MiB in ${ms.toFixed(0)} ms, ` +
      `${(bytes / 2 ** 20 / (ms / 1000)).toFixed(0)} MiB/s, ` +
      `CPU ${((used.user + used.system) / 1000).toFixed(0)} ms`,
  );
}
client.close();
await server.close();

/**
 * The attacker of `dsec bench bounds`, in a process of its own as a real one
 * would be (in the node's process it would share the event loop it is
 * measured against). Reads its job as JSON from argv[2], floods until its
 * stdin closes, then prints what it saw as one JSON line on stdout.
 *
 * Floods (plain HTTP, no SDK: an attacker sends what it likes):
 * - `bogus-keys`: requests with a fresh random key each, `concurrency` at once,
 *   paced to `ratePerSecond`;
 * - `idle`: `connections` keep-alive connections spread over `addresses`,
 *   one `/healthz` each and then silent; one the server closes is opened again;
 * - `unread`: `streams` command output streams of one key that are never read;
 *   one the server cuts is opened again;
 * - `junk`: requests with a foreign `Host`, over-long IDs and over-long URLs;
 * - `control`: the bogus-keys flood against a server of this process's own
 *   that answers 401 at once: what the attacker's own CPU costs the machine,
 *   with nothing of it in the node.
 */
import http from 'node:http';
import net from 'node:net';
import { randomBytes } from 'node:crypto';

export interface FloodJob {
  kind: 'bogus-keys' | 'idle' | 'unread' | 'junk' | 'control';
  port: number;
  concurrency?: number;
  /** Requests per second of the bogus-keys and junk floods (0: as fast as `concurrency` goes). */
  ratePerSecond?: number;
  connections?: number;
  /** Local addresses the connections come from (127.0.0.x). */
  addresses?: string[];
  /** The idle flood opens a connection the server closed again after this long (0: never). */
  reconnectMs?: number;
  streams?: number;
  key?: string;
  sandboxId?: string;
}

export interface FloodResult {
  kind: FloodJob['kind'];
  seconds: number;
  requests: number;
  statuses: Record<string, number>;
  /** Connections the server closed (idle: evicted or keep-alive shortened; unread: cut). */
  closedByServer: number;
  /** Connections or streams open when the flood stopped. */
  openAtEnd: number;
  errors: number;
}

async function run(job: FloodJob): Promise<FloodResult> {
  const started = process.hrtime.bigint();
  let stopping = false;
  const statuses: Record<string, number> = {};
  const count = (status: number | string) =>
    (statuses[String(status)] = (statuses[String(status)] ?? 0) + 1);
  let requests = 0;
  let closedByServer = 0;
  let errors = 0;
  const open = new Set<net.Socket>();
  const stopped = new Promise<void>((resolve) => {
    process.stdin.on('end', resolve).on('close', resolve);
    process.stdin.resume();
  });

  const agent = new http.Agent({ keepAlive: true, maxSockets: job.concurrency ?? 32 });
  const get = (path: string, headers: Record<string, string>) =>
    new Promise<void>((resolve) => {
      const req = http.request(
        { host: '127.0.0.1', port: job.port, path, headers, agent },
        (res) => {
          count(res.statusCode ?? 0);
          res.resume();
          res.on('end', resolve).on('error', resolve);
        },
      );
      req.on('error', () => {
        errors++;
        resolve();
      });
      req.end();
      requests++;
    });

  // Pacing: each loop takes the next slot of a shared schedule of `ratePerSecond` slots.
  const rate = job.ratePerSecond ?? 0;
  const t0 = performance.now();
  let slot = 0;
  const paced = async () => {
    if (rate <= 0) return;
    const at = t0 + (slot++ * 1000) / rate;
    const wait = at - performance.now();
    if (wait > 0) await new Promise((r) => setTimeout(r, wait));
  };
  const loops: Promise<void>[] = [];
  if (job.kind === 'control') {
    const own = http.createServer((_req, res) => {
      const body = '{"error":{"code":"unauthenticated","message":"unknown API key"}}';
      res.writeHead(401, { 'content-type': 'application/json', 'content-length': body.length });
      res.end(body);
    });
    await new Promise<void>((r) => own.listen(0, '127.0.0.1', r));
    job.port = (own.address() as net.AddressInfo).port;
    own.unref();
  }
  if (job.kind === 'bogus-keys' || job.kind === 'control') {
    for (let i = 0; i < (job.concurrency ?? 32); i++) {
      loops.push(
        (async () => {
          while (!stopping) {
            await paced();
            const key = `dsk_${randomBytes(32).toString('base64url')}`;
            await get('/v1/sandboxes', { authorization: `Bearer ${key}` });
          }
        })(),
      );
    }
  } else if (job.kind === 'junk') {
    const long = 'x'.repeat(300);
    const shapes: [string, Record<string, string>][] = [
      ['/healthz', { host: 'rebind.attacker.example' }],
      [`/v1/sandboxes/${long}`, {}],
      [`/v1/sandboxes?labels=${'a'.repeat(9000)}`, {}],
    ];
    for (let i = 0; i < (job.concurrency ?? 32); i++) {
      loops.push(
        (async () => {
          for (let n = i; !stopping; n++) {
            await paced();
            const [path, headers] = shapes[n % shapes.length]!;
            await get(path, headers);
          }
        })(),
      );
    }
  } else if (job.kind === 'idle') {
    const addresses = job.addresses ?? ['127.0.0.1'];
    const openOne = (localAddress: string): Promise<void> =>
      new Promise((resolve) => {
        const s = net.connect({ port: job.port, host: '127.0.0.1', localAddress });
        let answered = false;
        s.setEncoding('latin1');
        s.on('error', () => undefined);
        s.once('connect', () => {
          open.add(s);
          s.write('GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n');
          requests++;
        });
        s.on('data', (d: string) => {
          if (!answered && d.includes('\r\n\r\n')) {
            answered = true;
            count(Number(d.slice(9, 12)) || 'other');
            resolve();
          }
        });
        s.once('close', () => {
          open.delete(s);
          if (!answered) resolve();
          if (stopping) return;
          closedByServer++;
          // Held open again, as an attacker that keeps up the pressure would.
          if (job.reconnectMs) setTimeout(() => void openOne(localAddress), job.reconnectMs);
        });
      });
    const total = job.connections ?? 1000;
    for (let i = 0; i < total; i += 500) {
      await Promise.all(
        Array.from({ length: Math.min(500, total - i) }, (_, k) =>
          openOne(addresses[(i + k) % addresses.length]!),
        ),
      );
    }
  } else {
    const body = JSON.stringify({ shell: 'yes', timeoutMs: 600_000 });
    const openStream = () => {
      const s = net.connect({ port: job.port, host: '127.0.0.1' });
      s.on('error', () => undefined);
      s.once('connect', () => {
        open.add(s);
        s.write(
          `POST /v1/sandboxes/${job.sandboxId}/commands HTTP/1.1\r\nHost: 127.0.0.1\r\n` +
            `Authorization: Bearer ${job.key}\r\nContent-Type: application/json\r\n` +
            `Accept: application/x-ndjson\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
        );
        requests++;
        s.once('data', (d: Buffer) => count(Number(d.subarray(9, 12).toString()) || 'other'));
        // Never read past the first bytes: the kernel buffers fill, then the server's.
        s.pause();
      });
      s.once('close', () => {
        open.delete(s);
        if (stopping) return;
        closedByServer++;
        setTimeout(openStream, 200);
      });
      // A cut stream is reset; a socket that never reads notices only when it writes, so it
      // sends an empty line now and then (HTTP/1.1 lets a client send blank lines between requests).
      const probe = setInterval(() => {
        if (s.destroyed) return clearInterval(probe);
        s.write('\r\n');
      }, 1000);
      s.once('close', () => clearInterval(probe));
    };
    for (let i = 0; i < (job.streams ?? 150); i++) openStream();
  }

  process.stdout.write('ready\n');
  await stopped;
  stopping = true;
  await Promise.race([Promise.all(loops), new Promise((r) => setTimeout(r, 5000))]);
  const openAtEnd = open.size;
  for (const s of open) s.destroy();
  agent.destroy();
  return {
    kind: job.kind,
    seconds: Number(process.hrtime.bigint() - started) / 1e9,
    requests,
    statuses,
    closedByServer,
    openAtEnd,
    errors,
  };
}

run(JSON.parse(process.argv[2] ?? '{}') as FloodJob).then(
  (result) => {
    process.stdout.write(JSON.stringify(result) + '\n');
    process.exit(0);
  },
  (err: unknown) => {
    process.stderr.write(String(err) + '\n');
    process.exit(1);
  },
);

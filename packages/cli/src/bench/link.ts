import { createServer, connect, type AddressInfo, type Server, type Socket } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';

const BURST_MS = 10;

/**
 * A network link of limited bandwidth in front of a store: a TCP proxy on
 * 127.0.0.1 that forwards to `target` and paces the bytes flowing back to
 * clients at `bytesPerSec`, shared by every connection (one link, like a
 * node's NIC to an object store). It counts the bytes it carried each way,
 * so a benchmark reads what really crossed the link instead of modelling it.
 */
export class ThrottledLink {
  /** Bytes carried from the store to clients (downloads) since the last reset. */
  bytesDown = 0;
  /** Bytes carried from clients to the store (requests, uploads). */
  bytesUp = 0;
  #freeAtMs = 0;
  readonly #sockets = new Set<Socket>();

  private constructor(
    readonly server: Server,
    readonly bytesPerSec: number,
    readonly target: { host: string; port: number },
  ) {}

  static async open(
    target: { host: string; port: number },
    bytesPerSec: number,
  ): Promise<ThrottledLink> {
    const server = createServer();
    const link = new ThrottledLink(server, bytesPerSec, target);
    server.on('connection', (client) => link.#relay(client));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(0, '127.0.0.1', () => resolve());
    });
    return link;
  }

  get url(): string {
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  resetCounters(): void {
    this.bytesDown = 0;
    this.bytesUp = 0;
  }

  async close(): Promise<void> {
    for (const s of this.#sockets) s.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  /**
   * How long to hold `n` bytes so the link never exceeds its bandwidth. A
   * 10 ms burst allowance lets the link catch up on timers that fire late
   * (they have 1 ms granularity), so the average rate is the configured one.
   */
  #delayFor(n: number): number {
    const now = Date.now();
    const start = Math.max(now - BURST_MS, this.#freeAtMs);
    this.#freeAtMs = start + (n / this.bytesPerSec) * 1000;
    return this.#freeAtMs - now;
  }

  #relay(client: Socket): void {
    const upstream = connect(this.target.port, this.target.host);
    for (const s of [client, upstream]) {
      this.#sockets.add(s);
      s.on('close', () => this.#sockets.delete(s));
      s.on('error', () => {
        client.destroy();
        upstream.destroy();
      });
    }
    client.on('data', (chunk: Buffer) => {
      this.bytesUp += chunk.length;
      if (!upstream.write(chunk)) client.pause();
    });
    upstream.on('drain', () => client.resume());
    client.on('end', () => upstream.end());
    // Downstream chunks are delayed in order, the store's socket paused while
    // one waits; its end follows the last chunk.
    let queue = Promise.resolve();
    upstream.on('data', (chunk: Buffer) => {
      this.bytesDown += chunk.length;
      const wait = this.#delayFor(chunk.length);
      upstream.pause();
      queue = queue.then(async () => {
        if (wait > 0) await sleep(wait);
        if (!client.destroyed && !client.write(chunk)) await drained(client);
        upstream.resume();
      });
    });
    upstream.on('end', () => {
      queue = queue.then(() => {
        client.end();
      });
    });
  }
}

function drained(socket: Socket): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      socket.off('drain', done);
      socket.off('close', done);
      resolve();
    };
    socket.on('drain', done);
    socket.on('close', done);
  });
}

import type { AddressInfo, Socket } from 'node:net';
import type { FastifyInstance } from 'fastify';

export interface Listening {
  url: string;
  /**
   * Stops accepting; requests in flight get `drainMs` to finish, then every
   * connection still open (upgraded terminals and port streams included) is cut.
   */
  close(drainMs?: number): Promise<void>;
}

/** Serves a built apiserver and returns its URL and a draining close. */
export async function listenApi(
  app: FastifyInstance,
  where: { host: string; port: number },
): Promise<Listening> {
  // Every connection, so that close() can cut the ones still open after the drain:
  // upgraded ones (terminals) are no longer the HTTP server's to close.
  const sockets = new Set<Socket>();
  app.server.on('connection', (socket: Socket) => {
    sockets.add(socket);
    socket.once('close', () => sockets.delete(socket));
  });
  // A burst of a thousand clients connecting at once overflows Node's default
  // accept queue (511); the dropped handshakes come back seconds later and
  // meet the headers timeout (408). 4096 is the kernel's default somaxconn.
  await app.listen({ port: where.port, host: where.host, backlog: 4096 });
  const address = app.server.address() as AddressInfo;
  const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
  return {
    url: `http://${host}:${address.port}`,
    async close(drainMs = 2000) {
      const closed = app.close();
      const cut = setTimeout(() => {
        app.server.closeAllConnections();
        for (const socket of sockets) socket.destroy();
      }, drainMs);
      try {
        await closed;
      } finally {
        clearTimeout(cut);
      }
    },
  };
}

/**
 * @dsec/edge-http — the edge as a network service (paper 3.3): `serveEdge`
 * serves a whole `EdgeApi` (lifecycle, commands streamed as they run,
 * sessions, files, ports, terminals, events, network updates) over
 * HTTP/1.1, and `RemoteEdge` is its client, itself an `EdgeApi`. Both ends
 * authenticate each other, and every byte between them, with a per-edge
 * secret; TLS with a pinned certificate keeps the bytes private
 * (docs/edge-protocol.md).
 *
 * @example
 * ```ts
 * import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';
 * const secret = newEdgeSecret();
 * const server = await serveEdge({ edge, secret, host: '10.0.0.7', port: 7443 });
 * const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
 * await remote.runCommand(sandboxId, { argv: ['echo', 'hi'] }, { projectId });
 * remote.close();
 * await server.close();
 * ```
 */
export { newEdgeSecret } from './auth.js';
export { serveEdge } from './server.js';
export type { EdgeLogger, EdgeServer, EdgeServerOptions, EdgeTlsOptions } from './server.js';
export { certificateSha256, normalizeFingerprint } from './tls.js';
export { RemoteEdge } from './client.js';
export type { RemoteEdgeOptions } from './client.js';

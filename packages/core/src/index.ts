/**
 * @dsec/core — the vocabulary every DSec component shares: domain types,
 * sandbox IDs, the closed error set and the interfaces at each seam. No I/O.
 *
 * @example
 * ```ts
 * import { DsecError, SandboxIdCodec } from '@dsec/core';
 * const ids = new SandboxIdCodec(clusterSecret);
 * const id = ids.mint('node-1');
 * ids.decode(id).edgeId; // 'node-1'
 * throw new DsecError('invalid_argument', 'memoryLimitMb must be ≥ 16', { field: 'memoryLimitMb' });
 * ```
 */
export * from './errors.js';
export * from './ids.js';
export * from './types.js';
export * from './images.js';
export * from './edge-api.js';
export * from './sandbox-io.js';
export * from './chunk-table.js';
export * from './fingerprint.js';
export * from './fncall.js';
export * from './display.js';
export * from './connection-limits.js';
export * from './output-budget.js';
export * from './users.js';
export * from './volumes.js';

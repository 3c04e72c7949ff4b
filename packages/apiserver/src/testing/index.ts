/**
 * Test helpers for code that talks to edges: an in-memory `EdgeApi` that
 * keeps the edge contract. Import from `@dsec/apiserver/testing`.
 *
 * @example
 * ```ts
 * import { FakeEdge } from '@dsec/apiserver/testing';
 * const edge = new FakeEdge({ edgeId: 'edge-a', capacity: { memoryMb: 4096, cpuCores: 4, sandboxes: 2 } });
 * ```
 */
export { FakeEdge, FAKE_MEMORY_BYTES } from './fake-edge.js';
export type { FakeEdgeOptions } from './fake-edge.js';
export { createTestApi } from './harness.js';
export type { TestApi } from './harness.js';
// The EdgeApi conformance suite lives in @dsec/core/testing (every edge implementation runs it).
export { edgeApiConformance, conformanceSpec } from '@dsec/core/testing';
export type { EdgeUnderTest } from '@dsec/core/testing';
export { ScriptedEdge, startTestServer, TEST_LAYERS } from './scripted-edge.js';
export { addFnCall, FnCallDouble } from './fncall-double.js';
export type { FnCallScript } from './fncall-double.js';
export type { RecordedRequest, ScriptedCommand, TestServer } from './scripted-edge.js';
export { runApiFuzz } from './api-fuzz/api-fuzz.js';
export type {
  ApiFuzzOptions,
  ApiFuzzReport,
  FuzzProperty,
  FuzzRequest,
  FuzzViolation,
} from './api-fuzz/api-fuzz.js';
export { FuzzEdge } from './api-fuzz/fuzz-edge.js';

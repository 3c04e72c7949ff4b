/**
 * Test helpers every edge implementation shares: the `EdgeApi` conformance
 * suite. Import from `@dsec/core/testing` (test code only: it registers
 * `node:test` cases).
 *
 * @example
 * ```ts
 * import { edgeApiConformance } from '@dsec/core/testing';
 * edgeApiConformance('MyEdge', async () => ({ edge, capacitySandboxes: 2, mintId, image: 'base' }));
 * ```
 */
export { edgeApiConformance, conformanceSpec } from './edge-conformance.js';
export type { EdgeUnderTest } from './edge-conformance.js';

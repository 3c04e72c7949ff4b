import { SandboxIdCodec } from '@dsec/core';
import { edgeApiConformance, FakeEdge } from './index.js';

const ids = new SandboxIdCodec('fake-edge-conformance-secret');

edgeApiConformance('FakeEdge', async () => ({
  edge: new FakeEdge({ edgeId: 'edge-t', capacity: { memoryMb: 4096, cpuCores: 4, sandboxes: 3 } }),
  capacitySandboxes: 3,
  mintId: () => ids.mint('edge-t'),
  image: 'base',
}));

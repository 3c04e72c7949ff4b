// The edge binds command request IDs the same way, so the function lives in core.
export { canonicalJson, requestFingerprint } from '@dsec/core';

import {
  DIGEST_PATTERN,
  DsecError,
  LAYER_NAME_PATTERN,
  LAYER_VERSION_PATTERN,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';

export const LAYER_KINDS: readonly LayerKind[] = ['base', 'workspace', 'toolkit'];

export function assertDigest(digest: unknown, field = 'digest'): asserts digest is string {
  if (typeof digest !== 'string' || !DIGEST_PATTERN.test(digest)) {
    throw new DsecError('invalid_argument', `${field} must look like sha256:<64 hex digits>`, {
      field,
    });
  }
}

export function assertLayerName(name: unknown, field = 'name'): asserts name is string {
  if (typeof name !== 'string' || !LAYER_NAME_PATTERN.test(name)) {
    throw new DsecError('invalid_argument', `${field} must match ${String(LAYER_NAME_PATTERN)}`, {
      field,
    });
  }
}

export function assertLayerVersion(version: unknown, field = 'version'): asserts version is string {
  if (typeof version !== 'string' || !LAYER_VERSION_PATTERN.test(version)) {
    throw new DsecError(
      'invalid_argument',
      `${field} must match ${String(LAYER_VERSION_PATTERN)}`,
      {
        field,
      },
    );
  }
}

export function assertLayerKind(kind: unknown, field = 'kind'): asserts kind is LayerKind {
  if (!LAYER_KINDS.includes(kind as LayerKind)) {
    throw new DsecError('invalid_argument', `${field} must be one of ${LAYER_KINDS.join(', ')}`, {
      field,
    });
  }
}

function assertCount(value: unknown, field: string): void {
  if (!Number.isSafeInteger(value) || (value as number) < 0) {
    throw new DsecError('invalid_argument', `${field} must be a non-negative integer`, { field });
  }
}

/** Checks a record before a store writes it; throws `invalid_argument` naming the field. */
export function validateLayerInfo(layer: LayerInfo): void {
  assertLayerName(layer.name);
  assertLayerVersion(layer.version);
  assertLayerKind(layer.kind);
  assertDigest(layer.digest);
  if (layer.blobDigest !== undefined) assertDigest(layer.blobDigest, 'blobDigest');
  assertCount(layer.sizeBytes, 'sizeBytes');
  assertCount(layer.contentBytes, 'contentBytes');
  assertCount(layer.fileCount, 'fileCount');
  if (typeof layer.createdAt !== 'string' || Number.isNaN(Date.parse(layer.createdAt))) {
    throw new DsecError('invalid_argument', 'createdAt must be an ISO 8601 time', {
      field: 'createdAt',
    });
  }
  if (typeof layer.source !== 'string' || layer.source === '') {
    throw new DsecError('invalid_argument', 'source must be a non-empty string', {
      field: 'source',
    });
  }
}

/** The blobs a record refers to. */
export function layerDigests(layer: LayerInfo): string[] {
  return layer.blobDigest === undefined ? [layer.digest] : [layer.digest, layer.blobDigest];
}

/** Keeps only the known fields, so a record on disk never carries stray data. */
export function normalizeLayerInfo(layer: LayerInfo): LayerInfo {
  return {
    name: layer.name,
    version: layer.version,
    kind: layer.kind,
    digest: layer.digest,
    ...(layer.blobDigest !== undefined ? { blobDigest: layer.blobDigest } : {}),
    sizeBytes: layer.sizeBytes,
    contentBytes: layer.contentBytes,
    fileCount: layer.fileCount,
    createdAt: layer.createdAt,
    source: layer.source,
  };
}

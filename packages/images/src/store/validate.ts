import {
  DIGEST_PATTERN,
  DsecError,
  formatLayerRef,
  LAYER_NAME_PATTERN,
  LAYER_PROJECT_PATTERN,
  LAYER_VERSION_PATTERN,
  parseLayerKey,
  parseLayerRef,
  type ImageConfig,
  type LayerInfo,
  type LayerKey,
  type LayerKind,
} from '@dsec/core';

/** The kinds a layer can be built or imported as. */
export const LAYER_KINDS: readonly LayerKind[] = ['base', 'workspace', 'toolkit'];
/** The kinds a stored record may have: snapshots are only made by an edge (`snapshotSandbox`). */
const RECORD_KINDS: readonly LayerKind[] = [...LAYER_KINDS, 'snapshot'];

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

export function assertLayerKind(
  kind: unknown,
  field = 'kind',
  kinds: readonly LayerKind[] = LAYER_KINDS,
): asserts kind is LayerKind {
  if (!kinds.includes(kind as LayerKind)) {
    throw new DsecError('invalid_argument', `${field} must be one of ${kinds.join(', ')}`, {
      field,
    });
  }
}

/** A layer owner (a project ID); `invalid_argument` naming `field` otherwise. */
export function assertLayerProject(project: unknown, field = 'project'): asserts project is string {
  if (typeof project !== 'string' || !LAYER_PROJECT_PATTERN.test(project)) {
    throw new DsecError('invalid_argument', `${field} must be a project ID`, { field });
  }
}

/**
 * The record a store call names: `ref` in the platform's namespace, or in
 * `options.project`'s. A malformed ref or project is `image_not_found` (the
 * lookup of something that cannot exist), so no call can steer a lookup
 * into a path or key of its own making.
 */
export function storeKey(
  ref: string,
  options: { project?: string | undefined } | undefined,
): LayerKey {
  const parsed = parseLayerRef(ref);
  if (!parsed) {
    throw new DsecError('image_not_found', `no layer ${JSON.stringify(ref)} (malformed reference)`);
  }
  const project = options?.project;
  if (project === undefined) return parsed;
  if (typeof project !== 'string' || !LAYER_PROJECT_PATTERN.test(project)) {
    throw new DsecError('image_not_found', `no layer ${JSON.stringify(ref)} (malformed project)`);
  }
  return { ...parsed, project };
}

/** The order `listLayers` answers in: name, version, then owner (the platform's first). */
export function compareLayers(a: LayerInfo, b: LayerInfo): number {
  return (
    compare(a.name, b.name) ||
    compare(a.version, b.version) ||
    compare(a.project ?? '', b.project ?? '')
  );
}

function compare(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
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
  assertLayerKind(layer.kind, 'kind', RECORD_KINDS);
  assertDigest(layer.digest);
  if (layer.blobDigest !== undefined) assertDigest(layer.blobDigest, 'blobDigest');
  if (layer.blobChunksDigest !== undefined) {
    assertDigest(layer.blobChunksDigest, 'blobChunksDigest');
    if (layer.blobDigest === undefined) {
      throw new DsecError('invalid_argument', 'blobChunksDigest needs a blobDigest', {
        field: 'blobChunksDigest',
      });
    }
  }
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
  if (layer.project !== undefined) assertLayerProject(layer.project);
  if (layer.parents !== undefined) assertStrings(layer.parents, 'parents');
  if (layer.scrub !== undefined) assertStrings(layer.scrub, 'scrub');
  if (layer.parentDigests !== undefined) {
    assertStrings(layer.parentDigests, 'parentDigests');
    layer.parentDigests.forEach((d, i) => assertDigest(d, `parentDigests.${i}`));
  }
  // A snapshot names a whole image: its stack must be recorded and pinned.
  if (
    layer.kind === 'snapshot' &&
    (layer.parents === undefined ||
      layer.parents.length === 0 ||
      layer.parentDigests?.length !== layer.parents.length)
  ) {
    throw new DsecError(
      'invalid_argument',
      'a snapshot needs parents and one parentDigest per parent',
      { field: 'parents' },
    );
  }
  if (layer.kind === 'snapshot') {
    layer.parents!.forEach((p, i) => {
      if (!parseLayerKey(p)) {
        throw new DsecError('invalid_argument', `parents.${i} must be a layer key`, {
          field: `parents.${i}`,
        });
      }
    });
  }
  const config = layer.config as unknown;
  if (config !== undefined) {
    if (typeof config !== 'object' || config === null || Array.isArray(config)) {
      throw new DsecError('invalid_argument', 'config must be an object', { field: 'config' });
    }
    const c = config as Record<string, unknown>;
    for (const key of ['env', 'cmd', 'entrypoint'] as const) {
      if (c[key] !== undefined) assertStrings(c[key], `config.${key}`);
    }
    for (const key of ['workingDir', 'user'] as const) {
      if (c[key] !== undefined && typeof c[key] !== 'string') {
        throw new DsecError('invalid_argument', `config.${key} must be a string`, {
          field: `config.${key}`,
        });
      }
    }
  }
}

/** The blobs a record refers to. */
export function layerDigests(layer: LayerInfo): string[] {
  return [layer.digest, layer.blobDigest, layer.blobChunksDigest].filter(
    (d): d is string => d !== undefined,
  );
}

/** Keeps only the known fields, so a record on disk never carries stray data. */
export function normalizeLayerInfo(layer: LayerInfo): LayerInfo {
  return {
    name: layer.name,
    version: layer.version,
    kind: layer.kind,
    digest: layer.digest,
    ...(layer.blobDigest !== undefined ? { blobDigest: layer.blobDigest } : {}),
    ...(layer.blobChunksDigest !== undefined ? { blobChunksDigest: layer.blobChunksDigest } : {}),
    sizeBytes: layer.sizeBytes,
    contentBytes: layer.contentBytes,
    fileCount: layer.fileCount,
    createdAt: layer.createdAt,
    source: layer.source,
    ...(layer.project !== undefined ? { project: layer.project } : {}),
    ...(layer.config !== undefined ? { config: normalizeConfig(layer.config) } : {}),
    ...(layer.parents !== undefined ? { parents: [...layer.parents] } : {}),
    ...(layer.parentDigests !== undefined ? { parentDigests: [...layer.parentDigests] } : {}),
    ...(layer.scrub !== undefined ? { scrub: [...layer.scrub] } : {}),
  };
}

function normalizeConfig(config: ImageConfig): ImageConfig {
  const out: ImageConfig = {};
  if (config.env !== undefined) out.env = [...config.env];
  if (config.cmd !== undefined) out.cmd = [...config.cmd];
  if (config.entrypoint !== undefined) out.entrypoint = [...config.entrypoint];
  if (config.workingDir !== undefined) out.workingDir = config.workingDir;
  if (config.user !== undefined) out.user = config.user;
  return out;
}

function assertStrings(value: unknown, field: string): void {
  if (!Array.isArray(value) || value.some((v) => typeof v !== 'string')) {
    throw new DsecError('invalid_argument', `${field} must be an array of strings`, { field });
  }
}

/** A byte range a store can serve: whole, non-negative, at most 1 GiB at a time. */
export function assertRange(offset: unknown, length: unknown): void {
  for (const [field, v] of [
    ['offset', offset],
    ['length', length],
  ] as const) {
    if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 0) {
      throw new DsecError('invalid_argument', `${field} must be a non-negative integer`, { field });
    }
  }
  if ((length as number) > 2 ** 30) {
    throw new DsecError('invalid_argument', 'length must be at most 1 GiB', { field: 'length' });
  }
}

/** Refuses a record whose blobs are not in the store yet (`invalid_argument` naming the field). */
export async function assertLayerBlobsStored(
  record: LayerInfo,
  hasBlob: (digest: string) => Promise<boolean>,
): Promise<void> {
  for (const [field, digest] of [
    ['digest', record.digest],
    ['blobDigest', record.blobDigest],
    ['blobChunksDigest', record.blobChunksDigest],
  ] as const) {
    if (digest !== undefined && !(await hasBlob(digest))) {
      throw new DsecError(
        'invalid_argument',
        `${field} ${digest} is not in the store; putBlob it first`,
        {
          field,
        },
      );
    }
  }
}

/** A second put of `name:version` is fine with the same content, `conflict` with other content. */
export function assertSameLayer(existing: LayerInfo, record: LayerInfo): void {
  if (existing.digest !== record.digest || existing.blobDigest !== record.blobDigest) {
    throw new DsecError(
      'conflict',
      `layer ${formatLayerRef(record)} already exists with digest ${existing.digest}`,
      { field: 'digest', details: { existingDigest: existing.digest } },
    );
  }
}

import { isAbsolute } from 'node:path';
import { DsecError, type ImageStore } from '@dsec/core';
import { DirImageStore } from './dir-store.js';
import { S3ImageStore, type S3ImageStoreOptions } from './s3-store.js';

export interface OpenImageStoreOptions {
  /** Where remote stores keep whole-blob copies for `blobPath` (metadata images, pulls). */
  cacheDir?: string;
}

const S3_PARAMS = new Set(['endpoint', 'region', 'forcePathStyle']);

/**
 * Opens a store from its location (`ImageStore.location`): `dir:/abs/path`
 * or a bare absolute path for a POSIX store;
 * `s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1` (query
 * optional; `forcePathStyle=false` for virtual-hosted URLs on a custom
 * endpoint) for S3, with credentials from the environment
 * (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, or the SDK's other sources).
 * Throws `invalid_argument` (field `store`, or the S3 option at fault) for
 * anything else; opens no connection.
 */
export function openImageStore(location: string, options: OpenImageStoreOptions = {}): ImageStore {
  if (location.startsWith('s3:')) return new S3ImageStore(parseS3Location(location, options));
  const path = location.startsWith('dir:') ? location.slice('dir:'.length) : location;
  if (isAbsolute(path)) return new DirImageStore(path);
  throw new DsecError(
    'invalid_argument',
    `unknown image store ${JSON.stringify(location)}: use an absolute path, dir:/path or s3://bucket/prefix`,
    { field: 'store' },
  );
}

function parseS3Location(location: string, options: OpenImageStoreOptions): S3ImageStoreOptions {
  const bad = (why: string, field = 'store'): DsecError =>
    new DsecError(
      'invalid_argument',
      `bad S3 store ${JSON.stringify(redact(location))}: ${why} (expected s3://bucket/prefix?endpoint=URL&region=REGION)`,
      { field },
    );
  if (!location.startsWith('s3://')) throw bad('it must start with s3://');
  // URL parsing resolves dot segments; a prefix must not have any to resolve.
  const rawPath = location.slice('s3://'.length).split(/[?#]/, 1)[0] ?? '';
  if (rawPath.split('/').some((s) => s === '.' || s === '..')) {
    throw bad('no . or .. segments in the prefix', 'prefix');
  }
  let url: URL;
  try {
    url = new URL(location);
  } catch {
    throw bad('not a URL');
  }
  if (url.username !== '' || url.password !== '') {
    throw bad('credentials do not go in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY');
  }
  if (url.port !== '') throw bad('a port belongs in ?endpoint=, not after the bucket');
  if (url.hash !== '') throw bad('no #fragment allowed');
  if (url.hostname === '') throw bad('no bucket name', 'bucket');
  let prefix: string;
  try {
    prefix = decodeURIComponent(url.pathname);
  } catch {
    throw bad('the prefix is not valid percent-encoding', 'prefix');
  }
  const out: S3ImageStoreOptions = { bucket: url.hostname, prefix };
  for (const key of url.searchParams.keys()) {
    if (!S3_PARAMS.has(key)) throw bad(`unknown parameter ${JSON.stringify(key)}`);
    if (url.searchParams.getAll(key).length > 1) throw bad(`${key} given twice`, key);
  }
  const endpoint = url.searchParams.get('endpoint');
  if (endpoint !== null) out.endpoint = endpoint;
  const region = url.searchParams.get('region');
  if (region !== null) out.region = region;
  const pathStyle = url.searchParams.get('forcePathStyle');
  if (pathStyle !== null) {
    if (pathStyle !== 'true' && pathStyle !== 'false') {
      throw bad('forcePathStyle must be true or false', 'forcePathStyle');
    }
    out.forcePathStyle = pathStyle === 'true';
  }
  if (options.cacheDir !== undefined) out.cacheDir = options.cacheDir;
  return out;
}

/** Never echo credentials someone put in the URL. */
function redact(location: string): string {
  return location.replace(/^s3:\/\/[^/?#]*@/, 's3://***@');
}

import { lstat, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { StoredDiffLayer } from '../oci/diff-layers.js';

/**
 * Where the overlay module says whether it writes redirect or metacopy
 * xattrs into an upper directory: with either on, a layer's `diff/` is no
 * longer the layer's content by itself (containers/storage then computes
 * diffs through a mount, its "naive diff"), so it is not read directly.
 */
const OVERLAY_PARAMS = '/sys/module/overlay/parameters';

/** The most layers one image of buildah's storage may have that are read directly. */
const MAX_STORED_LAYERS = 256;

interface Record_ {
  id: string;
  /** A layer's parent layer; an image's top layer. */
  link?: string | undefined;
  digest?: string | undefined;
}

/**
 * The layers of image `imageId` as buildah's overlay storage under `root`
 * keeps them (`overlay/<id>/diff`, in overlayfs format: whiteouts are 0:0
 * devices, opaque directories carry `trusted.overlay.opaque`), bottom first,
 * each with the digest containers/storage computed of the tar it applied
 * (`diff-digest`). Returns `undefined`, and the caller exports the image
 * instead, whenever that reading cannot be trusted to be the image: the
 * storage files are missing or of another shape, a layer's digest is not
 * the config's diff ID at its position, a `diff/` is not a plain directory,
 * or the overlay module writes redirect or metacopy xattrs.
 *
 * The storage is DSec's private one (the build's lock held): only buildah
 * writes it, and a `RUN` step sees lower layers through overlayfs, so it
 * cannot change them.
 */
export async function readStoredLayers(
  root: string,
  imageId: string,
  diffIds: readonly string[],
): Promise<StoredDiffLayer[] | undefined> {
  for (const p of ['redirect_dir', 'metacopy']) {
    const v = await readFile(join(OVERLAY_PARAMS, p), 'utf8').catch(() => 'N');
    if (v.trim() !== 'N') return undefined;
  }
  const id = imageId.replace(/^sha256:/, '');
  const images = await readRecords(join(root, 'overlay-images', 'images.json'), 'layer');
  const layers = new Map<string, Record_>();
  for (const file of ['layers.json', 'volatile-layers.json']) {
    for (const l of (await readRecords(join(root, 'overlay-layers', file), 'parent')) ?? [])
      layers.set(l.id, l);
  }
  const image = images?.find((i) => i.id === id);
  if (!image?.link) return diffIds.length === 0 && image ? [] : undefined;
  const topFirst: Record_[] = [];
  for (let at: string | undefined = image.link; at !== undefined && at !== '';) {
    const l = layers.get(at);
    if (!l || topFirst.length >= MAX_STORED_LAYERS) return undefined;
    topFirst.push(l);
    at = l.link;
  }
  if (topFirst.length !== diffIds.length) return undefined;
  const out: StoredDiffLayer[] = [];
  for (const [i, l] of topFirst.reverse().entries()) {
    if (l.digest !== diffIds[i]) return undefined;
    const diffDir = join(root, 'overlay', l.id, 'diff');
    const st = await lstat(diffDir).catch(() => undefined);
    if (!st?.isDirectory()) return undefined;
    out.push({ diffId: diffIds[i]!, diffDir });
  }
  return out;
}

/** containers/storage's JSON records (`id`, the `link` field, `diff-digest`); `undefined` when any is malformed. */
async function readRecords(
  path: string,
  linkField: 'layer' | 'parent',
): Promise<Record_[] | undefined> {
  const text = await readFile(path, 'utf8').catch(() => undefined);
  if (text === undefined) return undefined;
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (!Array.isArray(value)) return undefined;
  const out: Record_[] = [];
  for (const v of value as unknown[]) {
    if (typeof v !== 'object' || v === null) return undefined;
    const r = v as Record<string, unknown>;
    const id = r['id'];
    const link = r[linkField];
    const digest = r['diff-digest'];
    if (typeof id !== 'string' || !/^[0-9a-f]{64}$/.test(id)) return undefined;
    if (link !== undefined && typeof link !== 'string') return undefined;
    if (digest !== undefined && typeof digest !== 'string') return undefined;
    out.push({ id, link, digest });
  }
  return out;
}

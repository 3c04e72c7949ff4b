import { stat } from 'node:fs/promises';
import {
  DsecError,
  formatLayerRef,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import { layerDigests } from './store/validate.js';

export interface TransferProgress {
  bytesDone: number;
  bytesTotal: number;
}

export interface TransferLayerOptions {
  signal?: AbortSignal;
  onProgress?(p: TransferProgress): void;
}

/**
 * Copies one layer — its blobs, then its record — from one store to another
 * (`dsec image push` / `pull`). Blobs the target already holds are skipped,
 * so a re-run after an interruption only sends what is missing. The record
 * goes last: a reader never sees a layer whose blobs are not all there.
 */
export async function transferLayer(
  from: ImageStore,
  to: ImageStore,
  ref: string,
  options: TransferLayerOptions = {},
): Promise<{ layer: LayerInfo; bytesCopied: number }> {
  const { signal } = options;
  const layer = await from.getLayer(ref);
  const sources: { digest: string; path: string; size: number }[] = [];
  for (const digest of layerDigests(layer)) {
    if (await to.hasBlob(digest)) continue;
    const path = await from.blobPath(digest, signal ? { signal } : {});
    sources.push({ digest, path, size: (await stat(path)).size });
  }
  const bytesTotal = sources.reduce((s, b) => s + b.size, 0);
  let base = 0;
  options.onProgress?.({ bytesDone: 0, bytesTotal });
  for (const blob of sources) {
    throwIfAborted(signal);
    // A remote store's blobPath is a downloaded copy: the target may take it over.
    const put = await to.putBlob(blob.path, {
      move: !from.local,
      ...(signal ? { signal } : {}),
      onProgress: (n) => options.onProgress?.({ bytesDone: base + n, bytesTotal }),
    });
    if (put.digest !== blob.digest) {
      throw new DsecError(
        'internal',
        `blob ${blob.digest} of ${formatLayerRef(layer)} reads back as ${put.digest}`,
      );
    }
    base += blob.size;
  }
  options.onProgress?.({ bytesDone: bytesTotal, bytesTotal });
  await to.putLayer(layer);
  return { layer: await to.getLayer(formatLayerRef(layer)), bytesCopied: bytesTotal };
}

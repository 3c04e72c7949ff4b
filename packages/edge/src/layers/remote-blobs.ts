import { BlobDaemon } from '../ondemand/blob-daemon.js';
import type { RemoteBlobs } from './layer-cache.js';

export interface BlobDaemonBlobsOptions {
  mountDir: string;
  cacheDir: string;
  storeLocation: string;
  cacheBytes: number;
}

/**
 * RemoteBlobs backed by the node's blob daemon, started (or adopted, when a
 * previous edge left it running) on the first layer that needs it.
 */
export function blobDaemonBlobs(options: BlobDaemonBlobsOptions): RemoteBlobs {
  let daemon: Promise<BlobDaemon> | undefined;
  return {
    async pathFor(digest, chunkTable) {
      daemon ??= BlobDaemon.start(options);
      try {
        return (await daemon).pathFor(digest, chunkTable ? { chunkTable } : {});
      } catch (err) {
        daemon = undefined;
        throw err;
      }
    },
    async stop() {
      const running = daemon;
      daemon = undefined;
      // A daemon that never started has nothing to stop.
      await (await running?.catch(() => undefined))?.stop();
    },
  };
}

import { BlobDaemon } from '../ondemand/blob-daemon.js';
import type { RemoteBlobs } from './layer-cache.js';

export interface BlobDaemonBlobsOptions {
  mountDir: string;
  cacheDir: string;
  storeLocation: string;
  cacheBytes: number;
  /** Passed to the daemon (see BlobDaemonOptions); its defaults otherwise. */
  chunkBytes?: number;
  readaheadBytes?: number;
  prefetchBytes?: number;
  /**
   * Start the daemon now, in the background, rather than on the first layer
   * that needs it: the first sandbox of a node with a remote store then does
   * not wait for a process start and a FUSE mount. Default true.
   */
  startNow?: boolean;
}

/**
 * RemoteBlobs backed by the node's blob daemon, started (or adopted, when a
 * previous edge left it running) at once in the background, or on the first
 * layer that needs it; a failed start is retried there.
 */
export function blobDaemonBlobs(options: BlobDaemonBlobsOptions): RemoteBlobs {
  let daemon: Promise<BlobDaemon> | undefined;
  if (options.startNow ?? true) {
    const starting = BlobDaemon.start(options);
    daemon = starting;
    // Not awaited here: a failure resets, and the first pathFor starts again and reports it.
    starting.catch(() => {
      if (daemon === starting) daemon = undefined;
    });
  }
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

/**
 * A throwaway S3 server for tests (`@dsec/images/testing/s3`): s3rver on
 * 127.0.0.1, an ephemeral port and a fresh temp directory, with one bucket.
 * s3rver checks no signatures (but wants access key `S3RVER`), ignores
 * `If-None-Match` on PUT, and is patched here to answer a range of an empty
 * object with 416 as S3 does. Never talks to anything but loopback.
 *
 * @example
 * ```ts
 * const s3 = await startS3Server();
 * process.env.AWS_ACCESS_KEY_ID = 'S3RVER';
 * process.env.AWS_SECRET_ACCESS_KEY = 'S3RVER';
 * const store = openImageStore(s3.location('run-1/'));
 * // …
 * await s3.close();
 * ```
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import S3rver from 's3rver';

export interface S3TestServer {
  /** `http://127.0.0.1:<port>`. */
  endpoint: string;
  bucket: string;
  /** Where s3rver keeps the bucket's files. */
  dir: string;
  /** An `openImageStore` location for this server and bucket, under `prefix`. */
  location(prefix?: string): string;
  /** Stops the server and removes its directory. */
  close(): Promise<void>;
}

/** Starts s3rver (silent) with `bucket` created; call `close()` when done. */
export async function startS3Server({
  bucket = 'dsec-test',
}: { bucket?: string } = {}): Promise<S3TestServer> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-s3rver-'));
  const server = new S3rver({
    address: '127.0.0.1',
    port: 0,
    silent: true,
    directory: dir,
    configureBuckets: [{ name: bucket, configs: [] }],
  });
  // s3rver answers a range of an empty object with 206, Content-Length 1 and no
  // body, so a client waits for a byte that never comes; S3 answers 416.
  server.middleware.unshift(async (ctx, next) => {
    await next();
    if (ctx.status === 206 && /\/0$/.test(ctx.response.get('Content-Range'))) {
      (ctx.body as { destroy?: () => void } | undefined)?.destroy?.();
      ctx.remove('Content-Range');
      ctx.status = 416;
      ctx.type = 'application/xml';
      ctx.body =
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidRange</Code>' +
        '<Message>The requested range is not satisfiable</Message></Error>';
    }
  });
  let address;
  try {
    address = await server.run();
  } catch (err) {
    await rm(dir, { recursive: true, force: true });
    throw err;
  }
  const endpoint = `http://127.0.0.1:${address.port}`;
  let closed: Promise<void> | undefined;
  return {
    endpoint,
    bucket,
    dir,
    location: (prefix = '') =>
      `s3://${bucket}/${prefix}?${new URLSearchParams({ endpoint, region: 'us-east-1' }).toString()}`,
    close: () =>
      (closed ??= new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
      }).finally(() => rm(dir, { recursive: true, force: true }))),
  };
}

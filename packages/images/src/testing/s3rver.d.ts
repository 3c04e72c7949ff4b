// The part of s3rver's API the test server uses (the package ships no types).
declare module 's3rver' {
  import type { AddressInfo } from 'node:net';

  interface S3rverOptions {
    address?: string;
    port?: number;
    silent?: boolean;
    directory: string;
    resetOnClose?: boolean;
    configureBuckets?: { name: string; configs: (string | Buffer)[] }[];
  }

  /** The parts of a Koa context the server's middleware touches. */
  interface S3rverContext {
    status: number;
    body: unknown;
    type: string;
    response: { get(field: string): string };
    remove(field: string): void;
  }

  export default class S3rver {
    /** Koa's middleware stack, composed when the server starts. */
    middleware: ((ctx: S3rverContext, next: () => Promise<void>) => Promise<void>)[];
    constructor(options: S3rverOptions);
    run(): Promise<AddressInfo>;
    close(callback: (err?: Error) => void): void;
  }
}

import { execFile } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { randomBytes } from 'node:crypto';
import pg from 'pg';

const run = promisify(execFile);

/** scripts/postgres.sh, from src/testing/ and from dist/testing/ alike. */
const SCRIPT = fileURLToPath(new URL('../../../../scripts/postgres.sh', import.meta.url));

export interface PostgresServer {
  /** `postgresql://dsec@127.0.0.1:PORT/dsec`: the server's database `dsec`. */
  url: string;
  /** Creates a fresh, empty database on the server and returns its URL. */
  newDatabase(): Promise<string>;
  /** Fast shutdown and removal of the server's directory; idempotent. */
  stop(): Promise<void>;
}

/**
 * Starts a throwaway PostgreSQL server (scripts/postgres.sh: 127.0.0.1 on a
 * free port, trust authentication for loopback only, data in a temporary
 * directory). The caller must `stop()` it, also when its test fails (an
 * `after` hook); a failed start leaves nothing behind.
 */
export async function startPostgres(): Promise<PostgresServer> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-pg-'));
  let stopped: Promise<void> | undefined;
  const stop = () =>
    (stopped ??= run('bash', [SCRIPT, 'stop', dir]).then(
      () => undefined,
      // The script refuses a directory it did not make; one left half-made is ours anyway.
      () => rm(dir, { recursive: true, force: true }),
    ));
  let url: string;
  try {
    const { stdout } = await run('bash', [SCRIPT, 'start', dir], { timeout: 120_000 });
    url = stdout.trim();
    if (!/^postgresql:\/\/\S+$/.test(url))
      throw new Error(`postgres.sh printed ${JSON.stringify(stdout)}`);
  } catch (err) {
    await stop();
    throw err;
  }
  return {
    url,
    stop,
    async newDatabase() {
      const name = `dsec_${randomBytes(6).toString('hex')}`;
      const client = new pg.Client({ connectionString: url });
      await client.connect();
      try {
        await client.query(`CREATE DATABASE ${name}`);
      } finally {
        await client.end();
      }
      const u = new URL(url);
      u.pathname = `/${name}`;
      return u.toString();
    },
  };
}

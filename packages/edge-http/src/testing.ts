/**
 * Test helpers of `@dsec/edge-http`: certificates for pinned TLS, made the
 * way an operator would, with Debian's `openssl`.
 *
 * @example
 * ```ts
 * const c = await makeTestCertificate(dir, 'edge-a');
 * const server = await serveEdge({ edge, secret, tls: { cert: c.cert, key: c.key } });
 * const remote = new RemoteEdge({ edgeId, url: server.url, secret, tls: { pinSha256: [c.sha256] } });
 * ```
 */
import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);

export interface TestCertificate {
  certFile: string;
  keyFile: string;
  /** PEM. */
  cert: string;
  key: string;
  /** The SHA-256 fingerprint as openssl prints it (`AB:CD:…`). */
  sha256: string;
}

/**
 * A self-signed P-256 certificate for `127.0.0.1` (1 day), written as
 * `<name>.crt` and `<name>.key` (0600) in `dir`.
 */
export async function makeTestCertificate(dir: string, name = 'edge'): Promise<TestCertificate> {
  const certFile = join(dir, `${name}.crt`);
  const keyFile = join(dir, `${name}.key`);
  await run('openssl', [
    'req',
    '-x509',
    '-newkey',
    'ec',
    '-pkeyopt',
    'ec_paramgen_curve:P-256',
    '-nodes',
    '-days',
    '1',
    '-subj',
    `/CN=${name}`,
    '-addext',
    'subjectAltName=IP:127.0.0.1',
    '-keyout',
    keyFile,
    '-out',
    certFile,
  ]);
  const { stdout } = await run('openssl', [
    'x509',
    '-in',
    certFile,
    '-noout',
    '-fingerprint',
    '-sha256',
  ]);
  // `sha256 Fingerprint=AB:CD:…`
  const line = stdout.trim();
  const sha256 = line.slice(line.indexOf('=') + 1);
  return {
    certFile,
    keyFile,
    cert: await readFile(certFile, 'utf8'),
    key: await readFile(keyFile, 'utf8'),
    sha256,
  };
}

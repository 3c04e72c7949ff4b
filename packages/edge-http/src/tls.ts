import { X509Certificate } from 'node:crypto';
import https from 'node:https';
import type { AgentOptions, RequestOptions } from 'node:https';
import type { Duplex } from 'node:stream';
import tls from 'node:tls';
import { DsecError } from '@dsec/core';

/**
 * Certificate pinning for the apiserver → edge link (docs/edge-protocol.md,
 * "TLS"): an edge serves one certificate (usually self-signed) and clients
 * accept exactly the certificates whose SHA-256 they were given. No CA
 * chain, name or date is consulted: a pin says "this key is that edge".
 */

const HEX64 = /^[0-9A-F]{64}$/;

/**
 * The canonical form of a SHA-256 certificate fingerprint: 64 upper-case
 * hex digits in pairs joined by `:` (what `X509Certificate.fingerprint256`
 * and `openssl x509 -noout -fingerprint -sha256` print). Accepts any case,
 * with or without colons, and openssl's `sha256 Fingerprint=` prefix;
 * throws `invalid_argument` (naming `field`) on anything else.
 */
export function normalizeFingerprint(value: string, field = 'tls.pinSha256'): string {
  let s = typeof value === 'string' ? value.trim() : '';
  const eq = s.indexOf('=');
  if (eq >= 0 && /^sha-?256 fingerprint$/i.test(s.slice(0, eq).trim())) s = s.slice(eq + 1);
  const hex = s.replaceAll(':', '').toUpperCase();
  if (!HEX64.test(hex)) {
    throw new DsecError(
      'invalid_argument',
      `${JSON.stringify(String(value).slice(0, 120))} is not a SHA-256 certificate fingerprint (64 hex digits, colons optional)`,
      { field },
    );
  }
  return hex.match(/../g)!.join(':');
}

/** The pin of a PEM certificate (its first certificate when it holds a chain). */
export function certificateSha256(pem: string | Buffer, field = 'tls.certFile'): string {
  try {
    return new X509Certificate(pem).fingerprint256;
  } catch (cause) {
    throw new DsecError('invalid_argument', 'not a PEM certificate', { field, cause });
  }
}

/**
 * The certificate each admitted connection showed: a TLS 1.3 client no
 * longer has its peer's certificate once the handshake is over.
 */
const shown = new WeakMap<Duplex, string>();

/** The SHA-256 of the certificate a `PinnedAgent` connection showed (undefined for any other). */
export function shownFingerprint(socket: Duplex): string | undefined {
  return shown.get(socket);
}

/**
 * An HTTPS agent that admits a connection only once the edge has shown a
 * pinned certificate: the socket reaches the HTTP client after the check,
 * so not a byte of a request (its signature included) goes to anyone else.
 * Every connection does a full handshake (no session reuse), so every one
 * is checked.
 */
export class PinnedAgent extends https.Agent {
  readonly #pins: ReadonlySet<string>;
  readonly #refuse: (got: string | undefined) => Error;

  constructor(
    options: AgentOptions,
    pins: ReadonlySet<string>,
    refuse: (got: string | undefined) => Error,
  ) {
    super({ ...options, maxCachedSessions: 0 });
    this.#pins = pins;
    this.#refuse = refuse;
  }

  /** Node's agents accept a connection handed over later, through `done`. */
  override createConnection(
    options: RequestOptions,
    done?: (err: Error | null, socket: Duplex) => void,
  ): undefined {
    const handOver = (err: Error | null, s?: Duplex) => done?.(err, s as Duplex);
    const socket = tls.connect({
      ...(options as tls.ConnectionOptions),
      // The pin is the whole check; a self-signed certificate has no chain to verify.
      rejectUnauthorized: false,
      minVersion: 'TLSv1.3',
      session: undefined,
    });
    const onError = (err: Error) => handOver(err);
    socket.once('error', onError);
    socket.once('secureConnect', () => {
      socket.off('error', onError);
      const fingerprint = socket.getPeerX509Certificate()?.fingerprint256;
      if (fingerprint === undefined || !this.#pins.has(fingerprint)) {
        socket.destroy();
        handOver(this.#refuse(fingerprint));
        return;
      }
      shown.set(socket, fingerprint);
      handOver(null, socket);
    });
    return undefined;
  }
}

import type { IncomingHttpHeaders } from 'node:http';
import { checkSandboxUser, DsecError, isDsecError } from '@dsec/core';
import { fromE2bKeyForm, type Iam, type Principal } from '@dsec/iam';

/**
 * Credentials of an E2B client. The SDKs send the API key as `X-API-Key` to
 * the control plane and the sandbox's envd access token as `X-Access-Token`
 * to the sandbox. DSec hands out the caller's own API key as that token
 * (create and connect answer it), so every call, control plane or
 * in-sandbox, is authorised by IAM exactly as a native call with that key:
 * the key's project and its descendants, another project's sandbox not found.
 * `Authorization: Bearer` is accepted too; `Basic` carries the envd user.
 * A key may come in E2B's format (`e2b_` + hex, `dsec key create --e2b`), so
 * the SDKs' own key check needs no `E2B_VALIDATE_API_KEY=false`.
 */

/** An authenticated caller and the raw key (echoed as the envd access token; never logged). */
export interface E2bCaller {
  principal: Principal;
  key: string;
  /** The header that carried it (lower case). */
  header: string;
}

/** The first credential a request carries, in the order the SDKs use them. */
export function credentialOf(
  headers: IncomingHttpHeaders,
): { key: string; header: string } | undefined {
  for (const header of ['x-api-key', 'x-access-token', 'e2b-traffic-access-token']) {
    const v = headers[header];
    if (typeof v === 'string' && v.trim() !== '') return { key: fromE2bKeyForm(v.trim()), header };
  }
  const auth = headers.authorization;
  const m = typeof auth === 'string' ? /^Bearer +(\S+) *$/i.exec(auth) : null;
  return m?.[1] ? { key: fromE2bKeyForm(m[1]), header: 'authorization' } : undefined;
}

/**
 * Throws `unauthenticated` for a missing, malformed or revoked key, and
 * `rate_limited` for a `source` (the client's address) past its budget of
 * failed authentications (`Iam.authenticate`).
 */
export async function authenticateE2b(
  iam: Iam,
  headers: IncomingHttpHeaders,
  source?: string,
): Promise<E2bCaller> {
  const found = credentialOf(headers);
  if (found === undefined) {
    // Counted and limited as any failed authentication; the answer names E2B's header.
    const limited = await iam.authenticate(undefined, { source }).then(
      () => undefined,
      (err: unknown) => (isDsecError(err, 'rate_limited') ? err : undefined),
    );
    throw limited ?? new DsecError('unauthenticated', 'missing API key (X-API-Key)');
  }
  return { principal: await iam.authenticate(found.key, { source }), ...found };
}

/**
 * The user an envd call runs as: `Authorization: Basic base64(user:)`, as the
 * SDKs send it; undefined means the sandbox's own user (`initUser`).
 */
export function envdUser(headers: Headers | IncomingHttpHeaders): string | undefined {
  const raw = headers instanceof Headers ? headers.get('authorization') : headers.authorization;
  const m = typeof raw === 'string' ? /^Basic +(\S+) *$/i.exec(raw) : null;
  if (!m?.[1]) return undefined;
  const decoded = Buffer.from(m[1], 'base64').toString('utf8');
  return checkUser(decoded.split(':')[0] ?? '');
}

/** A user name or uid as DSec accepts it (`checkSandboxUser`); empty means the sandbox's own user. */
export function checkUser(user: string | undefined): string | undefined {
  if (user === undefined || user === '') return undefined;
  return checkSandboxUser(user, 'user');
}

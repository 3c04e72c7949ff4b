import { checkVolumeMounts, DsecError } from '@dsec/core';
import type { VolumeMount } from '@dsec/core';

/**
 * E2B's volumes on DSec's (docs/volumes.md, docs/e2b.md). A volume's E2B
 * `volumeID` is its name: names are unique per project, which is what an
 * E2B team is here. E2B's `NewVolume` carries no size, so a volume made
 * through this door has `E2B_VOLUME_SIZE_MB`; `dsec volume create` picks one.
 * The `token` answered is the caller's own key (as `envdAccessToken` is):
 * E2B's volume content API (files of a volume without a sandbox) is not
 * served, so it authorises nothing more.
 */
export const E2B_VOLUME_SIZE_MB = 1024;

type Body = Record<string, unknown>;

/** E2B's `volumeMounts` (`[{ name, path }]`) as DSec's `volumes`; DSec's schema checks each. */
export function volumeMountsOf(raw: unknown[]): VolumeMount[] {
  const mounts = raw.map((m, i) => {
    const o = (m ?? {}) as Body;
    if (typeof m !== 'object' || typeof o.name !== 'string' || typeof o.path !== 'string')
      throw new DsecError('invalid_argument', `volumeMounts.${i}: want { name, path }`, {
        field: `volumeMounts.${i}`,
      });
    return { name: o.name, path: o.path };
  });
  try {
    checkVolumeMounts(mounts);
  } catch (err) {
    // E2B's error body has no field: the message names it, in E2B's terms.
    if (!(err instanceof DsecError) || err.field === undefined) throw err;
    const field = err.field.replace(/^volumes/, 'volumeMounts');
    throw new DsecError(err.code, `${field}: ${err.message}`, { field, cause: err });
  }
  return mounts;
}

import { DsecError } from '@dsec/core';
import { registryHostOf } from '../oci/registries.js';
import { runTool } from '../util/run-tool.js';
import type { ParsedDockerfile } from './parse.js';

/**
 * The images a Dockerfile's stages start `FROM` (not `scratch`, not an
 * earlier stage), their variables expanded as Docker does: only global
 * `ARG`s (before the first `FROM`), a `--build-arg` over the `ARG`'s
 * default; `$V`, `${V}` and `${V:-default}`. A reference still holding a `$`
 * is refused (`invalid_argument`, `details.reason` `from_variable`): its
 * image could not be checked before buildah pulls it.
 */
export function baseImageRefs(
  parsed: ParsedDockerfile,
  buildArgs: Record<string, string>,
): string[] {
  const vars = new Map<string, string>();
  for (const ins of parsed.globalArgs) {
    const m = /^([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?$/.exec(ins.args.trim());
    if (!m) continue;
    const value = buildArgs[m[1]!] ?? unquote(m[2]);
    if (value !== undefined) vars.set(m[1]!, value);
  }
  const stages = new Set<string>();
  const refs: string[] = [];
  for (const stage of parsed.stages) {
    const line = stage.instructions[0]?.line ?? 0;
    const ref = stage.from.replace(
      /\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}$]*))?\})/g,
      (whole, a?: string, b?: string, dflt?: string) => {
        const v = vars.get((a ?? b)!);
        if (v !== undefined && v !== '') return v;
        if (dflt !== undefined) return dflt;
        return v ?? whole;
      },
    );
    if (ref.includes('$')) {
      throw new DsecError(
        'invalid_argument',
        `FROM ${stage.from} (line ${line}) names its image through a variable DSec cannot resolve; give the ARG a default or pass --build-arg`,
        { field: 'dockerfile', details: { reason: 'from_variable', line } },
      );
    }
    assertRegistryRef(ref, line);
    const lower = ref.toLowerCase();
    if (lower !== 'scratch' && !stages.has(lower) && !refs.includes(ref)) refs.push(ref);
    if (stage.name !== undefined) stages.add(stage.name);
  }
  return refs;
}

/**
 * The images `COPY --from=` / `ADD --from=` name (not a stage's name or
 * index): pulled ahead like the bases, so `bud --pull=false` never builds
 * on a copy another build left in the shared storage. A `--from` holding a
 * `$` is `from_variable`.
 */
export function copyFromImageRefs(parsed: ParsedDockerfile): string[] {
  const stages = new Set<string>();
  const refs: string[] = [];
  for (const stage of parsed.stages) {
    for (const ins of stage.instructions) {
      if (ins.keyword !== 'COPY' && ins.keyword !== 'ADD') continue;
      const raw = /(?:^|\s)--from=(\S+)/.exec(ins.args)?.[1];
      if (raw === undefined) continue;
      const from = raw.replace(/^["']|["']$/g, '');
      if (/^\d+$/.test(from) || stages.has(from.toLowerCase())) continue;
      if (from.includes('$')) {
        throw new DsecError(
          'invalid_argument',
          `${ins.keyword} --from=${from} (line ${ins.line}) names its image through a variable; name the image or the stage`,
          { field: 'dockerfile', details: { reason: 'from_variable', line: ins.line } },
        );
      }
      assertRegistryRef(from, ins.line);
      if (!refs.includes(from)) refs.push(from);
    }
    if (stage.name !== undefined) stages.add(stage.name);
  }
  return refs;
}

/**
 * containers/image transports buildah honours in an image name: `FROM
 * oci:/path:ref`, `docker-archive:/file.tar`, `containers-storage:…`,
 * `dir:/path` read an image from the host's files, not a registry.
 * (`docker:24-dind` is an image on Docker Hub; only `docker://` is the transport.)
 */
const TRANSPORT =
  /^(?:docker:\/\/|(?:docker-archive|docker-daemon|oci|oci-archive|dir|containers-storage|ostree|sif|tarball):)/i;

/**
 * Refuses an image named through a transport (`invalid_argument`,
 * `details.reason` `image_transport`): it would build on host files.
 */
export function assertRegistryRef(ref: string, line: number): void {
  // DSec's own names in buildah's shared storage (a build's image, a store base's copy):
  // a Dockerfile naming one would build on what another build put there.
  if (/^localhost\/dsec-/i.test(ref)) {
    throw new DsecError(
      'invalid_argument',
      `${ref.slice(0, 80)} (line ${line}) is a name DSec keeps for its own images; name a registry image`,
      { field: 'dockerfile', details: { reason: 'reserved_image_name', line } },
    );
  }
  if (TRANSPORT.test(ref)) {
    throw new DsecError(
      'invalid_argument',
      `${ref.slice(0, 80)} (line ${line}) names an image by a transport, which reads it from the host's files; name a registry image (host/name:tag)`,
      { field: 'dockerfile', details: { reason: 'image_transport', line } },
    );
  }
}

/**
 * Refuses an image of a registry outside `allowed` (`permission_denied`,
 * `details.reason` `from_registry`): the pull runs on the node, so a tenant's
 * `FROM 127.0.0.1:2379/x` or `FROM 10.0.0.5/x` would reach the node's own
 * services and network.
 */
export function assertPullHost(ref: string, allowed: readonly string[] | undefined): void {
  if (allowed === undefined) return;
  const host = registryHostOf(ref);
  if (allowed.includes(host)) return;
  throw new DsecError(
    'permission_denied',
    `FROM ${ref.slice(0, 200)}: this node does not pull from ${host.slice(0, 100)} for builds sent to the API; its operator can list the registry in the config's registries.buildFrom (or DSEC_BUILD_REGISTRIES)`,
    { field: 'dockerfile', details: { reason: 'from_registry', ref: ref.slice(0, 200), host } },
  );
}

function unquote(s: string | undefined): string | undefined {
  if (s === undefined) return undefined;
  const t = s.trim();
  return /^(["']).*\1$/.test(t) ? t.slice(1, -1) : t;
}

/**
 * Pulls each base image into buildah's storage and refuses one with
 * `ONBUILD` triggers (`invalid_argument`, `details.reason` `onbuild_base`):
 * buildah runs a base's triggers as if the Dockerfile held them, past
 * DSec's Dockerfile checks, so a hostile image's `ONBUILD ADD
 * http://10.0.0.1/…` is fetched by buildah on the host, outside the build's
 * network policy (and `ONBUILD RUN --mount`/`--network` likewise). The
 * build then runs with `--pull=false` on exactly these pulled images.
 */
export async function checkBaseImages(
  refs: string[],
  options: {
    storage: string[];
    env: NodeJS.ProcessEnv;
    authFile?: string | undefined;
    /** False for `COPY --from` images: buildah runs no trigger of theirs. Default true. */
    refuseTriggers?: boolean | undefined;
    signal: AbortSignal;
  },
): Promise<void> {
  const { storage, env, signal } = options;
  for (const ref of refs) {
    await runTool(
      'buildah',
      [
        ...storage,
        'pull',
        // Always resolved at the registry: a copy in the shared storage (pulled by
        // an earlier build, perhaps with another tenant's credentials) is not reused.
        '--policy',
        'always',
        '--quiet',
        '--retry',
        '0',
        ...(options.authFile ? ['--authfile', options.authFile] : []),
        ref,
      ],
      { env, signal },
    ).catch((err: unknown) => {
      throw new DsecError('invalid_argument', `FROM ${ref}: the image could not be pulled`, {
        field: 'dockerfile',
        details: { reason: 'from_pull', ref },
        cause: err,
      });
    });
    if (options.refuseTriggers === false) continue;
    const { stdout } = await runTool('buildah', [...storage, 'inspect', '--type', 'image', ref], {
      env,
      signal,
    });
    const inspected = JSON.parse(stdout) as {
      Docker?: { config?: { OnBuild?: unknown } };
      OCIv1?: { config?: { OnBuild?: unknown } };
    };
    const triggers = [inspected.Docker?.config?.OnBuild, inspected.OCIv1?.config?.OnBuild].flatMap(
      (t) => (Array.isArray(t) ? t : []),
    );
    if (triggers.length > 0) {
      throw new DsecError(
        'invalid_argument',
        `FROM ${ref}: the image has ONBUILD triggers (${String(triggers[0]).slice(0, 80)}), which DSec does not run; build from an image without them`,
        { field: 'dockerfile', details: { reason: 'onbuild_base', ref } },
      );
    }
  }
}

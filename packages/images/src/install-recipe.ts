import { createHash } from 'node:crypto';
import {
  DEFAULT_LAYER_VERSION,
  DsecError,
  formatLayerRef,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import { assertLayerName } from './store/validate.js';

/**
 * Environments that need an install step (paper 6.1: environments built in
 * sandboxes and packed). An `install` recipe names a base (and toolkits) of
 * the same recipes file, shell commands, and the egress they may use; it is
 * built by running the commands, in order, in a builder sandbox on those
 * layers under that egress policy, then snapshotting the sandbox's writable
 * layer (the edge's `snapshot`: the upper directory packed by the platform's
 * confined path, never walked here) and recording the snapshot's image as a
 * platform toolkit layer of the recipe's name. The builder sandbox is always
 * removed.
 *
 * The sandbox itself is the caller's ({@link InstallRunner}): this package
 * knows stores, not clusters; `@dsec/eval`'s `clusterInstallRunner` runs it
 * through the SDK.
 */

/** The `install` recipe of an environments file. */
export interface InstallRecipe {
  kind: 'install';
  /** The base recipe (a name in the same file) the commands run on. */
  base: string;
  /** Toolkit recipes of the same file stacked over the base while the commands run (in order). */
  toolkits?: string[];
  /**
   * Stack the task's workspace (its repository at `base_commit`) under the
   * commands, for `pip install -e .`-style steps: the layer is then built
   * once per workspace, named {@link installLayerName}.
   */
  workspace?: boolean;
  /** Shell commands (`sh -c`, as root), run in order; the first that fails stops the build. */
  commands: string[];
  /**
   * The egress policy: a named one ({@link EGRESS_POLICIES}: `none`,
   * `debian`) or the domains allowed (ports 80 and 443). Default `none`.
   */
  egress?: string | { allow: string[] };
  /** Working directory of the commands (default `/`). */
  workdir?: string;
  env?: Record<string, string>;
  /** Per command (default 600, at most 3600). */
  timeoutSeconds?: number;
  /** Paths left out of the packed layer (the snapshot's scrub: `/abs/path` or `/dir/**`). */
  scrub?: string[];
  version?: string;
}

/** Named egress policies an install recipe may use: the domains each reaches (ports 80, 443). */
export const EGRESS_POLICIES: Readonly<Record<string, readonly string[]>> = {
  none: [],
  /** Debian's mirror and its security archive: `apt-get update && apt-get install`. */
  debian: ['deb.debian.org', 'security.debian.org'],
};

/** What a builder sandbox is asked to do. */
export interface InstallRequest {
  /** The recipe's name, for errors. */
  recipe: string;
  /** `name:version` of the base layer, and of each toolkit over it (bottom first). */
  image: string;
  toolkits: string[];
  /** `name:version` of the task's workspace layer, for a recipe with `workspace: true`. */
  workspace?: string | undefined;
  commands: string[];
  /** Domains the sandbox may reach on ports 80 and 443; empty: no egress. */
  allowDomains: string[];
  workdir: string;
  env: Record<string, string>;
  timeoutMs: number;
  /** The snapshot's name (free in the caller's project; the builder takes it, then it is promoted). */
  snapshotName: string;
  scrub: string[];
  signal?: AbortSignal | undefined;
}

/**
 * Runs an {@link InstallRequest} in a builder sandbox and snapshots it.
 * Contract: resolves with the snapshot's layer record (in whatever project
 * namespace the sandbox's key owns) once every command exited 0; rejects
 * with {@link installCommandFailed} for the first command that did not, and
 * with the cluster's own errors otherwise. The builder sandbox is stopped on
 * every path, success, failure or abort.
 */
export type InstallRunner = (request: InstallRequest) => Promise<LayerInfo>;

const MAX_COMMANDS = 64;
const MAX_COMMAND_CHARS = 16 * 1024;
const DOMAIN = /^(?:\*\.)?[a-z0-9](?:[a-z0-9-]{0,62}\.)*[a-z0-9-]{1,63}$/;
const ENV_KEY = /^[A-Za-z_][A-Za-z0-9_]{0,127}$/;
/** Bytes of each output stream kept for the error of a failed command. */
export const INSTALL_OUTPUT_TAIL_BYTES = 4096;

/**
 * Checks the fields of an `install` recipe (`parseEnvironmentRecipes` calls
 * it for `kind: "install"`), `bad` throwing `invalid_argument` for `field`.
 */
export function checkInstallRecipe(
  name: string,
  r: Record<string, unknown>,
  bad: (field: string, msg: string) => never,
): InstallRecipe {
  const keys = [
    'kind',
    'base',
    'toolkits',
    'workspace',
    'commands',
    'egress',
    'workdir',
    'env',
    'timeoutSeconds',
    'scrub',
    'version',
  ];
  for (const k of Object.keys(r)) if (!keys.includes(k)) bad(`${name}.${k}`, 'unknown field');
  if (typeof r['base'] !== 'string') bad(`${name}.base`, 'must name a base recipe');
  const strings = (v: unknown, field: string, max: number): string[] => {
    if (!Array.isArray(v) || v.length > max)
      bad(field, `must be an array of at most ${max} strings`);
    (v as unknown[]).forEach((s, i) => {
      if (typeof s !== 'string' || s.length === 0)
        bad(`${field}.${i}`, 'must be a non-empty string');
    });
    return v as string[];
  };
  if (r['toolkits'] !== undefined) {
    strings(r['toolkits'], `${name}.toolkits`, 16).forEach((t, i) =>
      assertLayerName(t, `${name}.toolkits.${i}`),
    );
  }
  if (r['workspace'] !== undefined && typeof r['workspace'] !== 'boolean')
    bad(`${name}.workspace`, 'must be a boolean');
  const commands = strings(r['commands'], `${name}.commands`, MAX_COMMANDS);
  if (commands.length === 0) bad(`${name}.commands`, 'name at least one command');
  commands.forEach((c, i) => {
    if (c.length > MAX_COMMAND_CHARS || c.includes('\0'))
      bad(`${name}.commands.${i}`, `must be at most ${MAX_COMMAND_CHARS} characters, no NUL`);
  });
  const egress = r['egress'];
  if (typeof egress === 'string') {
    if (!Object.hasOwn(EGRESS_POLICIES, egress))
      bad(
        `${name}.egress`,
        `no egress policy ${JSON.stringify(egress)}; use ${Object.keys(EGRESS_POLICIES).join(', ')} or { "allow": [domains] }`,
      );
  } else if (egress !== undefined) {
    if (typeof egress !== 'object' || egress === null || Array.isArray(egress))
      bad(`${name}.egress`, 'must be a policy name or { "allow": [domains] }');
    const e = egress as Record<string, unknown>;
    for (const k of Object.keys(e)) if (k !== 'allow') bad(`${name}.egress.${k}`, 'unknown field');
    strings(e['allow'], `${name}.egress.allow`, 64).forEach((d, i) => {
      if (d.length > 253 || !DOMAIN.test(d))
        bad(`${name}.egress.allow.${i}`, 'must be a lower-case domain or *.domain');
    });
  }
  const workdir = r['workdir'];
  if (workdir !== undefined) {
    if (
      typeof workdir !== 'string' ||
      !workdir.startsWith('/') ||
      workdir.length > 4096 ||
      workdir.includes('\0')
    )
      bad(`${name}.workdir`, 'must be an absolute path');
  }
  const env = r['env'];
  if (env !== undefined) {
    if (typeof env !== 'object' || env === null || Array.isArray(env))
      bad(`${name}.env`, 'must be an object of NAME → value');
    const entries = Object.entries(env as Record<string, unknown>);
    if (entries.length > 128) bad(`${name}.env`, 'at most 128 variables');
    for (const [k, v] of entries) {
      if (!ENV_KEY.test(k)) bad(`${name}.env.${k}`, 'bad variable name');
      if (typeof v !== 'string' || v.length > 4096 || v.includes('\0'))
        bad(`${name}.env.${k}`, 'must be a string of at most 4096 characters');
    }
  }
  const t = r['timeoutSeconds'];
  if (t !== undefined && (typeof t !== 'number' || !Number.isInteger(t) || t < 1 || t > 3600))
    bad(`${name}.timeoutSeconds`, 'must be a whole number of seconds from 1 to 3600');
  if (r['scrub'] !== undefined) {
    strings(r['scrub'], `${name}.scrub`, 64).forEach((p, i) => {
      if (!p.startsWith('/') || p.includes('\0'))
        bad(`${name}.scrub.${i}`, 'must be an absolute path');
    });
  }
  return r as unknown as InstallRecipe;
}

/**
 * The layer an install recipe with `workspace: true` builds for one
 * workspace: `RECIPE.ws-` and 32 hex digits of the SHA-256 of the recipe's
 * full name and the workspace ref (a valid layer name whatever the two
 * names' lengths). The hash covers the recipe because its name is cut to 90
 * characters, and has 128 bits because a dataset picks its workspaces' names:
 * two recipes or workspaces sharing a name would have one build replace the
 * layer another task was handed.
 */
export function installLayerName(recipe: string, workspaceRef: string): string {
  const h = createHash('sha256').update(`${recipe}\n${workspaceRef}`).digest('hex').slice(0, 32);
  return `${recipe.slice(0, 90)}.ws-${h}`;
}

/** The domains an install recipe's egress allows. */
export function installDomains(recipe: InstallRecipe): string[] {
  const e = recipe.egress ?? 'none';
  return typeof e === 'string' ? [...(EGRESS_POLICIES[e] ?? [])] : [...e.allow];
}

/**
 * `text` with its control characters (C0 but tab and newline, DEL, C1)
 * written as `\xNN`: the message of an install error carries what the
 * build's commands printed and is printed on the operator's terminal, where
 * an ESC or CSI sequence would act (set the clipboard, hide lines).
 */
function printable(text: string): string {
  return text.replace(
    /[\x00-\x08\x0b-\x1f\x7f-\x9f]/g,
    (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, '0')}`,
  );
}

/**
 * The error for an install command that did not exit 0: `invalid_argument`
 * naming the recipe's command (`field: NAME.commands.I`), with the command,
 * how it ended and the tail of its output in the message (control
 * characters escaped) and `details` (as printed).
 */
export function installCommandFailed(
  recipe: string,
  index: number,
  command: string,
  result: { exitCode: number; outcome: string; stdout: string; stderr: string },
): DsecError {
  const tail = (s: string): string =>
    s.length > INSTALL_OUTPUT_TAIL_BYTES ? s.slice(-INSTALL_OUTPUT_TAIL_BYTES) : s;
  const output = printable(
    tail(`${result.stdout}${result.stderr ? `\n${result.stderr}` : ''}`.trim()),
  );
  const ended =
    result.outcome === 'exited' ? `exited ${result.exitCode}` : `ended: ${result.outcome}`;
  return new DsecError(
    'invalid_argument',
    `install recipe ${recipe}: command ${index + 1} ${printable(JSON.stringify(command.slice(0, 200)))} ${ended}` +
      `${output ? `; its output ends:\n${output}` : ''}`,
    {
      field: `${recipe}.commands.${index}`,
      details: {
        reason: 'install_command_failed',
        recipe,
        command: command.slice(0, 1000),
        exitCode: result.exitCode,
        outcome: result.outcome,
        stdoutTail: tail(result.stdout),
        stderrTail: tail(result.stderr),
      },
    },
  );
}

/**
 * Builds an install recipe: runs it through `runner` on `layers` (the base's
 * and the toolkits' records, bottom first), then records the snapshot's
 * image as the platform toolkit `name:version` (same blobs, no copy) and
 * drops the snapshot's own record.
 *
 * @throws DsecError `invalid_argument` when no runner is given (the caller
 *   has no cluster), the runner's errors (see {@link InstallRunner}), and
 *   `internal` when the runner returns no snapshot layer.
 */
export async function buildInstall(
  store: ImageStore,
  o: {
    name: string;
    recipe: InstallRecipe;
    layers: LayerInfo[];
    /** The layer's name when not `name` (a per-workspace build: {@link installLayerName}). */
    layerName?: string | undefined;
    /** The workspace under the commands, for a recipe with `workspace: true`. */
    workspace?: LayerInfo | undefined;
    recipeDigest: string;
    runner?: InstallRunner | undefined;
    signal?: AbortSignal | undefined;
  },
): Promise<LayerInfo> {
  const { name, recipe, signal } = o;
  if (o.runner === undefined) {
    throw new DsecError(
      'invalid_argument',
      `${name} is an install recipe: it is built in a builder sandbox, and this command has no ` +
        'cluster to run one; build it with `dsec eval prepare` against a running cluster (`dsec up`)',
      { field: `${name}.kind`, details: { reason: 'install_needs_cluster' } },
    );
  }
  throwIfAborted(signal);
  const [base, ...toolkits] = o.layers;
  // Bottom first, as a snapshot's parents: base, workspace, toolkits.
  const stack = [base!, ...(o.workspace ? [o.workspace] : []), ...toolkits];
  const layerName = o.layerName ?? name;
  const snapshotName = `${name.slice(0, 100)}-install-${o.recipeDigest.slice(7, 19)}`;
  const snap = await o.runner({
    recipe: name,
    image: formatLayerRef(base!),
    toolkits: toolkits.map(formatLayerRef),
    workspace: o.workspace && formatLayerRef(o.workspace),
    commands: [...recipe.commands],
    allowDomains: installDomains(recipe),
    workdir: recipe.workdir ?? '/',
    env: { ...(recipe.env ?? {}) },
    timeoutMs: (recipe.timeoutSeconds ?? 600) * 1000,
    snapshotName,
    scrub: [...(recipe.scrub ?? [])],
    signal,
  });
  if (snap?.digest === undefined)
    throw new DsecError('internal', `the builder of ${name} returned no layer`);
  const layer: LayerInfo = {
    ...snap,
    name: layerName,
    version: recipe.version ?? DEFAULT_LAYER_VERSION,
    kind: 'toolkit',
    source: 'install',
    parents: stack.map(formatLayerRef),
    parentDigests: stack.map((l) => l.digest),
    createdAt: new Date().toISOString(),
  };
  delete layer.project; // the platform's namespace
  try {
    await store.putLayer(layer);
  } finally {
    // The builder's record goes whether or not the platform's was made: its blobs stay only
    // while the platform record uses them, so a failed promotion leaves nothing behind.
    await store
      .removeLayer(
        formatLayerRef(snap),
        snap.project !== undefined ? { project: snap.project } : {},
      )
      .catch(() => undefined);
  }
  return await store.getLayer(formatLayerRef(layer));
}

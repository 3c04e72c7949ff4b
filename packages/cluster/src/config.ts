/**
 * The one config file of a DSec cluster (docs/cluster.md): JSON, validated
 * here with messages that name the field and say what is expected. One file
 * may hold every section; each process reads the sections of its role:
 *
 * - `dsec serve apiserver` — `database`, `clusterSecretFile`, `apiserver`
 *   (and `watcher` when `apiserver.watch` is on), `imageStore`;
 * - `dsec serve watcher`   — `database`, `watcher`;
 * - `dsec serve edge`      — `edge`, `imageStore`. An edge never needs the
 *   control-plane database: `dsec edge join` registers it from anywhere that
 *   has the database (an operator's shell, or `dsec up --edges N`).
 */
import { readFile } from 'node:fs/promises';
import { dirname, isAbsolute, resolve } from 'node:path';
import { z } from 'zod';
import { isAllowedHostPattern, schemas } from '@dsec/apiserver';
import { DsecError } from '@dsec/core';
import { normalizeFingerprint } from '@dsec/edge-http';
import {
  MAX_MIRRORS_PER_REGISTRY,
  MAX_REGISTRY_ENTRIES,
  registrySettings,
  type RegistrySettings,
} from '@dsec/images';

const Port = z.number().int().min(0).max(65535);
const Host = z.string().min(1).max(255);
/** Label keys and values as edge selectors use them (`pool=burst`, `hardware=h200`). */
const LabelKey = z
  .string()
  .regex(/^[a-z0-9]([a-z0-9._/-]{0,62})$/, 'a label key is 1-63 of a-z 0-9 . _ / -');
const Labels = z.record(LabelKey, z.string().max(253));
/** `HOST:PORT` of an admin listener serving `/metrics` without a key (docs/observability.md). */
const ListenAddress = z
  .string()
  .regex(/^(?:\[[0-9a-fA-F:.]+\]|[^:[\]]*):\d{1,5}$/, 'HOST:PORT, e.g. 127.0.0.1:9464');

const Admission = z
  .object({
    maxSandboxes: z.number().int().positive(),
    memoryOvercommit: z.number().positive(),
    cpuOvercommit: z.number().positive(),
    minFreeMemoryMb: z.number().nonnegative(),
    maxSandboxMemoryMb: z.number().positive(),
    maxCpuPressurePercent: z.number().min(0).max(100),
    maxThreadsPercent: z.number().min(1).max(100),
    minFreeDiskMb: z.number().nonnegative(),
  })
  .partial()
  .strict();

const Network = z
  .object({
    mode: z.enum(['auto', 'isolated', 'none']),
    subnet4: z.string(),
    subnet6: z.union([z.string(), z.literal(false)]),
    upstream: z.array(z.string()),
    uplinks: z.array(z.string()),
    /** Special-use ranges this node treats as public in DNS answers (ADR 0005, SECURITY.md L40). */
    publicRanges: z.array(z.string()),
    /** DNS queries per second per sandbox; the firewall drops the rest (SECURITY.md J38, L40). */
    dnsQueriesPerSecond: z.number().int().positive(),
    /**
     * CIDRs no sandbox rule opens, besides the node's own networks, metadata
     * addresses and the cluster's own service addresses (ADR 0005, SECURITY.md L40).
     */
    protectedRanges: z.array(z.string()),
    /** The node's NAT64 translator prefixes besides 64:ff9b::/96 (RFC 6052; ADR 0005). */
    nat64Prefixes: z.array(z.string()),
  })
  .partial()
  .strict();

/** An operator's FnCall runtime (docs/fncall.md "Runtimes and pools"; `FnCallRuntime` in @dsec/edge). */
const FnCallRuntimeSchema = z
  .object({
    name: z.string().min(1),
    image: z.string().min(1),
    toolkits: z.array(z.string().min(1)).optional(),
    mode: z.enum(['python', 'exec']),
    command: z.array(z.string().min(1)).min(1).optional(),
    entry: z.string().min(1),
    defaultMemoryMb: z.number().int().positive(),
    maxMemoryMb: z.number().int().positive(),
    preload: z.array(z.string().min(1)).optional(),
    env: z.record(z.string(), z.string()).optional(),
    oomMessages: z.array(z.string().min(1)).optional(),
  })
  .strict();

/** The edge's FnCall pools (`FnCallPoolsOptions` in @dsec/edge; `fncallOptions`). */
const FnCallSection = z
  .object({
    /** `false`: the edge runs no function calls (default true). */
    enabled: z.boolean().optional(),
    /** Runtimes beside (or, by name, instead of) python, node and bash. */
    runtimes: z.array(FnCallRuntimeSchema).optional(),
    /** Warm workers per runtime, started with the edge (`{ "python": 4 }`). */
    warm: z.record(z.string(), z.number().int().min(0).max(1024)).optional(),
    sizing: z
      .object({
        min: z.number().int().min(0),
        max: z.number().int().min(1),
        spare: z.number().int().min(0),
        maxStarting: z.number().int().min(1),
        idleRetireMs: z.number().int().min(1000),
      })
      .partial()
      .strict()
      .optional(),
    cpuCoresPerWorker: z.number().positive().optional(),
    nprocPerCall: z.number().int().min(1).max(65_536).optional(),
    fileSizeLimitMb: z.number().int().positive().optional(),
    callUid: z.number().int().min(1).max(65_533).optional(),
    queueTimeoutMs: z.number().int().positive().optional(),
    maxCallsPerWorker: z.number().int().positive().optional(),
    inotifyWorkers: z.number().int().min(0).optional(),
  })
  .strict();

/**
 * TLS between apiservers and this edge (docs/cluster.md "TLS"): the edge
 * serves `certFile` with `keyFile`; `dsec edge join` registers the pins
 * every apiserver then requires, `pinSha256` and the certificates of
 * `pinCertFiles` (several while a certificate is rotated), by default the
 * SHA-256 of `certFile`.
 */
const EdgeTls = z
  .object({
    /** The edge's certificate (PEM), usually self-signed: it is pinned, not chained. */
    certFile: z.string().min(1),
    /** Its private key (PEM; keep it 0600). */
    keyFile: z.string().min(1),
    /** SHA-256 fingerprints apiservers accept (hex, colons optional, as openssl prints them). */
    pinSha256: z.array(z.string().min(1)).min(1).optional(),
    /** Certificates (PEM files) whose fingerprints apiservers accept. */
    pinCertFiles: z.array(z.string().min(1)).min(1).optional(),
  })
  .strict();

const EdgeSection = z
  .object({
    /** Unique in the cluster; encoded in every sandbox ID of this edge. */
    id: z.string().regex(/^[a-z0-9][a-z0-9-]{0,62}$/, 'an edge ID is 1-63 of a-z 0-9 -'),
    stateDir: z.string().min(1),
    host: Host.default('127.0.0.1'),
    port: Port.default(7430),
    /** The URL apiservers dial (default http://host:port, https:// with `tls`). */
    url: z.string().url().optional(),
    /** Serve the edge protocol over TLS with a pinned certificate (default: plaintext). */
    tls: EdgeTls.optional(),
    /** The per-edge credential shared with the control plane (created 0600 if missing). */
    secretFile: z.string().min(1),
    labels: Labels.default({}),
    cgroupParent: z
      .string()
      .regex(/^[a-zA-Z0-9_.-]{1,64}$/)
      .optional(),
    runtime: z.string().optional(),
    admission: Admission.optional(),
    network: Network.optional(),
    blobCacheBytes: z.number().int().positive().optional(),
    cgroupFavorDynmods: z.boolean().default(true),
    /** How long a paused sandbox is kept (default 24 h; ADR 0012). */
    pausedTtlSeconds: z.number().int().positive().optional(),
    /** Pause sandboxes unused for this long (default: off). */
    idlePauseSeconds: z.number().int().positive().optional(),
    /** Swap files the edge may add under its state dir for pauses. */
    pauseSwapMaxMb: z.number().int().nonnegative().optional(),
    /** How layers are mounted: `file` (Linux 6.12+), `loop` (older kernels) or `auto` (probe; default). */
    erofsMount: z.enum(['auto', 'file', 'loop']).optional(),
    /**
     * GPUs for FnCall workers (docs/gpu.md): `off` (default), `auto` (use the
     * NVIDIA driver's devices when there is one), or settings with an
     * inventory file describing the devices.
     */
    gpus: z
      .union([
        z.enum(['auto', 'off']),
        z
          .object({
            inventoryFile: z.string().min(1).optional(),
            maxSharedWorkersPerUnit: z.number().int().min(1).optional(),
            sharedPlacement: z.enum(['spread', 'pack']).optional(),
            modeset: z.boolean().optional(),
          })
          .strict(),
      ])
      .optional(),
    /** Function calls (docs/fncall.md): runtimes, warm pools, limits; `enabled: false` runs none. */
    fncall: FnCallSection.optional(),
    /** Bounds on one snapshot (docs/security.md, "Host-side work on sandbox-made trees"). */
    snapshot: z
      .object({
        maxFiles: z.number().int().positive().optional(),
        maxMb: z.number().int().positive().optional(),
        memoryMb: z.number().int().positive().optional(),
        timeoutSeconds: z.number().int().positive().optional(),
      })
      .strict()
      .optional(),
    logRequests: z.boolean().default(false),
    /** Serve this edge's metrics without authentication at `HOST:PORT/metrics` (default off). */
    metricsListen: ListenAddress.optional(),
  })
  .strict();

/**
 * One E2B template: a template string, or the native create fields it stands
 * for (checked as the create schema checks them), `user` naming who the
 * sandbox runs as (E2B's `user` by default).
 */
const E2bTemplate = z.union([
  z.string().min(1),
  schemas.CreateSandboxBody.partial()
    .extend({ image: z.string().min(1), user: schemas.userName.optional() })
    .strict()
    .refine((t) => t.user === undefined || t.initUser === undefined, {
      message: 'give user or initUser, not both',
    }),
]);

/** An image reference as a Dockerfile's FROM takes it (no transport; not DSec's own names). */
const Ref = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$/, 'an image reference (host/name:tag)')
  .refine((r) => !/^localhost\/dsec-/i.test(r), "localhost/dsec-… names are DSec's own")
  .refine(
    (r) =>
      !/^(?:docker:\/\/|(?:docker-archive|docker-daemon|oci|oci-archive|dir|containers-storage|ostree|sif|tarball):)/i.test(
        r,
      ),
    'an image reference, not a transport (oci:/path reads the host files)',
  );

const E2bSection = z
  .object({
    /**
     * Template name → DSec image (`image[:v][/workspace][+toolkit]…`) or a partial
     * native create body (`{ image, initUser | user, memoryLimitMb, … }`, docs/e2b.md).
     */
    templates: z.record(z.string().min(1), E2bTemplate).optional(),
    /**
     * Template builds' `fromImage` → `layer:<name[:version]>` (a layer of the
     * store, in the caller's view) or a registry reference, read before
     * pulling; `e2bdev/base` defaults to the template `base`'s image (docs/e2b.md).
     */
    imageAliases: z
      .record(
        Ref,
        z.union([z.string().regex(/^layer:[a-z0-9][a-z0-9._-]*(?::[A-Za-z0-9._-]+)?$/), Ref]),
      )
      .refine((r) => Object.keys(r).length <= 64, 'at most 64 image aliases')
      .optional(),
    /** Serve `<port>-<sandboxId>.<domain>` host names. */
    sandboxDomain: z.string().min(1).optional(),
  })
  .strict();

/** Per-caller bounds of an apiserver (docs/security.md, "Bounded work per caller"). */
const ApiLimitsSection = z
  .object({
    maxConnections: z.number().int().min(1).max(1_000_000),
    maxConnectionsPerAddress: z.number().int().min(1).max(1_000_000),
    pressureKeepAliveMs: z.number().int().min(10).max(600_000),
    maxRequestsPerKey: z.number().int().min(1).max(1_000_000),
    maxStreamsPerKey: z.number().int().min(1).max(1_000_000),
    streamBufferBytes: z
      .number()
      .int()
      .min(64 * 1024),
    outputBudgetBytes: z
      .number()
      .int()
      .min(1024 * 1024),
    authFailureBurst: z.number().int().min(1).max(1_000_000),
    authFailuresPerSecond: z.number().positive().max(1_000_000),
  })
  .partial()
  .strict();

const ApiserverSection = z
  .object({
    host: Host.default('127.0.0.1'),
    port: Port.default(7420),
    /** Where the first start writes the root project's admin key (0600). */
    adminKeyFile: z.string().min(1).optional(),
    /** Also take the watcher role (probe edges, record health): no separate watcher needed. */
    watch: z.boolean().default(false),
    /** How often the edge registry is read (edges joining, leaving, health). */
    registryRefreshMs: z.number().int().min(100).max(60_000).default(1000),
    logRequests: z.boolean().default(false),
    /** Serve the apiserver's metrics without authentication at `HOST:PORT/metrics` (default off). */
    metricsListen: ListenAddress.optional(),
    /**
     * How many apiservers serve the cluster: each admits this share of every
     * project's calls-per-second quota (`fncallsPerSecond`), so that together
     * they stay within it (docs/fncall.md). Default 1.
     */
    fncallQuotaShares: z.number().int().min(1).max(1000).optional(),
    /**
     * Host names clients reach this apiserver by, besides IP literals,
     * `localhost` and the machine's name (`api.example.com`, `*.example.com`,
     * `*` for any): other `Host` headers are refused (DNS rebinding).
     */
    allowedHosts: z
      .array(
        z
          .string()
          .refine(isAllowedHostPattern, 'a host name, `*.` and a host name, or `*` (no port)'),
      )
      .max(256)
      .optional(),
    /** Connection, key and stream caps, and the failed-authentication budget per address. */
    limits: ApiLimitsSection.optional(),
    /** How long audit rows are kept (default 90). */
    auditRetentionDays: z.number().int().min(1).max(36_500).optional(),
  })
  .strict();

const WatcherSection = z
  .object({
    intervalMs: z.number().int().min(100).max(60_000).default(1000),
    probeTimeoutMs: z.number().int().min(50).max(60_000).default(1500),
    /** Consecutive failed probes before an edge is marked down. */
    failuresBeforeDown: z.number().int().min(1).max(100).default(2),
  })
  .strict();

/**
 * `dsec up --config FILE`: the edge knobs of the node(s) `dsec up` runs,
 * without an edge's identity. The same file's `apiserver` (host, port,
 * logRequests), `imageStore` and `e2b` sections apply to it too.
 */
const UpSection = EdgeSection.pick({
  runtime: true,
  admission: true,
  network: true,
  blobCacheBytes: true,
  cgroupFavorDynmods: true,
  pausedTtlSeconds: true,
  idlePauseSeconds: true,
  pauseSwapMaxMb: true,
  erofsMount: true,
  gpus: true,
  fncall: true,
})
  .extend({
    /** Everything durable (default /var/lib/dsec; `--state-dir` overrides). */
    stateDir: z.string().min(1).optional(),
    /** Run a local cluster of this many edge processes instead of one in-process node. */
    edges: z.number().int().min(1).max(64).optional(),
    /** Stop every sandbox on shutdown instead of leaving them for the next start to adopt. */
    stopSandboxes: z.boolean().default(false),
  })
  .strict();

/**
 * How this node reaches image registries (docs/cluster.md "Registries"),
 * for registry imports, Dockerfile builds and evaluations alike; the
 * environment adds to it (`DSEC_INSECURE_REGISTRIES`, `DSEC_REGISTRY_MIRRORS`,
 * `REGISTRY_AUTH_FILE`). Each host is checked by `registrySettings`.
 */
const RegistriesSection = z
  .object({
    /** `host[:port]` of registries without TLS (or with an unverified certificate). */
    insecure: z.array(z.string().min(1).max(261)).max(MAX_REGISTRY_ENTRIES),
    /** Registry host → mirrors tried first, in order (`host[:port][/namespace]`). */
    mirrors: z.record(
      z.string().min(1).max(261),
      z.array(z.string().min(1).max(517)).min(1).max(MAX_MIRRORS_PER_REGISTRY),
    ),
    /** A containers-auth.json with credentials (relative to the config file). */
    authFile: z.string().min(1).max(4096),
    /** Registries API builds may pull `FROM` besides docker.io and those above (`*`: any). */
    buildFrom: z.array(z.string().min(1).max(261)).max(MAX_REGISTRY_ENTRIES),
  })
  .partial()
  .strict();

export const ClusterConfigSchema = z
  .object({
    /** A SQLite file path (embedded) or a `postgres://` URL shared by every apiserver. */
    database: z.string().min(1).optional(),
    /** Signs sandbox IDs; every apiserver must hold the same one (created 0600 if missing). */
    clusterSecretFile: z.string().min(1).optional(),
    /** Where layers live (`dir:/path`, a path, or `s3://…`); edges and apiservers alike. */
    imageStore: z.string().min(1).optional(),
    apiserver: ApiserverSection.optional(),
    /** The E2B-compatible API of the apiservers (docs/e2b.md). */
    e2b: E2bSection.optional(),
    watcher: WatcherSection.optional(),
    edge: EdgeSection.optional(),
    up: UpSection.optional(),
    /** Registries for imports, builds and evaluations: insecure hosts, mirrors, the auth file. */
    registries: RegistriesSection.optional(),
  })
  .strict();

export type ClusterConfig = z.infer<typeof ClusterConfigSchema>;
export type FnCallConfig = z.infer<typeof FnCallSection>;
export type EdgeConfig = z.infer<typeof EdgeSection>;
export type EdgeTlsConfig = z.infer<typeof EdgeTls>;
export type ApiserverConfig = z.infer<typeof ApiserverSection>;
export type ApiLimitsConfig = z.infer<typeof ApiLimitsSection>;
/** The bound settings of an apiserver section (`dsec up` reads them from the same section). */
export type ApiBoundsConfig = Pick<
  ApiserverConfig,
  'allowedHosts' | 'limits' | 'auditRetentionDays'
>;

/**
 * What an apiserver section's bounds mean to `buildApiServer` and to IAM
 * (`openControlDb`). An E2B wildcard domain is a name clients use too.
 */
export function apiBoundsOptions(
  bounds: ApiBoundsConfig = {},
  e2bDomain?: string,
): {
  api: {
    allowedHosts: string[];
    maxConnections?: number;
    limits: Omit<ApiLimitsConfig, 'maxConnections' | 'authFailureBurst' | 'authFailuresPerSecond'>;
  };
  iam: { authFailureBurst?: number; authFailuresPerSecond?: number; auditRetentionMs?: number };
} {
  const { maxConnections, authFailureBurst, authFailuresPerSecond, ...limits } =
    bounds.limits ?? {};
  return {
    api: {
      allowedHosts: [
        ...(bounds.allowedHosts ?? []),
        ...(e2bDomain ? [e2bDomain, `*.${e2bDomain}`] : []),
      ],
      ...(maxConnections !== undefined ? { maxConnections } : {}),
      limits,
    },
    iam: {
      ...(authFailureBurst !== undefined ? { authFailureBurst } : {}),
      ...(authFailuresPerSecond !== undefined ? { authFailuresPerSecond } : {}),
      ...(bounds.auditRetentionDays !== undefined
        ? { auditRetentionMs: bounds.auditRetentionDays * 86_400_000 }
        : {}),
    },
  };
}
export type WatcherConfig = z.infer<typeof WatcherSection>;
export type RegistriesConfig = z.infer<typeof RegistriesSection>;

/**
 * The node's registry settings: the config's `registries` section plus the
 * environment (`registrySettings`). `invalid_argument` naming the entry.
 */
export function nodeRegistrySettings(
  config: Pick<ClusterConfig, 'registries'> | undefined,
  env: NodeJS.ProcessEnv = process.env,
): RegistrySettings {
  return registrySettings(config?.registries, env);
}
export type UpConfig = z.infer<typeof UpSection>;

/** What an edge gets of a config's `fncall` section: `false` when it is disabled. */
export function fncallOptions(
  section: FnCallConfig | undefined,
): Omit<FnCallConfig, 'enabled'> | false | undefined {
  if (section === undefined) return undefined;
  const { enabled, ...options } = section;
  return enabled === false ? false : options;
}

/** The parsed apiserver section with its defaults, for a config without one. */
export function apiserverDefaults(config: ClusterConfig): ApiserverConfig {
  return config.apiserver ?? ApiserverSection.parse({});
}

/** The parsed watcher section with its defaults, for roles that watch without one. */
export function watcherDefaults(config: ClusterConfig): WatcherConfig {
  return config.watcher ?? WatcherSection.parse({});
}

/**
 * Validates a config object. Relative paths are resolved against `baseDir`
 * (the config file's directory), so a config means the same from any cwd.
 */
export function parseClusterConfig(input: unknown, baseDir = process.cwd()): ClusterConfig {
  const parsed = ClusterConfigSchema.safeParse(input);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    const field = issue.path.join('.');
    throw new DsecError('invalid_argument', `config: ${field || '(top level)'}: ${issue.message}`, {
      field,
      details: { issues: parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`) },
    });
  }
  const config = parsed.data;
  const abs = (p: string) => (isAbsolute(p) ? p : resolve(baseDir, p));
  const isUrl = (s: string) => /^[a-z][a-z0-9+.-]*:\/\//i.test(s);
  if (config.database && !isUrl(config.database)) config.database = abs(config.database);
  if (config.clusterSecretFile) config.clusterSecretFile = abs(config.clusterSecretFile);
  if (config.imageStore && !isUrl(config.imageStore) && !config.imageStore.startsWith('dir:'))
    config.imageStore = abs(config.imageStore);
  if (config.apiserver?.adminKeyFile)
    config.apiserver.adminKeyFile = abs(config.apiserver.adminKeyFile);
  if (config.up?.stateDir) config.up.stateDir = abs(config.up.stateDir);
  if (config.registries) {
    if (config.registries.authFile) config.registries.authFile = abs(config.registries.authFile);
    // Hosts checked now, so a typo fails the start, not the first pull.
    registrySettings(config.registries, {});
  }
  for (const section of [config.up, config.edge]) {
    const gpus = section?.gpus;
    if (typeof gpus === 'object' && gpus.inventoryFile)
      gpus.inventoryFile = abs(gpus.inventoryFile);
  }
  if (config.edge) {
    config.edge.stateDir = abs(config.edge.stateDir);
    config.edge.secretFile = abs(config.edge.secretFile);
    const tls = config.edge.tls;
    if (tls) {
      tls.certFile = abs(tls.certFile);
      tls.keyFile = abs(tls.keyFile);
      if (tls.pinCertFiles) tls.pinCertFiles = tls.pinCertFiles.map(abs);
      if (tls.pinSha256)
        tls.pinSha256 = tls.pinSha256.map((p, i) =>
          normalizeFingerprint(p, `edge.tls.pinSha256.${i}`),
        );
      if (config.edge.url && !config.edge.url.startsWith('https:'))
        throw new DsecError('invalid_argument', 'config: edge.url must be https: with edge.tls', {
          field: 'edge.url',
        });
    }
  }
  return config;
}

/** Reads and validates a config file (errors name the file). */
export async function loadClusterConfig(file: string): Promise<ClusterConfig> {
  let text: string;
  try {
    text = await readFile(file, 'utf8');
  } catch (err) {
    throw new DsecError('invalid_argument', `cannot read config ${file}: ${String(err)}`, {
      field: 'config',
      cause: err,
    });
  }
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (err) {
    throw new DsecError('invalid_argument', `config ${file} is not JSON: ${String(err)}`, {
      field: 'config',
      cause: err,
    });
  }
  try {
    return parseClusterConfig(json, dirname(resolve(file)));
  } catch (err) {
    if (err instanceof DsecError)
      throw new DsecError('invalid_argument', `${file}: ${err.message}`, {
        ...(err.field ? { field: err.field } : {}),
        ...(err.details ? { details: err.details } : {}),
      });
    throw err;
  }
}

/** A section a role needs, or an error saying which one is missing. */
export function requireSection<K extends 'database' | 'clusterSecretFile' | 'edge'>(
  config: ClusterConfig,
  key: K,
  role: string,
): NonNullable<ClusterConfig[K]> {
  const value = config[key];
  if (value === undefined)
    throw new DsecError('invalid_argument', `config: \`${key}\` is required for ${role}`, {
      field: key,
    });
  return value;
}

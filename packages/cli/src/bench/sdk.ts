import { spawn } from 'node:child_process';
import http from 'node:http';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { startSingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { describeMachine } from './create.js';
import { ratio, summarize, type LatencySummary } from './stats.js';

export interface SdkBenchOptions {
  /** Measured exec round trips per client. Default 200. */
  iterations: number;
  /** Unmeasured round trips first. Default 20. */
  warmup: number;
  /**
   * Times the whole interleaved measurement is repeated (each `iterations`
   * round trips per client, after its own warm-up). Default 1. Every round's
   * ratios are reported, and their median: load from elsewhere comes in
   * bursts, and a burst shifts one round, not the median.
   */
  rounds?: number | undefined;
  /** The Python interpreter with httpx (default /usr/bin/python3). */
  python?: string | undefined;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface SdkBenchReport {
  benchmark: 'sdk';
  cycle: string;
  iterations: number;
  results: {
    typescript: LatencySummary;
    python: LatencySummary;
    e2b: LatencySummary;
    /**
     * The E2B path without the e2b SDK: the same `Start` RPC from a bare
     * node:http client (one pooled socket, Connect JSON framing). Splits the
     * E2B gap into the server's part and the e2b client's own.
     */
    e2bServerPath: LatencySummary;
  } & Record<PythonProvider, LatencySummary>;
  /**
   * Each client's p50 ÷ the TypeScript SDK's (target ≤ 1.5 for python and
   * e2b), and each Python framework provider's p50 ÷ the Python SDK's (target
   * ≤ 1.2), over all rounds' samples.
   */
  ratios: SdkRatios;
  /** The same ratios per round, and their median (with one round, the ratios again). */
  rounds: { ratios: SdkRatios[]; median: SdkRatios };
  /** `met`: python and e2b within `maxRatio`, every provider within `providerMaxRatio`. */
  targets: { maxRatio: number; providerMaxRatio: number; met: boolean };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * The Python framework providers (python/dsec/integrations/), each timed
 * through its own exec call in the Python child: inspect_ai's
 * `SandboxEnvironment.exec(["true"])`, SWE-ReX's `DSecRuntime.execute(Command(["true"]))`,
 * verifiers' (prime-sandboxes') `execute_command(id, "true")`, tinker's
 * `run_command("true")`, Harbor's `DSecEnvironment.exec("true")`.
 */
export const PYTHON_PROVIDERS = ['inspect_ai', 'swerex', 'verifiers', 'tinker', 'harbor'] as const;
export type PythonProvider = (typeof PYTHON_PROVIDERS)[number];

export type SdkRatios = {
  /** ÷ the TypeScript SDK's p50. */
  python: number | null;
  e2b: number | null;
  e2bServerPath: number | null;
} & Record<PythonProvider, number | null>; // ÷ the Python SDK's p50

export const SDK_TARGET_RATIO = 1.5;
/** A provider's exec p50 within this × the Python SDK's (issue 26). */
export const SDK_PROVIDER_TARGET_RATIO = 1.2;

export type SdkSystem = 'typescript' | 'python' | 'e2b' | 'e2bServerPath' | PythonProvider;

/** Ratios of one set of summaries: SDKs to TypeScript, providers to the Python SDK. */
export function sdkRatios(results: Record<SdkSystem, LatencySummary>): SdkRatios {
  const out = {
    python: ratio(results.python, results.typescript),
    e2b: ratio(results.e2b, results.typescript),
    e2bServerPath: ratio(results.e2bServerPath, results.typescript),
  } as SdkRatios;
  for (const p of PYTHON_PROVIDERS) out[p] = ratio(results[p], results.python);
  return out;
}

/** Whether python and e2b are within 1.5 × TypeScript and every provider within 1.2 × Python. */
export function sdkTargetsMet(ratios: SdkRatios): boolean {
  const within = (r: number | null, max: number) => r !== null && r <= max;
  return (
    within(ratios.python, SDK_TARGET_RATIO) &&
    within(ratios.e2b, SDK_TARGET_RATIO) &&
    PYTHON_PROVIDERS.every((p) => within(ratios[p], SDK_PROVIDER_TARGET_RATIO))
  );
}

/** The median of each ratio over rounds (null where no round has one). */
export function medianRatios(roundRatios: SdkRatios[]): SdkRatios {
  const median = (key: keyof SdkRatios): number | null => {
    const v = roundRatios.map((r) => r[key]).filter((x): x is number => x !== null);
    v.sort((a, b) => a - b);
    if (v.length === 0) return null;
    const mid = v.length >> 1;
    return v.length % 2 ? v[mid]! : Math.round(((v[mid - 1]! + v[mid]!) / 2) * 1000) / 1000;
  };
  const keys = ['python', 'e2b', 'e2bServerPath', ...PYTHON_PROVIDERS] as const;
  return Object.fromEntries(keys.map((k) => [k, median(k)])) as SdkRatios;
}

/**
 * Runs one exec per request (a line `go <client>` on stdin), timing it inside
 * the Python process, and prints the milliseconds per line: the pipe to this
 * process is not part of the measure, as the TypeScript clients' own timing
 * has no pipe in it either. `<client>` is `python` (the SDK's
 * `sandbox.exec(["true"])`) or one of {@link PYTHON_PROVIDERS}, each through
 * its own exec method.
 */
const PYTHON_CLIENT = `
import asyncio, os, sys, tempfile, time, types
from dsec import DSecClient

async def main():
    async with DSecClient() as client:
        sandbox = client.sandbox(os.environ["DSEC_BENCH_SANDBOX"])
        url, key = os.environ["DSEC_URL"], os.environ["DSEC_API_KEY"]
        closers = []
        calls = {}

        async def sdk():
            r = await sandbox.exec(["true"])
            return r.exit_code == 0
        calls["python"] = sdk

        # Each framework provider, as that framework drives it (without the framework
        # installed the providers use their stand-in types), on the same sandbox where the
        # provider takes one; Harbor starts its own, as it does for every trial.
        from dsec.integrations import inspect_ai
        env = inspect_ai.DSecSandboxEnvironment(sandbox, client, inspect_ai.resolve_config(None), "/")
        async def inspect_exec():
            return (await env.exec(["true"])).success
        calls["inspect_ai"] = inspect_exec

        from dsec.integrations import swerex
        runtime = swerex.DSecRuntime(sandbox)
        async def swerex_exec():
            return (await runtime.execute(swerex.Command(command=["true"]))).exit_code == 0
        calls["swerex"] = swerex_exec

        from dsec.integrations import verifiers
        prime = verifiers.DSecSandboxClient(url, key)
        closers.append(prime.aclose)
        async def verifiers_exec():
            return (await prime.execute_command(sandbox.id, "true")).exit_code == 0
        calls["verifiers"] = verifiers_exec

        from dsec.integrations import tinker, _provider_common
        box = tinker.DSecSandbox(sandbox, _provider_common.Connection(client, url, key), owns_connection=False)
        async def tinker_exec():
            return (await box.run_command("true")).exit_code == 0
        calls["tinker"] = tinker_exec

        from dsec.integrations import harbor
        task_env = types.SimpleNamespace(cpus=1, memory_mb=256, storage_mb=None, gpus=0,
                                         allow_internet=False, docker_image=None, env={})
        env_dir = tempfile.mkdtemp(prefix="dsec-bench-harbor-")
        trial = harbor.DSecEnvironment(env_dir, "bench", "bench-sdk", None, task_env, url=url,
                                       api_key=key, image=os.environ["DSEC_BENCH_IMAGE"], shell="sh",
                                       ttl_seconds=1800)
        await trial.start(force_build=False)
        closers.append(lambda: trial.stop(delete=True))
        async def harbor_exec():
            return (await trial.exec("true")).return_code == 0
        calls["harbor"] = harbor_exec

        loop = asyncio.get_running_loop()
        print("ready", flush=True)
        try:
            while True:
                line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
                if len(line) != 2 or line[0] != "go":
                    return
                call = calls[line[1]]
                t0 = time.perf_counter()
                ok = await call()
                ms = (time.perf_counter() - t0) * 1000
                if not ok:
                    raise SystemExit(f"{line[1]}: true did not succeed")
                print(f"{ms:.4f}", flush=True)
        finally:
            for close in reversed(closers):
                await close()
            os.rmdir(env_dir)

asyncio.run(main())
`;

/** The Python SDK (python/dsec), found above this file in the source tree or the bundle. */
function pythonSdkDir(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  for (;;) {
    if (existsSync(join(dir, 'python', 'dsec', '__init__.py'))) return join(dir, 'python');
    const up = dirname(dir);
    if (up === dir)
      throw new Error('python/dsec not found above the CLI: run from a DSec checkout');
    dir = up;
  }
}

/** A persistent Python client: `exec(name)` resolves with the milliseconds it measured. */
async function startPythonClient(
  python: string,
  env: Record<string, string>,
): Promise<{ exec(name: 'python' | PythonProvider): Promise<number>; close(): Promise<void> }> {
  const child = spawn(python, ['-c', PYTHON_CLIENT], {
    env: { ...process.env, ...env, PYTHONPATH: pythonSdkDir() },
    stdio: ['pipe', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (c: Buffer) => (stderr += c.toString()));
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  const next = async (): Promise<string> => {
    const r = await lines.next();
    if (r.done) throw new Error(`the Python client exited: ${stderr.trim().slice(-2000)}`);
    return r.value;
  };
  if ((await next()) !== 'ready') throw new Error('the Python client did not start');
  return {
    async exec(name) {
      child.stdin.write(`go ${name}\n`);
      return Number(await next());
    },
    async close() {
      child.stdin.end();
      if (child.exitCode === null) await new Promise((r) => child.once('exit', r));
    },
  };
}

/**
 * envd's `Start` RPC as the e2b SDK sends it for `commands.run('true')`, from
 * node:http with a keep-alive agent: Connect's server-streaming JSON framing
 * (a 5-byte envelope per message), the sandbox named by `E2b-Sandbox-Id`.
 */
function rawConnectStart(
  url: string,
  key: string,
  sandboxId: string,
): { run(): Promise<void>; close(): void } {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const message = Buffer.from(
    JSON.stringify({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'true'] }, stdin: false }),
  );
  const envelope = Buffer.alloc(5);
  envelope.writeUInt32BE(message.length, 1);
  const payload = Buffer.concat([envelope, message]);
  return {
    run: () =>
      new Promise<void>((resolve, reject) => {
        const req = http.request(`${url}/process.Process/Start`, {
          method: 'POST',
          agent,
          headers: {
            'content-type': 'application/connect+json',
            'connect-protocol-version': '1',
            'e2b-sandbox-id': sandboxId,
            'e2b-sandbox-port': '49983',
            'x-access-token': key,
            'content-length': payload.length,
          },
        });
        req.on('error', reject);
        req.on('response', (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (c: Buffer) => chunks.push(c));
          res.on('error', reject);
          res.on('end', () => {
            const text = Buffer.concat(chunks).toString();
            if (res.statusCode !== 200 || !text.includes('"exit status 0"')) {
              reject(new Error(`Start answered ${res.statusCode}: ${text.slice(0, 200)}`));
            } else resolve();
          });
        });
        req.end(payload);
      }),
    close: () => agent.destroy(),
  };
}

/**
 * `true` through each client against one sandbox of a single node (`dsec
 * up`'s stack, in this process): the TypeScript SDK (`sandbox.exec`), the
 * Python SDK (asyncio `sandbox.exec`, in its own process), the unmodified
 * `e2b` SDK through the E2B-compatible API (`commands.run`, the envd process
 * service over Connect), and each Python framework provider's exec in the
 * Python process. Rounds interleave them all, rotating which goes first;
 * every client keeps its connections warm.
 */
export async function benchSdk(options: SdkBenchOptions): Promise<SdkBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-sdk-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-sdk-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, cgroupParent });
    cleanups.unshift(async () => {
      await node.close({ stopSandboxes: true });
      for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [])) {
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
      }
    });
    await makeBusyboxRootfs(join(work, 'rootfs'));
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(work, 'rootfs') } });

    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());
    const sandbox = await client.runContainer({
      image: 'busybox',
      memoryLimitMb: 256,
      cpuCoresLimit: 1,
      ttlSeconds: 1800,
    });

    // The unmodified E2B SDK, pointed at DSec as a user would (docs/e2b.md).
    const { Sandbox: E2bSandbox } = await import('e2b');
    const e2b = await E2bSandbox.connect(sandbox.id, {
      apiKey: node.adminKey,
      apiUrl: node.url,
      sandboxUrl: node.url,
    });

    const python = await startPythonClient(options.python ?? '/usr/bin/python3', {
      DSEC_URL: node.url,
      DSEC_API_KEY: node.adminKey,
      DSEC_BENCH_SANDBOX: sandbox.id,
      DSEC_BENCH_IMAGE: 'busybox',
    });
    cleanups.unshift(() => python.close());

    const rawStart = rawConnectStart(node.url, node.adminKey, sandbox.id);
    cleanups.unshift(async () => rawStart.close());

    const timed = async (fn: () => Promise<unknown>) => {
      const t0 = process.hrtime.bigint();
      await fn();
      return Number(process.hrtime.bigint() - t0) / 1e6;
    };
    const systems: Record<SdkSystem, () => Promise<number>> = {
      typescript: () =>
        timed(async () => {
          const r = await sandbox.exec(['true']);
          if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}`);
        }),
      python: () => python.exec('python'),
      e2b: () =>
        timed(async () => {
          const r = await e2b.commands.run('true');
          if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}`);
        }),
      e2bServerPath: () => timed(() => rawStart.run()),
      ...(Object.fromEntries(PYTHON_PROVIDERS.map((p) => [p, () => python.exec(p)])) as Record<
        PythonProvider,
        () => Promise<number>
      >),
    };
    const names = Object.keys(systems) as (keyof typeof systems)[];
    type Samples = Record<keyof typeof systems, number[]>;
    const newSamples = (): Samples =>
      Object.fromEntries(names.map((n) => [n, [] as number[]])) as Samples;
    const all = newSamples();
    const perRound: Samples[] = [];
    const rounds = Math.max(1, Math.floor(options.rounds ?? 1));
    const perRoundCalls = options.warmup + options.iterations;
    for (let r = 0; r < rounds; r++) {
      const samples = newSamples();
      for (let i = 0; i < perRoundCalls; i++) {
        if (options.signal?.aborted) throw new Error('benchmark aborted');
        for (let k = 0; k < names.length; k++) {
          const name = names[(i + k) % names.length]!;
          const ms = await systems[name]();
          if (i >= options.warmup) samples[name].push(ms);
        }
        options.onProgress?.(r * perRoundCalls + i + 1, rounds * perRoundCalls);
      }
      perRound.push(samples);
      for (const name of names) all[name].push(...samples[name]);
    }
    await sandbox.stop();

    const summaries = (s: Samples) =>
      Object.fromEntries(names.map((n) => [n, summarize(s[n])])) as Record<
        SdkSystem,
        LatencySummary
      >;
    const results = summaries(all);
    const ratios = sdkRatios(results);
    const roundRatios = perRound.map((s) => sdkRatios(summaries(s)));
    return {
      benchmark: 'sdk',
      cycle: 'exec `true` in a running sandbox, one round trip per client',
      iterations: options.iterations * rounds,
      results,
      ratios,
      rounds: {
        ratios: roundRatios,
        median: medianRatios(roundRatios),
      },
      targets: {
        maxRatio: SDK_TARGET_RATIO,
        providerMaxRatio: SDK_PROVIDER_TARGET_RATIO,
        met: sdkTargetsMet(ratios),
      },
      method:
        'one sandbox on a single node in this process; TypeScript: @dsec/sdk sandbox.exec([true]); ' +
        'Python: dsec asyncio sandbox.exec([true]) in a /usr/bin/python3 child, timed inside it; ' +
        'E2B: the unmodified e2b SDK, Sandbox.connect then commands.run(true); e2bServerPath: the ' +
        'same envd Start RPC (`/bin/bash -l -c true`, as the SDK sends it) from a bare node:http ' +
        'client; inspect_ai, swerex, verifiers, tinker, harbor: each Python framework provider, its ' +
        'own exec call in the same Python child (Harbor on its own busybox sandbox, the others on ' +
        'the same one), ratios to the Python SDK. Calls interleaved, the first client rotating ' +
        'each call; with --rounds N the whole ' +
        'measurement is repeated N times (each with its own warm-up) and each round reported.',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

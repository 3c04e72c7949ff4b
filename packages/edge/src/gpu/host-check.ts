/**
 * The GPU runbook's tool (docs/gpu.md): shows what DSec discovers on this
 * host, what an assignment gives a worker, and writes an OCI bundle that
 * runs one command with that assignment under runc, through the same spec
 * builder and merge the edge uses. Nothing here runs unless invoked:
 *
 *   node --conditions=dsec-source --import tsx packages/edge/src/gpu/host-check.ts inventory
 *   ... host-check.ts assign --mode exclusive [--count N] [--model M] [--workers K]
 *   ... host-check.ts bundle --rootfs DIR --out DIR [--mode ...] -- COMMAND...
 *
 * Add `--nvidia-smi PATH` / `--container-cli PATH` for tools off PATH.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import type { FnCallGpuRequest, SandboxSpec } from '@dsec/core';
import { buildContainerConfig, INIT_PATH_IN_SANDBOX } from '../backends/container/spec.js';
import { GpuAllocator } from './allocator.js';
import { discoverGpuInventory } from './discover.js';
import type { GpuHostProbe } from './discover.js';
import { gpuSpecFragment, withGpu } from './oci-fragment.js';

/**
 * Runs the tool with `argv` (without node and the script); returns what it
 * prints. `probe` replaces the host (tests answer from fixtures).
 */
export async function gpuHostCheck(
  argv: string[],
  options: { probe?: GpuHostProbe | undefined } = {},
): Promise<string> {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      mode: { type: 'string', default: 'exclusive' },
      count: { type: 'string' },
      model: { type: 'string' },
      workers: { type: 'string', default: '1' },
      'max-shared': { type: 'string', default: '4' },
      rootfs: { type: 'string' },
      out: { type: 'string' },
      'nvidia-smi': { type: 'string' },
      'container-cli': { type: 'string' },
    },
  });
  const [verb, ...command] = positionals;
  const inventory = await discoverGpuInventory({
    probe: options.probe,
    nvidiaSmi: values['nvidia-smi'],
    containerCli: values['container-cli'],
  });
  if (verb === 'inventory') return `${JSON.stringify(inventory, null, 2)}\n`;

  const request: FnCallGpuRequest = {
    mode: values.mode === 'shared' ? 'shared' : 'exclusive',
    ...(values.count !== undefined ? { count: Number(values.count) } : {}),
    ...(values.model !== undefined ? { model: values.model } : {}),
  };
  const alloc = new GpuAllocator(inventory, {
    maxSharedWorkersPerUnit: Number(values['max-shared']),
  });
  if (verb === 'assign') {
    const out = [];
    for (let w = 0; w < Number(values.workers); w++) {
      const a = alloc.assign(`worker-${w}`, request);
      out.push({ assignment: a, fragment: gpuSpecFragment(a, inventory) });
    }
    return `${JSON.stringify(out, null, 2)}\n`;
  }
  if (verb === 'bundle') {
    if (!values.rootfs || !values.out || command.length === 0) {
      throw new Error('bundle needs --rootfs DIR --out DIR -- COMMAND...');
    }
    const a = alloc.assign('worker-0', request);
    const config = withGpu(
      buildContainerConfig({
        spec: {
          memoryLimitMb: 8192,
          cpuCoresLimit: 4,
          pidsLimit: 1024,
          env: {},
        } as unknown as SandboxSpec,
        hostname: 'gpu-check',
        rootfs: resolve(values.rootfs),
        initBinary: '/bin/true',
        cgroupsPath: '/dsec-gpu-check',
        // An identity map: still a user namespace (so the runtime bind-mounts
        // the device nodes, as in a sandbox) over a root-owned rootfs.
        hostIdBase: 0,
        idCount: 65_536,
      }),
      gpuSpecFragment(a, inventory),
    ) as { process: { args: string[]; env: string[] }; mounts: { destination: string }[] };
    // The command itself instead of dsec-init (there is no command daemon here).
    config.process.args = command;
    config.mounts = config.mounts.filter((m) => m.destination !== INIT_PATH_IN_SANDBOX);
    mkdirSync(values.out, { recursive: true });
    writeFileSync(join(values.out, 'config.json'), JSON.stringify(config, null, 2));
    return `${JSON.stringify(a)}\nwrote ${join(values.out, 'config.json')}: run it with\n  runc run --bundle ${values.out} gpu-check\n`;
  }
  throw new Error('usage: host-check.ts inventory | assign [...] | bundle [...] -- COMMAND');
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(new URL(import.meta.url).pathname)) {
  gpuHostCheck(process.argv.slice(2)).then(
    (out) => process.stdout.write(out),
    (err: unknown) => {
      process.stderr.write(`${err instanceof Error ? err.message : String(err)}\n`);
      process.exitCode = 1;
    },
  );
}

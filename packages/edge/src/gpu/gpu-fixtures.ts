import type { GpuHostProbe } from './discover.js';

/**
 * Two GPU hosts described as the text their tools print, for the GPU tests
 * (no GPU is attached to the machines DSec is developed on). The formats are
 * those of the NVIDIA driver's `nvidia-smi` (R535/R550), procfs and
 * `nvidia-container-cli list`; docs/gpu.md's runbook compares them with a
 * real host's output. UUIDs and bus IDs are made up.
 *
 * - `H200_NODE`: an HGX H200 node, 8 × H200 141 GB, MIG off, driver 550,
 *   minors equal to indexes (the usual case).
 * - `A100_MIG_NODE`: 2 × A100-SXM4-80GB, driver 535. GPU 0 is in MIG mode
 *   with a 3g.40gb and two 1g.10gb instances; GPU 1 is whole. The driver
 *   probed the GPUs in the other order than PCI: index 0 is /dev/nvidia1.
 */
export interface GpuHostFixture {
  /** Command line (`file arg arg`) → stdout. A command not here fails. */
  commands: Record<string, string>;
  /** Path → contents. */
  files: Record<string, string>;
  /** /dev nodes: path → [major, minor]. */
  devices: Record<string, [number, number]>;
  /** Symlinks: path → the path it resolves to. */
  symlinks: Record<string, string>;
}

const QUERY = `nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version,mig.mode.current --format=csv,noheader,nounits`;
const LIB = '/usr/lib/x86_64-linux-gnu';

const H200_BUSES = ['18', '2A', '3A', '5D', '9A', 'AB', 'BA', 'DB'];
const h200Uuid = (i: number) =>
  `GPU-6f1c${i}e2a-9b3d-4c5e-8f70-1a2b3c4d5e${(0x60 + i).toString(16)}`;

function driverLibraries(version: string): string[] {
  return [
    'libnvidia-ml',
    'libnvidia-cfg',
    'libcuda',
    'libcudadebugger',
    'libnvidia-opencl',
    'libnvidia-ptxjitcompiler',
    'libnvidia-allocator',
    'libnvidia-nvvm',
  ].map((l) => `${LIB}/${l}.so.${version}`);
}

/** The sonames the driver's installer links beside each library (`libcuda.so.1` → `libcuda.so.<version>`). */
function driverSymlinks(version: string): Record<string, string> {
  const so: Record<string, string> = {
    'libnvidia-ml': '1',
    'libnvidia-cfg': '1',
    libcuda: '1',
    libcudadebugger: '1',
    'libnvidia-opencl': '1',
    'libnvidia-ptxjitcompiler': '1',
    'libnvidia-allocator': '1',
    'libnvidia-nvvm': '4',
  };
  const out: Record<string, string> = {};
  for (const [lib, n] of Object.entries(so)) {
    out[`${LIB}/${lib}.so.${n}`] = `${LIB}/${lib}.so.${version}`;
  }
  // The development link, a chain through the soname.
  out[`${LIB}/libcuda.so`] = `${LIB}/libcuda.so.${version}`;
  // A link to something else in the same directory must not become an alias.
  out[`${LIB}/libc.so.6`] = `${LIB}/libc.so.6`;
  return out;
}

const BINARIES = `/usr/bin/nvidia-smi
/usr/bin/nvidia-debugdump
/usr/bin/nvidia-persistenced
/usr/bin/nvidia-cuda-mps-control
/usr/bin/nvidia-cuda-mps-server
`;

/** The lines of `/proc/driver/nvidia-caps/mig-minors` for GPU minors 0..gpus-1 (the driver lists 0..31). */
function migMinors(gpus: number): string {
  const lines = ['config 1', 'monitor 2'];
  let n = 3;
  for (let g = 0; g < gpus; g++) {
    for (let gi = 0; gi < 15; gi++) {
      lines.push(`gpu${g}/gi${gi}/access ${n++}`);
      for (let ci = 0; ci < 8; ci++) lines.push(`gpu${g}/gi${gi}/ci${ci}/access ${n++}`);
    }
  }
  return `${lines.join('\n')}\n`;
}

/** The minor `migMinors` gives `gpu<g>/gi<gi>[/ci<ci>]/access`. */
export function fixtureCapMinor(g: number, gi: number, ci?: number): number {
  return 3 + g * 15 * 9 + gi * 9 + (ci === undefined ? 0 : 1 + ci);
}

export const H200_NODE: GpuHostFixture = {
  commands: {
    [QUERY]: H200_BUSES.map(
      (b, i) =>
        `${i}, ${h200Uuid(i)}, NVIDIA H200, 143771, 00000000:${b}:00.0, 550.90.07, Disabled`,
    ).join('\n'),
    'nvidia-smi -L': H200_BUSES.map((_, i) => `GPU ${i}: NVIDIA H200 (UUID: ${h200Uuid(i)})`).join(
      '\n',
    ),
    'nvidia-container-cli list --libraries': `${driverLibraries('550.90.07').join('\n')}\n`,
    'nvidia-container-cli list --binaries': BINARIES,
  },
  files: {
    '/proc/devices': `Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
  5 /dev/console
  5 /dev/ptmx
 10 misc
 13 input
 89 i2c
128 ptm
136 pts
195 nvidia
195 nvidia-modeset
195 nvidiactl
226 drm
234 nvidia-nvswitch
235 nvidia-nvlink
236 nvidia-caps
237 nvidia-uvm
238 nvidia-caps-imex-channels

Block devices:
  7 loop
  8 sd
259 blkext
`,
    ...Object.fromEntries(
      H200_BUSES.map((b, i) => [
        `/proc/driver/nvidia/gpus/0000:${b.toLowerCase()}:00.0/information`,
        `Model: \t\t NVIDIA H200
IRQ:   \t\t ${300 + i}
GPU UUID: \t ${h200Uuid(i)}
Video BIOS: \t 96.00.99.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:${b.toLowerCase()}:00.0
Device Minor: \t ${i}
GPU Excluded:\t No
`,
      ]),
    ),
  },
  devices: {
    '/dev/nvidiactl': [195, 255],
    '/dev/nvidia-modeset': [195, 254],
    '/dev/nvidia-uvm': [237, 0],
    '/dev/nvidia-uvm-tools': [237, 1],
    ...Object.fromEntries(H200_BUSES.map((_, i) => [`/dev/nvidia${i}`, [195, i]])),
  },
  symlinks: driverSymlinks('550.90.07'),
};

const A100_UUID = [
  'GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f',
  'GPU-0e1b9c37-77a4-2f5d-6e83-b4a0c9d2e1f7',
];
export const A100_MIG_UUIDS = {
  g3: 'MIG-a8d7a9ba-d4b1-5e0f-a9b9-4b6f1f0d4d1e',
  g1a: 'MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f',
  g1b: 'MIG-3f9e0a12-8c7b-5d64-b2a1-0e9f8d7c6b5a',
};

export const A100_MIG_NODE: GpuHostFixture = {
  commands: {
    [QUERY]: `0, ${A100_UUID[0]}, NVIDIA A100-SXM4-80GB, 81920, 00000000:07:00.0, 535.183.01, Enabled
1, ${A100_UUID[1]}, NVIDIA A100-SXM4-80GB, 81920, 00000000:0F:00.0, 535.183.01, Disabled
`,
    'nvidia-smi -L': `GPU 0: NVIDIA A100-SXM4-80GB (UUID: ${A100_UUID[0]})
  MIG 3g.40gb     Device  0: (UUID: ${A100_MIG_UUIDS.g3})
  MIG 1g.10gb     Device  1: (UUID: ${A100_MIG_UUIDS.g1a})
  MIG 1g.10gb     Device  2: (UUID: ${A100_MIG_UUIDS.g1b})
GPU 1: NVIDIA A100-SXM4-80GB (UUID: ${A100_UUID[1]})
`,
    // Plain nvidia-smi, R535 layout: the MIG devices table ties device index to GI/CI.
    'nvidia-smi': `Mon Nov 30 15:10:02 2026
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.183.01             Driver Version: 535.183.01   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
|   0  NVIDIA A100-SXM4-80GB          On  | 00000000:07:00.0 Off |                   On |
| N/A   33C    P0              62W / 400W |     88MiB / 81920MiB |     N/A      Default |
|                                         |                      |              Enabled |
+-----------------------------------------+----------------------+----------------------+
|   1  NVIDIA A100-SXM4-80GB          On  | 00000000:0F:00.0 Off |                    0 |
| N/A   31C    P0              60W / 400W |      4MiB / 81920MiB |      0%      Default |
|                                         |                      |             Disabled |
+-----------------------------------------+----------------------+----------------------+

+---------------------------------------------------------------------------------------+
| MIG devices:                                                                          |
+------------------+--------------------------------+-----------+-----------------------+
| GPU  GI  CI  MIG |                   Memory-Usage |        Vol|      Shared           |
|      ID  ID  Dev |                     BAR1-Usage | SM     Unc| CE ENC DEC OFA JPG    |
|                  |                                |        ECC|                       |
|==================+================================+===========+=======================|
|  0    2   0   0  |              37MiB / 40192MiB  | 42      0 |  3   0    2    0    0 |
|                  |               0MiB / 65535MiB  |           |                       |
+------------------+--------------------------------+-----------+-----------------------+
|  0    9   0   1  |              12MiB /  9728MiB  | 14      0 |  1   0    0    0    0 |
|                  |               0MiB / 16383MiB  |           |                       |
+------------------+--------------------------------+-----------+-----------------------+
|  0   10   0   2  |              12MiB /  9728MiB  | 14      0 |  1   0    0    0    0 |
|                  |               0MiB / 16383MiB  |           |                       |
+------------------+--------------------------------+-----------+-----------------------+

+---------------------------------------------------------------------------------------+
| Processes:                                                                            |
|  GPU   GI   CI        PID   Type   Process name                            GPU Memory |
|        ID   ID                                                             Usage      |
|=======================================================================================|
|  No running processes found                                                           |
+---------------------------------------------------------------------------------------+
`,
    'nvidia-container-cli list --libraries': `${driverLibraries('535.183.01').join('\n')}\n`,
    'nvidia-container-cli list --binaries': BINARIES,
  },
  files: {
    // R535 names the frontend device; no modeset module on this compute node.
    '/proc/devices': `Character devices:
  1 mem
  5 /dev/tty
136 pts
195 nvidia-frontend
226 drm
236 nvidia-caps
239 nvidia-uvm

Block devices:
  8 sd
`,
    '/proc/driver/nvidia/gpus/0000:07:00.0/information': `Model: \t\t NVIDIA A100-SXM4-80GB
GPU UUID: \t ${A100_UUID[0]}
Bus Location: \t 0000:07:00.0
Device Minor: \t 1
`,
    '/proc/driver/nvidia/gpus/0000:0f:00.0/information': `Model: \t\t NVIDIA A100-SXM4-80GB
GPU UUID: \t ${A100_UUID[1]}
Bus Location: \t 0000:0f:00.0
Device Minor: \t 0
`,
    '/proc/driver/nvidia-caps/mig-minors': migMinors(2),
  },
  devices: {
    '/dev/nvidiactl': [195, 255],
    '/dev/nvidia-uvm': [239, 0],
    '/dev/nvidia-uvm-tools': [239, 1],
    '/dev/nvidia0': [195, 0],
    '/dev/nvidia1': [195, 1],
    // GPU index 0 is minor 1: its instances' nodes are under gpu1.
    ...Object.fromEntries(
      [
        [2, 0],
        [9, 0],
        [10, 0],
      ].flatMap(([gi, ci]) => [
        [`/dev/nvidia-caps/nvidia-cap${fixtureCapMinor(1, gi!)}`, [236, fixtureCapMinor(1, gi!)]],
        [
          `/dev/nvidia-caps/nvidia-cap${fixtureCapMinor(1, gi!, ci)}`,
          [236, fixtureCapMinor(1, gi!, ci)],
        ],
      ]),
    ),
  },
  symlinks: driverSymlinks('535.183.01'),
};

/** A `GpuHostProbe` answering from a fixture, recording the commands it was asked to run. */
export function fixtureProbe(f: GpuHostFixture): GpuHostProbe & { ran: string[] } {
  const ran: string[] = [];
  return {
    ran,
    run(file, args) {
      const line = [file, ...args].join(' ');
      ran.push(line);
      const out = f.commands[line];
      return out === undefined
        ? Promise.reject(new Error(`${file}: command not found`))
        : Promise.resolve(out);
    },
    readFile(path) {
      const text = f.files[path];
      return text === undefined
        ? Promise.reject(new Error(`ENOENT: ${path}`))
        : Promise.resolve(text);
    },
    charDevice(path) {
      const d = f.devices[path];
      return Promise.resolve(d ? { major: d[0], minor: d[1] } : undefined);
    },
    symlinksIn(dir) {
      return Promise.resolve(
        Object.entries(f.symlinks)
          .filter(([p]) => p.slice(0, p.lastIndexOf('/')) === dir)
          .map(([p, resolved]) => ({ name: p.slice(p.lastIndexOf('/') + 1), resolved })),
      );
    },
  };
}

import type { SandboxSpec } from '@dsec/core';
import { seccompOci } from './seccomp.js';

/** Where dsec-init appears inside every sandbox (a read-only bind of the host binary). */
export const INIT_PATH_IN_SANDBOX = '/dev/.dsec-init';

/**
 * Capabilities of root inside a sandbox (Docker's default set). They act only
 * within the sandbox's user namespace; host-owned files stay out of reach.
 */
export const SANDBOX_CAPABILITIES = [
  'CAP_CHOWN',
  'CAP_DAC_OVERRIDE',
  'CAP_FSETID',
  'CAP_FOWNER',
  'CAP_MKNOD',
  'CAP_NET_RAW',
  'CAP_SETGID',
  'CAP_SETUID',
  'CAP_SETFCAP',
  'CAP_SETPCAP',
  'CAP_NET_BIND_SERVICE',
  'CAP_SYS_CHROOT',
  'CAP_KILL',
  'CAP_AUDIT_WRITE',
];

/** Paths hidden from the sandbox; /proc/kpage* is the file behind the paper's kernel crash. */
const MASKED_PATHS = [
  '/proc/acpi',
  '/proc/asound',
  '/proc/kcore',
  '/proc/keys',
  '/proc/latency_stats',
  '/proc/timer_list',
  '/proc/timer_stats',
  '/proc/sched_debug',
  '/proc/scsi',
  '/proc/kpagecgroup',
  '/proc/kpageflags',
  '/proc/kpagecount',
  '/proc/kallsyms',
  '/proc/sysrq-trigger',
  '/sys/firmware',
  '/sys/devices/virtual/powercap',
  '/sys/kernel/debug',
  '/sys/kernel/security',
];

const READONLY_PATHS = ['/proc/bus', '/proc/fs', '/proc/irq', '/proc/sys'];

export interface ContainerSpecInput {
  spec: SandboxSpec;
  hostname: string;
  rootfs: string;
  /** Host path of the static dsec-init binary. */
  initBinary: string;
  cgroupsPath: string;
  /** First host uid/gid of the sandbox's 65536-id range. */
  hostIdBase: number;
  idCount: number;
  /** The sandbox's prepared network: the resolv.conf naming the platform resolver. */
  network?: { resolvConf: string } | undefined;
  /** Volumes: each staged idmapped mount (host path) and where it appears in the sandbox. */
  volumes?: { source: string; destination: string }[] | undefined;
}

/** Builds the OCI runtime config (config.json) for one sandbox. */
export function buildContainerConfig(input: ContainerSpecInput): Record<string, unknown> {
  const { spec } = input;
  const caps = SANDBOX_CAPABILITIES;
  const cpuPeriod = 100_000;
  return {
    ociVersion: '1.0.2',
    process: {
      terminal: false,
      user: { uid: 0, gid: 0 },
      args: [INIT_PATH_IN_SANDBOX],
      env: ['PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'],
      cwd: '/',
      capabilities: { bounding: caps, effective: caps, permitted: caps },
      noNewPrivileges: true,
      oomScoreAdj: 500,
    },
    root: { path: input.rootfs, readonly: false },
    hostname: input.hostname,
    mounts: [
      {
        destination: '/proc',
        type: 'proc',
        source: 'proc',
        options: ['nosuid', 'noexec', 'nodev'],
      },
      {
        destination: '/dev',
        type: 'tmpfs',
        source: 'tmpfs',
        options: ['nosuid', 'strictatime', 'mode=755', 'size=65536k'],
      },
      {
        destination: '/dev/pts',
        type: 'devpts',
        source: 'devpts',
        options: ['nosuid', 'noexec', 'newinstance', 'ptmxmode=0666', 'mode=0620'],
      },
      {
        destination: '/dev/shm',
        type: 'tmpfs',
        source: 'shm',
        options: ['nosuid', 'noexec', 'nodev', 'mode=1777', 'size=65536k'],
      },
      {
        destination: '/dev/mqueue',
        type: 'mqueue',
        source: 'mqueue',
        options: ['nosuid', 'noexec', 'nodev'],
      },
      {
        destination: '/sys',
        type: 'sysfs',
        source: 'sysfs',
        options: ['nosuid', 'noexec', 'nodev', 'ro'],
      },
      {
        destination: '/sys/fs/cgroup',
        type: 'cgroup',
        source: 'cgroup',
        options: ['nosuid', 'noexec', 'nodev', 'relatime', 'ro'],
      },
      {
        destination: INIT_PATH_IN_SANDBOX,
        type: 'bind',
        source: input.initBinary,
        options: ['bind', 'ro', 'nosuid', 'nodev'],
      },
      ...(input.network
        ? [
            {
              destination: '/etc/resolv.conf',
              type: 'bind',
              source: input.network.resolvConf,
              options: ['bind', 'ro', 'nosuid', 'nodev', 'noexec'],
            },
          ]
        : []),
      // Last: the runtime resolves each destination inside the sandbox's root
      // (a symlink the image planted there stays inside it), and the
      // platform's own mounts above cannot be covered (paths are checked too).
      ...(input.volumes ?? []).map((v) => ({
        destination: v.destination,
        type: 'bind',
        source: v.source,
        options: ['bind', 'nosuid', 'nodev'],
      })),
    ],
    linux: {
      uidMappings: [{ containerID: 0, hostID: input.hostIdBase, size: input.idCount }],
      gidMappings: [{ containerID: 0, hostID: input.hostIdBase, size: input.idCount }],
      namespaces: ['pid', 'network', 'ipc', 'uts', 'mount', 'user', 'cgroup'].map((type) => ({
        type,
      })),
      cgroupsPath: input.cgroupsPath,
      resources: {
        devices: [{ allow: false, access: 'rwm' }],
        memory: { limit: spec.memoryLimitMb * 1024 * 1024, swap: spec.memoryLimitMb * 1024 * 1024 },
        cpu: {
          quota: Math.max(1000, Math.round(spec.cpuCoresLimit * cpuPeriod)),
          period: cpuPeriod,
          // Best-effort: the minimal weight (v1 shares 2; runtimes map it to v2 weight 1).
          // The backend then marks the cgroup idle and the processes SCHED_IDLE (qos.ts).
          ...(spec.qosClass === 'best-effort' ? { shares: 2 } : {}),
        },
        pids: { limit: spec.pidsLimit },
      },
      maskedPaths: MASKED_PATHS,
      readonlyPaths: READONLY_PATHS,
      seccomp: seccompOci(),
    },
  };
}

import type { Command } from 'commander';
import type { AdmissionConfig } from '@dsec/edge';
import { parseInteger, parseNumber } from '../parse.js';

/** `dsec up`'s (and `dsec bench density`'s) admission flags (docs/adr/0007-admission-by-real-use.md). */
export interface AdmissionFlags {
  maxSandboxes?: number;
  memoryOvercommit?: number;
  cpuOvercommit?: number;
  minFreeMemoryMb?: number;
  maxSandboxMemoryMb?: number;
  maxCpuPressure?: number;
  maxThreadsPercent?: number;
  minFreeDiskMb?: number;
}

/** Adds the admission flags to a command; defaults are the edge's (`ADMISSION_DEFAULTS`). */
export function addAdmissionOptions(command: Command): Command {
  return command
    .option('--max-sandboxes <n>', 'hard cap on live sandboxes (default 4096)', parseInteger)
    .option(
      '--memory-overcommit <ratio>',
      'requested memory of all sandboxes ≤ ratio × physical memory (default 32)',
      parseNumber,
    )
    .option(
      '--cpu-overcommit <ratio>',
      'requested CPUs of all sandboxes ≤ ratio × cores (default 1024)',
      parseNumber,
    )
    .option(
      '--min-free-memory-mb <n>',
      'refuse creates that would leave less MemAvailable (default 10 % of memory, 512–4096)',
      parseInteger,
    )
    .option(
      '--max-sandbox-memory-mb <n>',
      "refuse creates once the sandboxes' cgroups are charged this much (default 95 % of memory)",
      parseInteger,
    )
    .option(
      '--max-cpu-pressure <percent>',
      'refuse creates while CPU pressure (PSI some avg60) is this high on busy CPUs (default 90)',
      parseNumber,
    )
    .option(
      '--max-threads-percent <percent>',
      "refuse creates past this share of the kernel's thread/pid limit (default 80)",
      parseNumber,
    )
    .option(
      '--min-free-disk-mb <n>',
      "refuse creates that would leave less free disk on the state dir's filesystem (default min(1024, 5 %))",
      parseInteger,
    );
}

export function admissionConfig(flags: AdmissionFlags): AdmissionConfig {
  return {
    maxSandboxes: flags.maxSandboxes,
    memoryOvercommit: flags.memoryOvercommit,
    cpuOvercommit: flags.cpuOvercommit,
    minFreeMemoryMb: flags.minFreeMemoryMb,
    maxSandboxMemoryMb: flags.maxSandboxMemoryMb,
    maxCpuPressurePercent: flags.maxCpuPressure,
    maxThreadsPercent: flags.maxThreadsPercent,
    minFreeDiskMb: flags.minFreeDiskMb,
  };
}

import { constants } from 'node:fs';
import { lstat, open, readdir } from 'node:fs/promises';
import { join, posix, relative } from 'node:path';
import { DsecError, isDsecError } from '@dsec/core';
import type { Sandbox } from '@dsec/sdk';
import { killLeftovers } from '../in-place.js';
import type { SandboxTools } from '../tools.js';

/** Where Harbor's verifier writes its reward, and where the task's tests are put. */
export const VERIFIER_LOG_DIR = '/logs/verifier';
export const TESTS_DIR = '/tests';
/** reward.txt holds one number; more than this is not a reward. */
export const MAX_REWARD_TXT_BYTES = 4096;
/** reward.json: a flat object of metrics. */
export const MAX_REWARD_JSON_BYTES = 64 * 1024;
/** tests/ (or solution/) uploaded into a sandbox: bounded, so a task folder cannot flood it. */
export const MAX_UPLOAD_BYTES = 256 * 1024 * 1024;
export const MAX_UPLOAD_FILES = 10_000;

const VERIFIER_OUTPUT_CAP_BYTES = 8 * 1024 * 1024;
const OUTPUT_TAIL_CHARS = 2000;
/** File operations act as root by uid (the agent may have rewritten /etc/passwd). */
const ROOT = 'root';

/** Why a verifier run gave no usable reward (`details.reason` of a 0). */
export type RewardReason =
  | 'reward_missing'
  | 'reward_not_regular'
  | 'reward_too_large'
  | 'reward_garbled'
  | 'verifier_timeout';

export interface VerifierResult {
  /** The reward the verifier wrote; 0 when it wrote none that parses (`reason` says why). */
  reward: number;
  /** reward.json's metrics, when that is where the reward came from. */
  metrics?: Record<string, number> | undefined;
  /** `reward.txt` or `reward.json`: which file held the reward. */
  source?: 'reward.txt' | 'reward.json' | undefined;
  reason?: RewardReason | undefined;
  exitCode: number;
  /** `exited`, or `timeout` when test.sh ran past the verifier limit. */
  outcome: string;
  outputTail: string;
  /** Processes of the agent killed before the verifier ran. */
  killedProcesses: number;
}

interface HostFile {
  rel: string;
  abs: string;
  mode: number;
  size: number;
  /** The inode `lstat` saw: the file uploaded must be that one. */
  dev: number;
  ino: number;
  /** `tests` or `solution`: the field an error names. */
  field: string;
}

/**
 * Lists a host directory of the task's (tests/ or solution/): regular files
 * and directories only (a symlink in a task folder could name any host
 * file), within MAX_UPLOAD_FILES and MAX_UPLOAD_BYTES.
 */
export async function listUpload(root: string, field: string): Promise<HostFile[]> {
  const files: HostFile[] = [];
  let bytes = 0;
  const walk = async (dir: string): Promise<void> => {
    for (const name of (await readdir(dir)).sort()) {
      const abs = join(dir, name);
      const st = await lstat(abs);
      const rel = relative(root, abs);
      if (st.isDirectory()) {
        await walk(abs);
      } else if (st.isFile()) {
        bytes += st.size;
        files.push({
          rel,
          abs,
          mode: st.mode & 0o777,
          size: st.size,
          dev: st.dev,
          ino: st.ino,
          field,
        });
      } else {
        throw new DsecError(
          'invalid_argument',
          `${abs}: only regular files and directories are uploaded (a symlink or device is not)`,
          { field },
        );
      }
      if (files.length > MAX_UPLOAD_FILES || bytes > MAX_UPLOAD_BYTES) {
        throw new DsecError(
          'invalid_argument',
          `${root} holds more than ${MAX_UPLOAD_FILES} files or ${MAX_UPLOAD_BYTES} bytes`,
          { field },
        );
      }
    }
  };
  await walk(root);
  return files;
}

/**
 * Replaces `remoteDir` in the sandbox with the host directory's files,
 * through the files API (resolved in the sandbox's root by the platform,
 * no binary of the sandbox's involved): whatever was at `remoteDir` (a
 * tree the agent planted, a symlink) is removed first.
 */
export async function uploadDir(
  sandbox: Sandbox,
  files: HostFile[],
  remoteDir: string,
  signal?: AbortSignal,
): Promise<void> {
  await removePath(sandbox, remoteDir, signal);
  await sandbox.files.mkdir(remoteDir, { parents: true, mode: 0o755, user: ROOT, signal });
  const made = new Set<string>([remoteDir]);
  for (const f of files) {
    const dest = posix.join(remoteDir, f.rel.split('\\').join('/'));
    const parent = posix.dirname(dest);
    if (!made.has(parent)) {
      await sandbox.files.mkdir(parent, { parents: true, mode: 0o755, user: ROOT, signal });
      made.add(parent);
    }
    await sandbox.files.write(dest, await readListed(f), { mode: f.mode, user: ROOT, signal });
  }
}

/**
 * Reads a file `listUpload` listed, as listed: opened without following a
 * symlink at its last component and checked to be the same inode and size,
 * so a task folder changed between the listing and the upload (a file
 * swapped for `-> /etc/shadow`, or grown past the bounds) uploads nothing.
 */
async function readListed(f: HostFile): Promise<Buffer> {
  const fh = await open(
    f.abs,
    constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK,
  ).catch((err: NodeJS.ErrnoException) => {
    throw changed(f, err.code ?? 'open failed');
  });
  try {
    const st = await fh.stat();
    if (!st.isFile() || st.dev !== f.dev || st.ino !== f.ino || st.size !== f.size) {
      throw changed(f, 'not the file listed');
    }
    const buf = Buffer.alloc(f.size);
    let got = 0;
    while (got < f.size) {
      const { bytesRead } = await fh.read(buf, got, f.size - got, got);
      if (bytesRead === 0) break;
      got += bytesRead;
    }
    return buf.subarray(0, got);
  } finally {
    await fh.close();
  }
}

function changed(f: HostFile, why: string): DsecError {
  return new DsecError(
    'invalid_argument',
    `${f.abs} changed while the task folder was uploaded (${why}); run again on a folder nothing writes to`,
    { field: f.field, details: { reason: 'changed_during_upload' } },
  );
}

/** Removes a path (a file, a symlink itself, or a whole tree); a missing one is fine. */
async function removePath(sandbox: Sandbox, path: string, signal?: AbortSignal): Promise<void> {
  try {
    await sandbox.files.remove(path, { recursive: true, user: ROOT, signal });
  } catch (err) {
    if (isDsecError(err) && err.code === 'not_found') return;
    throw err;
  }
}

/**
 * A fresh, empty `/logs/verifier`: whatever the agent left there (a
 * pre-written reward, a symlink, a FIFO) and a `/logs` that is not a plain
 * directory are removed first.
 */
export async function resetVerifierLogs(sandbox: Sandbox, signal?: AbortSignal): Promise<void> {
  const logs = posix.dirname(VERIFIER_LOG_DIR);
  const st = await sandbox.files.stat(logs, { user: ROOT, signal }).catch((err: unknown) => {
    if (isDsecError(err) && err.code === 'not_found') return undefined;
    throw err;
  });
  if (st && st.type !== 'directory') await removePath(sandbox, logs, signal);
  await removePath(sandbox, VERIFIER_LOG_DIR, signal);
  await sandbox.files.mkdir(VERIFIER_LOG_DIR, { parents: true, mode: 0o777, user: ROOT, signal });
}

/** Parses reward.txt: one finite number, surrounding whitespace allowed. */
export function parseRewardText(text: string): number | undefined {
  const t = text.trim();
  if (!/^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$/.test(t)) return undefined;
  const n = Number(t);
  return Number.isFinite(n) ? n : undefined;
}

/**
 * Parses reward.json: a flat object of finite numbers (booleans count as
 * 0/1, as Python's do). The reward is its `reward` key, or its only key.
 */
export function parseRewardJson(
  text: string,
): { reward: number; metrics: Record<string, number> } | undefined {
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) return undefined;
  const metrics: Record<string, number> = {};
  for (const [k, v] of Object.entries(raw as Record<string, unknown>)) {
    if (typeof v === 'boolean') metrics[k] = v ? 1 : 0;
    else if (typeof v === 'number' && Number.isFinite(v)) metrics[k] = v;
    else return undefined;
  }
  const keys = Object.keys(metrics);
  const reward =
    'reward' in metrics ? metrics['reward'] : keys.length === 1 ? metrics[keys[0]!] : undefined;
  return reward === undefined ? undefined : { reward, metrics };
}

type Read = { text: string } | { reason: RewardReason };

/** A reward file, read by the platform (no symlink followed at the last component, size bounded). */
async function readRewardFile(
  sandbox: Sandbox,
  path: string,
  maxBytes: number,
  signal?: AbortSignal,
): Promise<Read | undefined> {
  let st;
  try {
    st = await sandbox.files.stat(path, { user: ROOT, signal });
  } catch (err) {
    if (isDsecError(err) && err.code === 'not_found') return undefined;
    throw err;
  }
  if (st.type !== 'file') return { reason: 'reward_not_regular' };
  if (st.size > maxBytes) return { reason: 'reward_too_large' };
  const bytes = await sandbox.files.read(path, { format: 'bytes', user: ROOT, signal });
  // The file may have grown between the stat and the read (nothing should be running by now).
  if (bytes.length > maxBytes) return { reason: 'reward_too_large' };
  return { text: bytes.toString('utf8') };
}

/** The reward the verifier left in /logs/verifier: reward.txt, else reward.json; else 0 with a reason. */
export async function readReward(
  sandbox: Sandbox,
  signal?: AbortSignal,
): Promise<Pick<VerifierResult, 'reward' | 'metrics' | 'source' | 'reason'>> {
  const txt = await readRewardFile(
    sandbox,
    `${VERIFIER_LOG_DIR}/reward.txt`,
    MAX_REWARD_TXT_BYTES,
    signal,
  );
  if (txt) {
    if ('reason' in txt) return { reward: 0, reason: txt.reason, source: 'reward.txt' };
    const n = parseRewardText(txt.text);
    return n === undefined
      ? { reward: 0, reason: 'reward_garbled', source: 'reward.txt' }
      : { reward: n, source: 'reward.txt' };
  }
  const json = await readRewardFile(
    sandbox,
    `${VERIFIER_LOG_DIR}/reward.json`,
    MAX_REWARD_JSON_BYTES,
    signal,
  );
  if (!json) return { reward: 0, reason: 'reward_missing' };
  if ('reason' in json) return { reward: 0, reason: json.reason, source: 'reward.json' };
  const parsed = parseRewardJson(json.text);
  return parsed === undefined
    ? { reward: 0, reason: 'reward_garbled', source: 'reward.json' }
    : { reward: parsed.reward, metrics: parsed.metrics, source: 'reward.json' };
}

export interface RunVerifierOptions {
  /** tests/ on the host (the task's). */
  testsDir: string;
  timeoutMs: number;
  /** task.toml's `[verifier] env`. */
  env?: Record<string, string> | undefined;
  signal?: AbortSignal | undefined;
}

/**
 * Harbor's verification, in the agent's sandbox, hardened against the
 * agent: every process it left is killed (`killLeftovers`: nothing can
 * rewrite the reward afterwards), `/logs/verifier` is emptied and `/tests`
 * replaced with the task's own tests through the files API, then `bash
 * /tests/test.sh` runs under the verifier limit; the processes the
 * verifier left are killed too, and the reward is read by the platform
 * (`readReward`). A missing or garbled reward is 0 with a `reason`, never a
 * crash; a platform failure throws.
 */
export async function runVerifier(
  tools: SandboxTools,
  options: RunVerifierOptions,
): Promise<VerifierResult> {
  const sandbox = tools.sandbox;
  const files = await listUpload(options.testsDir, 'tests');
  const killedProcesses = await killLeftovers(tools);
  await resetVerifierLogs(sandbox, options.signal);
  await uploadDir(sandbox, files, TESTS_DIR, options.signal);
  const r = await tools.exec('exec bash /tests/test.sh', {
    timeoutMs: options.timeoutMs,
    maxOutputBytes: VERIFIER_OUTPUT_CAP_BYTES,
    env: options.env,
  });
  // A process test.sh left in the background must not change the reward while it is read.
  await killLeftovers(tools);
  const output = `${r.stdout}\n${r.stderr}`.trimEnd().slice(-OUTPUT_TAIL_CHARS);
  if (r.outcome === 'timeout') {
    return {
      reward: 0,
      reason: 'verifier_timeout',
      exitCode: r.exitCode,
      outcome: r.outcome,
      outputTail: output,
      killedProcesses,
    };
  }
  const reward = await readReward(sandbox, options.signal);
  return {
    ...reward,
    exitCode: r.exitCode,
    outcome: r.outcome,
    outputTail: output,
    killedProcesses,
  };
}

/**
 * The dashboard's only way to the server: the public HTTP API v1
 * (docs/openapi.json) with the signed-in key as a bearer token.
 */
import { KEY_STORAGE } from './key.js';

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

export function storedKey(): string | null {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function signOut(): void {
  sessionStorage.removeItem(KEY_STORAGE);
  location.hash = '#/';
  location.reload();
}

/** Calls the API; answers parsed JSON (or undefined for 204), throws `ApiError`. */
export async function api<T>(
  path: string,
  init: { method?: string; body?: unknown; raw?: boolean; signal?: AbortSignal } = {},
): Promise<T> {
  const headers: Record<string, string> = { authorization: `Bearer ${storedKey() ?? ''}` };
  if (init.body !== undefined) headers['content-type'] = 'application/json';
  const res = await fetch(path, {
    method: init.method ?? 'GET',
    headers,
    body: init.body === undefined ? null : JSON.stringify(init.body),
    signal: init.signal ?? null,
  });
  if (!res.ok) {
    const body = (await res.json().catch(() => ({}))) as {
      error?: { code?: string; message?: string };
    };
    throw new ApiError(
      res.status,
      body.error?.code ?? 'unknown',
      body.error?.message ?? `${res.status} ${res.statusText}`,
    );
  }
  if (res.status === 204) return undefined as T;
  return (init.raw ? await res.arrayBuffer() : await res.json()) as T;
}

export const enc = encodeURIComponent;

// Wire types: the parts of docs/openapi.json's schemas the pages read.
export type SandboxState = 'creating' | 'running' | 'paused' | 'stopping' | 'stopped' | 'failed';
export interface SandboxInfo {
  id: string;
  edgeId: string;
  projectId: string;
  state: SandboxState;
  spec: {
    backend: string;
    image: string;
    workspace?: string;
    toolkits: string[];
    memoryLimitMb: number;
    cpuCoresLimit: number;
    ttlSeconds: number;
    labels: Record<string, string>;
  } & Record<string, unknown>;
  createdAt: string;
  expiresAt: string;
  reason?: string;
  memoryBytes?: number;
}
export interface Project {
  id: string;
  name: string;
  parentId: string | null;
  quota: { sandboxes?: number; memoryMb?: number; cpuCores?: number };
  createdAt: string;
}
export interface Resources {
  memoryMb: number;
  cpuCores: number;
  sandboxes: number;
}
export interface EdgeStatus {
  edgeId: string;
  url: string;
  healthy: boolean;
  backends: string[];
  capacity: Resources;
  used: Resources;
  sandboxesByProject: Record<string, number>;
  labels: Record<string, string>;
  pressure?: {
    memoryTotalMb: number;
    memoryAvailableMb: number;
    cpuPressurePercent: number;
    sandboxCpuPercent: number;
    threads: number;
    threadsLimit: number;
    diskFreeMb: number;
    refusing?: { resource: string; measure: string; current: number; limit: number };
  };
  /** `dsec edge cordon`: placement sends it nothing new. */
  cordoned?: boolean;
}
export interface LayerInfo {
  name: string;
  version: string;
  kind: string;
  digest: string;
  sizeBytes: number;
  contentBytes?: number;
  fileCount?: number;
  createdAt?: string;
  source?: string;
  parents?: string[];
  parentDigests?: string[];
}
export interface CommandInfo {
  commandId: string;
  argv?: string[];
  line?: string;
  session?: string;
  background: boolean;
  state: 'running' | 'finished';
  startedAt: string;
  finishedAt?: string;
  result?: {
    exitCode: number;
    outcome: string;
    stdout: string;
    stderr: string;
    durationMs: number;
  };
}
export interface SandboxEvent {
  id: number;
  time: string;
  kind: string;
  message: string;
  count: number;
}
export interface FileInfo {
  name: string;
  path: string;
  type: string;
  size: number;
  mode: number;
  mtime: string;
  target?: string;
}
export interface Whoami {
  keyId: string;
  projectId: string;
  role: string;
}

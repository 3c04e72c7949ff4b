import { execFileSync, spawnSync } from 'node:child_process';
import { chmod, mkdir, mkdtemp } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';

/** A fresh 0711 work directory (sandboxes' mapped roots must traverse it). */
export async function workDir(prefix: string): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), prefix));
  await chmod(dir, 0o711);
  return dir;
}

export function hasGcc(): boolean {
  return spawnSync('gcc', ['--version']).status === 0;
}

/**
 * Builds the `busybox` base layer and the `probe` toolkit: a static C test
 * program (fixtures/probe.c) at /usr/local/bin/probe. The probe refuses to run
 * outside a user-namespaced sandbox; never run it on the host.
 */
export async function buildTestLayers(node: SingleNode, work: string): Promise<void> {
  const rootfs = join(work, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  const toolkit = join(work, 'probe-toolkit');
  await mkdir(join(toolkit, 'usr/local/bin'), { recursive: true });
  const src = fileURLToPath(new URL('./fixtures/probe.c', import.meta.url));
  execFileSync('gcc', ['-static', '-O1', '-w', '-o', join(toolkit, 'usr/local/bin/probe'), src]);
  await node.buildLayer({ name: 'probe', kind: 'toolkit', from: { dir: toolkit } });
}

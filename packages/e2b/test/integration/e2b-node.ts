import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { startSingleNode } from '@dsec/cluster';
import type { E2bOptions, SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';

/**
 * A real single node (edge, IAM, image store with the busybox base image)
 * serving the native and the E2B-compatible API on one port, as `dsec up`
 * does; closed with its sandboxes afterwards.
 */
export interface E2bNode {
  node: SingleNode;
  url: string;
  adminKey: string;
}

export async function withE2bNode(
  fn: (n: E2bNode) => Promise<void>,
  options: E2bOptions = {},
): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-it-'));
  await chmod(dir, 0o711);
  const cgroupParent = `dsec-test-${basename(dir)}`;
  const node = await startSingleNode({
    stateDir: join(dir, 'state'),
    port: 0,
    cgroupParent,
    e2b: { watchIntervalMs: 100, ...options },
  });
  try {
    await makeBusyboxRootfs(join(dir, 'rootfs'));
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
    await fn({ node, url: node.url, adminKey: node.adminKey });
  } finally {
    await node.close({ stopSandboxes: true });
    await rm(dir, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup')) {
      await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    }
  }
}

/** Points the unmodified E2B SDK at `url` with `key`, as a user would (environment variables). */
export function useE2b(url: string, key: string): void {
  process.env.E2B_API_URL = url;
  process.env.E2B_SANDBOX_URL = url;
  process.env.E2B_API_KEY = key;
  delete process.env.E2B_DOMAIN;
  delete process.env.E2B_DEBUG;
  delete process.env.E2B_ACCESS_TOKEN;
}

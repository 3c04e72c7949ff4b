import { randomUUID } from 'node:crypto';
import { DsecError, isDsecError, throwIfAborted, type LayerInfo } from '@dsec/core';
import { installCommandFailed, type InstallRequest, type InstallRunner } from '@dsec/images';
import type { DSecClient, Sandbox } from '@dsec/sdk';

/** How long the builder's snapshot may take: the edge's own packing limit (10 min) and a margin. */
const SNAPSHOT_TIMEOUT_MS = 660_000;

/** Limits of a builder sandbox: what an install step may use, no more. */
export interface InstallSandboxLimits {
  /** Default 2048. */
  memoryLimitMb?: number | undefined;
  /** Default 2. */
  cpuCoresLimit?: number | undefined;
  /** Default 1024: a fork bomb stops there. */
  pidsLimit?: number | undefined;
  /** Writable-layer quota (default 8192): a command that fills the disk fails, the node does not. */
  diskLimitMb?: number | undefined;
}

/**
 * An {@link InstallRunner} that builds through the cluster, as `dsec eval
 * prepare` and `run` do: a builder sandbox on the recipe's base and toolkits
 * with egress to the recipe's domains only (ports 80, 443; everything else
 * is the platform's default-deny), each command run with the sandbox's shell
 * in order, then a snapshot of its writable layer. The sandbox is stopped on
 * every path: success, a failed command, an error or an abort.
 */
export function clusterInstallRunner(
  client: DSecClient,
  limits: InstallSandboxLimits = {},
): InstallRunner {
  /**
   * Deletes the caller's project's own image `ref`; one it does not hold, or
   * a key that may not delete (the snapshot then says `conflict` as before),
   * is no error.
   */
  const dropImage = async (ref: string, signal?: AbortSignal): Promise<void> => {
    await client.deleteImage(ref, signal ? { signal } : {}).catch((err: unknown) => {
      if (!isDsecError(err, 'image_not_found') && !isDsecError(err, 'permission_denied')) throw err;
    });
  };
  return async (req: InstallRequest): Promise<LayerInfo> => {
    const { signal } = req;
    const timeoutSeconds = Math.ceil(req.timeoutMs / 1000);
    // An idempotency key of our own: a create whose answer is lost can be asked again.
    const spec: Parameters<DSecClient['runContainer']>[0] = {
      requestId: `install-${randomUUID()}`,
      image: req.image,
      toolkits: req.toolkits,
      ...(req.workspace !== undefined ? { workspace: req.workspace } : {}),
      memoryLimitMb: limits.memoryLimitMb ?? 2048,
      cpuCoresLimit: limits.cpuCoresLimit ?? 2,
      pidsLimit: limits.pidsLimit ?? 1024,
      diskLimitMb: limits.diskLimitMb ?? 8192,
      // The whole build, with room for the snapshot: the TTL is the last word.
      ttlSeconds: Math.min(604_800, timeoutSeconds * req.commands.length + 900),
      ...(req.allowDomains.length > 0
        ? { networkAllow: req.allowDomains.map((domain) => ({ domain, ports: [80, 443] })) }
        : {}),
      labels: { 'dsec.install': req.recipe.slice(0, 63) },
    };
    // Not even sent when already aborted (the clean-up below would make one only to stop it).
    throwIfAborted(signal);
    let sb: Sandbox;
    try {
      sb = await client.runContainer(spec, signal ? { signal } : {});
    } catch (err) {
      // Aborted or past its deadline while the cluster was making it: the builder may exist
      // with nobody holding it, its cores, memory and disk kept for its whole TTL. The same key
      // returns that sandbox (outside the caller's signal), and it is stopped.
      if (isDsecError(err, 'aborted') || isDsecError(err, 'deadline_exceeded')) {
        await client
          .runContainer(spec)
          .then((orphan) => orphan.stop())
          .catch(() => undefined);
      }
      throw err;
    }
    let snapshotting = false;
    let snapshotted = false;
    try {
      // As a Dockerfile's WORKDIR: made when missing (part of the layer, like any other write).
      if (req.workdir !== '/') {
        const mk = await sb.runShell(`mkdir -p -- '${req.workdir.replaceAll("'", "'\\''")}'`, {
          ...(signal ? { signal } : {}),
        });
        if (mk.exitCode !== 0) {
          throw new DsecError(
            'invalid_argument',
            `${req.recipe}.workdir: cannot make ${req.workdir}: ${mk.stderr.slice(-500)}`,
            {
              field: `${req.recipe}.workdir`,
            },
          );
        }
      }
      for (const [i, command] of req.commands.entries()) {
        const r = await sb.runShell(command, {
          timeoutMs: req.timeoutMs,
          cwd: req.workdir,
          env: req.env,
          ...(signal ? { signal } : {}),
        });
        if (r.exitCode !== 0 || r.outcome !== 'exited')
          throw installCommandFailed(req.recipe, i, command, r);
      }
      // The name is this recipe digest's builder's, the same on every run: one an interrupted
      // build left (the command killed before the promotion) would refuse this snapshot with
      // `conflict` on every later run, so it goes first.
      await dropImage(req.snapshotName, signal);
      snapshotting = true;
      const snap = await sb.snapshot({
        name: req.snapshotName,
        // The edge packs for up to 10 minutes; the SDK's 120 s would fail a large build's layer.
        timeoutMs: SNAPSHOT_TIMEOUT_MS,
        ...(req.scrub.length > 0 ? { scrub: req.scrub } : {}),
        ...(signal ? { signal } : {}),
      });
      if (snap.layer === undefined) {
        throw new DsecError('internal', `the snapshot of ${req.recipe}'s builder has no layer`);
      }
      snapshotted = true;
      return snap.layer;
    } finally {
      // Not under the caller's signal: an aborted build still removes its sandbox.
      await sb.stop().catch(() => undefined);
      // A snapshot whose answer was lost (aborted, past its deadline) may have been made all
      // the same; the stop above ends one still under way, so what is there now is final.
      if (snapshotting && !snapshotted) await dropImage(req.snapshotName).catch(() => undefined);
    }
  };
}

import {
  checkVolumeMounts,
  checkVolumeName,
  checkVolumeSize,
  DsecError,
  throwIfAborted,
  toDsecError,
  type EdgeApi,
  type EdgeVolumeApi,
  type EdgeVolumeInfo,
  type SandboxSpec,
  type VolumeInfo,
} from '@dsec/core';
import {
  mayUseVolumes,
  VOLUMES_SCOPE,
  type Iam,
  type Principal,
  type VolumeRecord,
} from '@dsec/iam';
import type { EdgeDirectory, FleetSource } from './sandbox-service.js';

export interface VolumeServiceDeps {
  iam: Iam;
  edges: EdgeDirectory;
  watcher: FleetSource;
  /** Called when a best-effort clean-up fails. */
  onWarning?: ((message: string, context: Record<string, unknown>) => void) | undefined;
  /** Picks among candidate edges (default: uniformly at random). */
  random?: (() => number) | undefined;
}

/**
 * Volumes of the HTTP API (docs/volumes.md): every route calls one method
 * here. The control plane's record (IAM: name, size, edge, quota) is made
 * first, in the transaction that charges the project's `volumeBytes` quota
 * and every ancestor's, so two creates can never both take the last room;
 * then the edge makes the bytes. A failed edge create drops the record.
 * Delete goes the other way: the edge first (it refuses `volume_in_use`
 * while a sandbox mounts the volume), then the record and its quota.
 *
 * Names are per project: every lookup is by (project, name), and a
 * project the key cannot reach is `not_found`, its volumes never listed.
 * A volume lives on one edge; `pinnedEdge` sends sandboxes that mount it
 * there.
 */
export class VolumeService {
  readonly #d: VolumeServiceDeps;

  constructor(deps: VolumeServiceDeps) {
    this.#d = deps;
  }

  async create(
    principal: Principal,
    input: { name: string; sizeMb: number; projectId?: string | undefined },
    signal?: AbortSignal,
  ): Promise<VolumeInfo> {
    checkVolumeName(input.name);
    checkVolumeSize(input.sizeMb);
    const projectId = await this.#project(principal, input.projectId);
    const edge = this.#pickEdge();
    const record = await this.#d.iam.createVolume(
      { projectId, name: input.name, sizeBytes: input.sizeMb * 2 ** 20, edgeId: edge.edgeId },
      { actorKeyId: principal.keyId },
    );
    let made: EdgeVolumeInfo;
    try {
      // Inside the try: a caller gone already drops the record it just made.
      throwIfAborted(signal);
      // Not the caller's signal: a create cut half-way would leave the edge making a volume
      // whose record is dropped (bytes outside the quota). It runs to its end either way
      // (mkfs has a time limit), so the apiserver always hears how it ended.
      made = await volumesOf(edge).create({ projectId, name: input.name, sizeMb: input.sizeMb });
    } catch (err) {
      // The edge's create cleans up after itself, but an answer lost on the way (or a volume
      // of that name the record does not know, `conflict`) may leave bytes there: they go
      // first (best effort: nothing mounts a volume without a record), then the record.
      await edge.volumes.delete(projectId, input.name).catch((e: unknown) => {
        if (toDsecError(e).code !== 'volume_not_found')
          this.#d.onWarning?.('volume clean-up on its edge failed', {
            edgeId: edge.edgeId,
            projectId,
            name: input.name,
            err: String(e),
          });
      });
      await this.#d.iam.deleteVolume(projectId, input.name).catch((e: unknown) =>
        this.#d.onWarning?.('volume record clean-up failed', {
          projectId,
          name: input.name,
          err: String(e),
        }),
      );
      throw toDsecError(err);
    }
    if (!(await this.#d.iam.markVolumeReady(projectId, input.name, record))) {
      // A DELETE ran while the edge made it (the edge did not have it yet, so the
      // record went): the volume must go too, or it would outlive its quota.
      await volumesOf(edge)
        .delete(projectId, input.name)
        .catch((e: unknown) =>
          this.#d.onWarning?.('volume deleted while being created: edge clean-up failed', {
            edgeId: edge.edgeId,
            projectId,
            name: input.name,
            err: String(e),
          }),
        );
      throw new DsecError(
        'volume_not_found',
        `volume ${input.name} was deleted while being created`,
        {
          field: 'name',
        },
      );
    }
    return { ...toInfo(record), state: 'ready', usedBytes: made.usedBytes, mountedBy: [] };
  }

  async list(principal: Principal, projectId: string | undefined): Promise<VolumeInfo[]> {
    const project = await this.#project(principal, projectId);
    return (await this.#d.iam.listVolumes(project)).map(toInfo);
  }

  /** The record, with its edge's live use (`usedBytes`, `mountedBy`) when the edge answers. */
  async get(
    principal: Principal,
    name: string,
    projectId: string | undefined,
    signal?: AbortSignal,
  ): Promise<VolumeInfo> {
    const record = await this.#record(principal, name, projectId);
    const edge = this.#edgeOf(record.edgeId);
    if (record.state !== 'ready' || !edge?.volumes) return toInfo(record);
    try {
      const live = await edge.volumes.get(record.projectId, name, signal);
      return { ...toInfo(record), usedBytes: live.usedBytes, mountedBy: live.mountedBy };
    } catch (err) {
      this.#d.onWarning?.('volume edge lookup failed', {
        edgeId: record.edgeId,
        err: String(err),
      });
      return toInfo(record);
    }
  }

  /**
   * Deletes the volume and its bytes. `volume_in_use` (details `sandboxes`)
   * while a sandbox mounts it; `unavailable` while its edge cannot be reached
   * (the record stays, so the bytes are not forgotten on a node that comes back).
   */
  async delete(
    principal: Principal,
    name: string,
    projectId: string | undefined,
    signal?: AbortSignal,
  ): Promise<void> {
    const record = await this.#record(principal, name, projectId);
    const edge = this.#edgeOf(record.edgeId);
    if (!edge?.volumes)
      throw new DsecError(
        'unavailable',
        `edge ${record.edgeId} of volume ${name} is not reachable`,
      );
    try {
      await edge.volumes.delete(record.projectId, name, signal);
    } catch (err) {
      // A record whose edge never made it (an interrupted create) is removed all the same.
      if (toDsecError(err).code !== 'volume_not_found') throw err;
    }
    await this.#d.iam.deleteVolume(record.projectId, name, { actorKeyId: principal.keyId });
  }

  /**
   * The edge a sandbox that mounts `spec.volumes` must run on, or undefined
   * without volumes. `volume_not_found` (field `volumes.N.name`) for a name the
   * project has no ready volume of; `invalid_argument` when they live on
   * different edges.
   */
  async pinnedEdge(projectId: string, spec: SandboxSpec): Promise<string | undefined> {
    const mounts = spec.volumes ?? [];
    if (mounts.length === 0) return undefined;
    checkVolumeMounts(mounts);
    let edgeId: string | undefined;
    for (const [i, m] of mounts.entries()) {
      const record = await this.#d.iam.getVolume(projectId, m.name);
      if (!record || record.state !== 'ready')
        throw new DsecError('volume_not_found', `no volume ${m.name}`, {
          field: `volumes.${i}.name`,
        });
      if (edgeId !== undefined && record.edgeId !== edgeId)
        throw new DsecError(
          'invalid_argument',
          `volumes ${mounts[0]?.name ?? ''} and ${m.name} live on different edges; a sandbox mounts volumes of one edge`,
          { field: `volumes.${i}.name` },
        );
      edgeId = record.edgeId;
    }
    return edgeId;
  }

  async #record(
    principal: Principal,
    name: string,
    projectId: string | undefined,
  ): Promise<VolumeRecord> {
    checkVolumeName(name);
    const project = await this.#project(principal, projectId);
    const record = await this.#d.iam.getVolume(project, name);
    if (!record) throw new DsecError('volume_not_found', `no volume ${name}`, { field: 'name' });
    return record;
  }

  async #project(principal: Principal, projectId: string | undefined): Promise<string> {
    await requireVolumeScope(this.#d.iam, principal);
    const project = projectId ?? principal.projectId;
    if (!(await this.#d.iam.canAccess(principal, project))) {
      await this.#d.iam.audit(principal.keyId, 'project.access', project, 'denied');
      throw new DsecError('not_found', `no project ${JSON.stringify(project)}`, {
        field: 'projectId',
      });
    }
    return project;
  }

  /** A healthy edge that keeps volumes; `unavailable` when none does. */
  #pickEdge(): EdgeApi & { volumes: EdgeVolumeApi } {
    const candidates = this.#d.watcher
      .view()
      .edges.filter((e) => e.healthy)
      .map((e) => this.#edgeOf(e.edgeId))
      .filter((e): e is EdgeApi & { volumes: EdgeVolumeApi } => e?.volumes !== undefined);
    const random = this.#d.random ?? Math.random;
    const edge = candidates[Math.floor(random() * candidates.length)];
    if (!edge) throw new DsecError('unavailable', 'no healthy edge keeps volumes');
    return edge;
  }

  #edgeOf(edgeId: string): EdgeApi | undefined {
    const { edges } = this.#d;
    return typeof edges === 'function' ? edges(edgeId) : edges.get(edgeId);
  }
}

/**
 * A scoped key needs `volumes:use` for every volume operation, mounting
 * included (`@dsec/iam` scopes): `permission_denied`, audited.
 */
export async function requireVolumeScope(iam: Iam, principal: Principal): Promise<void> {
  if (mayUseVolumes(principal)) return;
  await iam.audit(principal.keyId, 'volume', principal.projectId, 'denied', {
    reason: 'no volumes scope',
  });
  throw new DsecError('permission_denied', `this key has no ${VOLUMES_SCOPE} scope`, {
    field: 'volumes',
  });
}

function volumesOf(edge: EdgeApi): EdgeVolumeApi {
  if (!edge.volumes) throw new DsecError('unavailable', `edge ${edge.edgeId} keeps no volumes`);
  return edge.volumes;
}

function toInfo(r: VolumeRecord): VolumeInfo {
  return {
    name: r.name,
    projectId: r.projectId,
    sizeMb: Math.round(r.sizeBytes / 2 ** 20),
    edgeId: r.edgeId,
    state: r.state,
    createdAt: r.createdAt,
  };
}

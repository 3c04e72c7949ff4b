import {
  DsecError,
  formatLayerKey,
  formatLayerRef,
  parseLayerRef,
  visibleLayers,
  type LayerInfo,
  type LayerView,
} from '@dsec/core';
import { maySnapshot, SNAPSHOT_SCOPE } from '@dsec/iam';
import type { Iam, Principal } from '@dsec/iam';

/**
 * The image store as the apiserver reaches it (`@dsec/images` in the cluster
 * wiring): every owner's records, and the removal of one project's.
 */
export interface ImageCatalog {
  /**
   * The platform's layers and, with `projects`, those projects' only (else
   * every owner's); without `all`, the plumbing records registry imports keep
   * are left out.
   */
  list(options: { all: boolean; projects?: readonly string[] | undefined }): Promise<LayerInfo[]>;
  /** Removes `ref` from `project`'s namespace (never the platform's); `image_not_found` when absent. */
  remove?(ref: string, project: string): Promise<void>;
}

/**
 * Which layers a caller sees and which it may delete (docs/adr/0019-layer-ownership.md).
 *
 * A project's view is the platform's layers and those of its ancestors and
 * its own (`Iam.lineage`); a listing shows exactly those, one name's records
 * in the order a create resolves them. A layer outside the caller's view is
 * absent to it in every answer (`image_not_found`), never `permission_denied`,
 * so a tenant cannot learn another's names. Layers a project owns are deleted
 * through here (a scoped key needs `sandboxes:snapshot`: deleting is a builder's
 * right), which gives their bytes back to its `imageBytes` quota; the
 * platform's are the operator's (`dsec image rm`).
 */
export class ImageService {
  constructor(readonly deps: { iam: Iam; catalog?: ImageCatalog | undefined }) {}

  /** The layers `projectId` (default: the key's project; `not_found` unless the key reaches it) sees. */
  async list(
    principal: Principal,
    options: { all: boolean; projectId?: string | undefined },
  ): Promise<LayerInfo[]> {
    const project = await this.#project(principal, options.projectId, 'images.list');
    const view: LayerView = await this.deps.iam.lineage(project);
    // Only the namespaces of the view are read: other tenants' size is not this caller's cost.
    const layers = await this.#catalog().list({ all: options.all, projects: view });
    return visibleLayers(layers, view);
  }

  /**
   * Deletes `ref` of `projectId`'s own namespace (default: the key's project)
   * and gives its bytes back. `image_not_found` when that project owns no
   * such layer (whoever else has one); `conflict` while another layer was
   * snapshotted on top of it (`details.layers`, their keys: all in the
   * project's subtree, the only ones that can see it).
   */
  async remove(
    principal: Principal,
    ref: string,
    options: { projectId?: string | undefined },
  ): Promise<void> {
    const project = await this.#project(principal, options.projectId, 'images.delete');
    if (!maySnapshot(principal)) {
      await this.deps.iam.audit(principal.keyId, 'images.delete', ref, 'denied', {
        reason: 'no snapshot scope',
      });
      throw new DsecError('permission_denied', `this key has no ${SNAPSHOT_SCOPE} scope`);
    }
    const catalog = this.#catalog();
    if (!catalog.remove) throw unavailable();
    const parsed = parseLayerRef(ref);
    if (!parsed) throw notFound(ref);
    const key = formatLayerKey({ ...parsed, project });
    // Only the project's subtree can stack its layers (their views are the only ones holding
    // it), so only its namespaces are read, never every tenant's.
    const all = await catalog.list({
      all: true,
      projects: await this.deps.iam.subtreeIds(project),
    });
    if (!all.some((l) => formatLayerKey(l) === key)) throw notFound(ref);
    const users = all.filter((l) => l.parents?.includes(key)).map((l) => formatLayerKey(l));
    if (users.length > 0) {
      throw new DsecError(
        'conflict',
        `layer ${formatLayerRef(parsed)} is the parent of ${users.length} other layer(s); delete those first`,
        { details: { layers: users.slice(0, 100) } },
      );
    }
    await catalog.remove(formatLayerRef(parsed), project);
    await this.deps.iam.releaseImageBytes(key, {
      actorKeyId: principal.keyId,
      action: 'image.delete',
    });
  }

  /** The project a call names, checked; `not_found` (audited) when the key does not reach it. */
  async #project(principal: Principal, projectId: string | undefined, action: string) {
    const project = projectId ?? principal.projectId;
    if (!(await this.deps.iam.canAccess(principal, project))) {
      await this.deps.iam.audit(principal.keyId, action, project, 'denied');
      throw new DsecError('not_found', `no project ${JSON.stringify(project)}`, {
        field: 'projectId',
      });
    }
    return project;
  }

  #catalog(): ImageCatalog {
    if (!this.deps.catalog) throw unavailable();
    return this.deps.catalog;
  }
}

function notFound(ref: string): DsecError {
  return new DsecError('image_not_found', `no layer ${JSON.stringify(ref.slice(0, 300))}`, {
    field: 'ref',
  });
}

function unavailable(): DsecError {
  return new DsecError('unavailable', 'this apiserver has no image store configured');
}

# GENERATED from dsec/_async/client.py by python/tools/gen_sync.py: do not edit.
"""The client: one connection pool to one DSec apiserver."""

from __future__ import annotations

import time
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .._core import (
    BUILD_POLL_INTERVAL,
    DEFAULT_BUILD_TIMEOUT,
    DEFAULT_CREATE_TIMEOUT,
    DEFAULT_VM_CREATE_TIMEOUT,
    DEFAULT_LIFECYCLE_TIMEOUT,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    RetryPolicy,
    build_context_tar,
    build_failure,
    build_params,
    compact,
    monotonic,
    new_request_id,
    or_default,
    resolve_settings,
    segment,
)
from ..errors import DeadlineExceeded, InvalidArgument
from ..models import (
    CreatedKey,
    DSecContainerRunArgs,
    EdgeStatus,
    Health,
    JobResult,
    LayerInfo,
    Project,
    Quota,
    SandboxInfo,
    VolumeInfo,
    Whoami,
    from_wire,
    to_wire,
)
from .fncall import FnCalls
from .sandbox import Sandbox
from .transport import Transport


class DSecClient:
    """A connection to one DSec apiserver (the paper's libdsec client).

    ``url`` and ``api_key`` default to ``DSEC_URL`` and ``DSEC_API_KEY``
    (then ``http://127.0.0.1:7420``). ``timeout`` is the deadline in seconds
    of calls that do not say otherwise. One client serves many sandboxes and
    concurrent calls over pooled keep-alive connections; ``close()`` it (or
    use ``with``) when done. Every method raises ``DSecError``
    subclasses: ``Unavailable`` when the server cannot be reached,
    ``DeadlineExceeded`` past the deadline.

    Calls that are safe to resend (reads, stop, pause/resume, and every call
    with a request ID) are retried up to ``max_retries`` times with backoff on
    ``Unavailable``, ``CapacityExhausted`` and ``QuotaExceeded``;
    ``run_container`` gives each create a request ID for that.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_connections: int = 256,
    ) -> None:
        self.url, key = resolve_settings(url, api_key)
        self._timeout = timeout
        retry = RetryPolicy(max_retries=max_retries)
        self._http = Transport(self.url, key, retry=retry, max_connections=max_connections)
        #: Who the key belongs to; set by ``open()``.
        self.whoami: Optional[Whoami] = None
        #: Stateless function calls in warm pools (``run``, ``map``; docs/fncall.md).
        self.fncall = FnCalls(self._http)

    def __enter__(self) -> "DSecClient":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, *, timeout: Optional[float] = None) -> Whoami:
        """Checks that the server answers and the key is valid, and records
        ``whoami``. Optional, but fails early with ``Unavailable`` or
        ``Unauthenticated``."""
        self.health(timeout=timeout)
        self.whoami = from_wire(Whoami, self._get("/v1/whoami", timeout))
        return self.whoami

    def close(self) -> None:
        """Releases pooled connections; later calls raise ``Unavailable``."""
        self._http.close()

    def health(self, *, timeout: Optional[float] = None) -> Health:
        return from_wire(Health, self._get("/healthz", timeout))

    # --- sandboxes --------------------------------------------------------

    def run_container(self, args: DSecContainerRunArgs, *, timeout: float = DEFAULT_CREATE_TIMEOUT) -> Sandbox:
        """Creates a container sandbox and returns once it runs (deadline
        ``timeout`` seconds, default 120). Without ``args.request_id`` the SDK
        makes one, so that a retry after a lost answer returns the same
        sandbox rather than a second one.

        Raises ``InvalidArgument`` (with ``field``), ``ImageNotFound``,
        ``PermissionDenied``, ``QuotaExceeded``, ``CapacityExhausted``.
        """
        return self._run(args, "container", "run_container", timeout)

    def run_micro_vm(self, args: DSecContainerRunArgs, *, timeout: float = DEFAULT_CREATE_TIMEOUT) -> Sandbox:
        """Like ``run_container``, in a microVM (``backend: 'microvm'``): the
        sandbox gets its own guest kernel (a QEMU ``microvm`` machine booting
        ``container_image``'s layers), and everything else (commands,
        sessions, files, ports, terminals, pause) works the same. Edges
        without QEMU and the microVM kernel refuse it (``CapacityExhausted``
        when none has it)."""
        return self._run(args, "microvm", "run_micro_vm", timeout)

    def run_vm(self, args: DSecContainerRunArgs, *, timeout: float = DEFAULT_VM_CREATE_TIMEOUT) -> Sandbox:
        """Like ``run_container``, as a full VM (``backend: 'vm'``): a Debian
        guest with a display, driven by ``sandbox.screenshot()`` and
        ``sandbox.input(...)``, whose commands, files and terminal run in
        ``container_image``'s layers (the guest's own system only provides
        the kernel, X and the agent). Needs 384 MiB of memory or more;
        booting takes minutes without KVM (deadline ``timeout`` seconds,
        default 900). Edges without the VM image refuse it."""
        return self._run(args, "vm", "run_vm", timeout)

    def _run(self, args: DSecContainerRunArgs, backend: str, method: str, timeout: float) -> Sandbox:
        if not isinstance(args, DSecContainerRunArgs):
            raise InvalidArgument(f"{method} takes a DSecContainerRunArgs", field="args")
        body = args.to_body() if backend == "container" else {**args.to_body(), "backend": backend}
        body.setdefault("requestId", new_request_id())
        answer = self._http.json("POST", "/v1/sandboxes", body=body, timeout=timeout, retry_safe=True)
        info = from_wire(SandboxInfo, answer)
        return Sandbox(self._http, info.id, info, self._timeout)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle for an existing sandbox; makes no request (``refresh()`` loads its info)."""
        return Sandbox(self._http, sandbox_id, None, self._timeout)

    def get_sandbox(self, sandbox_id: str, *, timeout: Optional[float] = None) -> Sandbox:
        """A sandbox with its info (and ``memory_bytes``). Raises ``SandboxNotFound``."""
        sandbox = self.sandbox(sandbox_id)
        sandbox.refresh(timeout=timeout)
        return sandbox

    def list_sandboxes(
        self,
        *,
        project_id: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> List[SandboxInfo]:
        """The sandboxes this key may see, optionally of one project, optionally
        only those carrying every label of ``labels`` (``{"job": "rl-7"}``)."""
        params = [("projectId", project_id)] if project_id else []
        params += [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        answer = self._get("/v1/sandboxes", timeout, params)
        return [from_wire(SandboxInfo, s) for s in answer["sandboxes"]]

    # --- whole jobs (label selectors) -------------------------------------

    def pause_job(
        self, labels: Mapping[str, str], *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> JobResult:
        """Pauses every live sandbox carrying all of ``labels`` (what a trainer
        sends when its job is preempted). Each sandbox succeeds or fails on its
        own: the answer lists both."""
        return self._job("pause", labels, project_id, None, timeout)

    def resume_job(
        self, labels: Mapping[str, str], *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> JobResult:
        """Resumes every paused sandbox carrying all of ``labels``; see ``pause_job``."""
        return self._job("resume", labels, project_id, None, timeout)

    def stop_job(
        self, labels: Mapping[str, str], *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> JobResult:
        """Stops every live sandbox carrying all of ``labels`` and frees its quota."""
        return self._job("stop", labels, project_id, None, timeout)

    def extend_job(
        self,
        labels: Mapping[str, str],
        seconds: int,
        *,
        project_id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> JobResult:
        """Every live sandbox carrying all of ``labels`` now stops ``seconds`` from now."""
        return self._job("extend", labels, project_id, seconds, timeout)

    def _job(
        self,
        action: str,
        labels: Mapping[str, str],
        project_id: Optional[str],
        seconds: Optional[int],
        timeout: Optional[float],
    ) -> JobResult:
        body = compact({"labels": dict(labels), "projectId": project_id, "seconds": seconds})
        # Every action is a no-op on a sandbox already in its target state.
        answer = self._http.json(
            "POST",
            f"/v1/sandboxes:{action}",
            body=body,
            timeout=or_default(timeout, DEFAULT_LIFECYCLE_TIMEOUT),
            retry_safe=True,
        )
        return from_wire(JobResult, answer)

    # --- images, projects, keys, edges ------------------------------------

    def list_images(
        self, *, all: bool = False, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> List[LayerInfo]:
        """The layers the key's project sees: the platform's, and the snapshots and forks of the
        project and its ancestors (``project`` names the owner). ``project_id`` lists what that
        project (the key's own or a descendant) sees; ``all`` adds registry imports' per-layer
        ``oci-diff`` records."""
        params: List[Any] = []
        if all:
            params.append(("all", "true"))
        if project_id is not None:
            params.append(("projectId", project_id))
        answer = self._get("/v1/images", timeout, params=params or None)
        return [from_wire(LayerInfo, layer) for layer in answer["layers"]]

    def delete_image(
        self, ref: str, *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> None:
        """Deletes a snapshot or fork the key's project (or ``project_id``, a descendant) owns,
        giving its bytes back to the project's ``imageBytes`` quota. ``ImageNotFound`` for any
        layer the project does not own itself; ``Conflict`` while another layer was
        snapshotted on top of it."""
        params = [("projectId", project_id)] if project_id is not None else None
        self._http.json(
            "DELETE",
            f"/v1/images/{segment(ref)}",
            params=params,
            timeout=or_default(timeout, self._timeout),
            retry_safe=True,
        )

    # --- volumes (docs/volumes.md) -----------------------------------------

    def create_volume(
        self, name: str, *, size_mb: int, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> VolumeInfo:
        """Creates the project's volume ``name``: ``size_mb`` MiB of ext4 on one edge, counted
        against the ``volumeBytes`` quota. Mount it with
        ``DSecContainerRunArgs(volumes=[VolumeMount(name, "/path")])``. ``Conflict`` when the
        project has one of that name, ``QuotaExceeded`` when it does not fit. Never resent."""
        body = compact({"name": name, "sizeMb": size_mb, "projectId": project_id})
        answer = self._http.json("POST", "/v1/volumes", body=body, timeout=or_default(timeout, self._timeout))
        return from_wire(VolumeInfo, answer)

    def list_volumes(
        self, *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> List[VolumeInfo]:
        """The project's volumes (the key's, or ``project_id``: its own or a descendant)."""
        params = [("projectId", project_id)] if project_id is not None else None
        answer = self._get("/v1/volumes", timeout, params=params)
        return [from_wire(VolumeInfo, v) for v in answer["volumes"]]

    def get_volume(
        self, name: str, *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> VolumeInfo:
        """One volume with its use now (``used_bytes``, ``mounted_by``); ``VolumeNotFound`` when absent."""
        params = [("projectId", project_id)] if project_id is not None else None
        return from_wire(VolumeInfo, self._get(f"/v1/volumes/{segment(name)}", timeout, params=params))

    def delete_volume(
        self, name: str, *, project_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> None:
        """Deletes a volume and its bytes; ``VolumeInUse`` while a sandbox mounts it."""
        params = [("projectId", project_id)] if project_id is not None else None
        self._http.json(
            "DELETE",
            f"/v1/volumes/{segment(name)}",
            params=params,
            timeout=or_default(timeout, self._timeout),
            retry_safe=True,
        )
    def build_image(
        self,
        context_dir: Union[str, "os.PathLike[str]"],
        *,
        name: str,
        dockerfile: str = "Dockerfile",
        build_args: Optional[Mapping[str, str]] = None,
        target: Optional[str] = None,
        timeout: float = DEFAULT_BUILD_TIMEOUT,
        poll_interval: float = BUILD_POLL_INTERVAL,
    ) -> str:
        """Builds the Dockerfile of ``context_dir`` on the server into an image of the key's
        project and returns its name (``name:version``) once it is ready, for ``image=``.

        The directory is sent as a tar archive (symlinks as links, never followed) to
        ``POST /v1/images/builds``; the build runs on the node that holds the image store
        (buildah, ``RUN`` steps under the node's egress policy) and is polled every
        ``poll_interval`` seconds. ``timeout`` bounds the build on the server and the wait here
        (past it the build is cancelled and ``DeadlineExceeded`` raised). A failed build raises
        the error it failed with: ``InvalidArgument`` (``details["reason"]``
        ``build_step_failed`` with ``instruction``, ``line``, ``outputTail``; a bad context or
        Dockerfile), ``Conflict`` (another build under a stored ``name:version``: use a new
        version), ``QuotaExceeded`` (the project's ``imageBytes``), ``Aborted``."""
        data = build_context_tar(context_dir)
        params = build_params(name, dockerfile, build_args, target, timeout)
        deadline = monotonic() + timeout
        with self._http.stream(
            "POST",
            "/v1/images/builds",
            params=params,
            content=data,
            headers={"content-type": "application/x-tar"},
            timeout=or_default(None, self._timeout) + len(data) / (1024 * 1024),
        ) as response:
            info: Dict[str, Any] = json.loads(response.read())
        build_id = str(info["id"])
        while info.get("status") == "building":
            if monotonic() >= deadline:
                self.cancel_build(build_id)
                raise DeadlineExceeded(f"the build of {name} ran past {timeout} s", details={"buildId": build_id})
            time.sleep(poll_interval)
            info = self.get_build(build_id)
        if info.get("status") != "ready":
            raise build_failure(info)
        return str(info["image"])

    def get_build(self, build_id: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """One build of the key's project (``GET /v1/images/builds/{id}``): ``status``
        (``building``, ``ready``, ``failed``), ``error``, ``errorCode``, ``log`` (its tail)."""
        return self._get(f"/v1/images/builds/{segment(build_id)}", timeout)

    def cancel_build(self, build_id: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Stops a running build (it ends ``failed``, ``errorCode`` ``aborted``)."""
        answer: Dict[str, Any] = self._http.json(
            "DELETE",
            f"/v1/images/builds/{segment(build_id)}",
            timeout=or_default(timeout, self._timeout),
            retry_safe=True,
        )
        return answer

    def create_project(
        self,
        name: str,
        *,
        parent_id: Optional[str] = None,
        quota: Optional[Quota] = None,
        timeout: Optional[float] = None,
    ) -> Project:
        """Creates a project (under ``parent_id``, default the key's own)."""
        body = compact({"name": name, "parentId": parent_id, "quota": to_wire(quota) if quota else None})
        answer = self._http.json("POST", "/v1/projects", body=body, timeout=or_default(timeout, self._timeout))
        return from_wire(Project, answer)

    def list_projects(self, *, timeout: Optional[float] = None) -> List[Project]:
        """The key's project and its descendants."""
        return [from_wire(Project, p) for p in (self._get("/v1/projects", timeout))["projects"]]

    def create_key(
        self,
        project_id: str,
        *,
        role: Optional[str] = None,
        name: Optional[str] = None,
        scopes: Optional[Sequence[str]] = None,
        timeout: Optional[float] = None,
    ) -> CreatedKey:
        """Creates an API key (``role`` ``"admin"`` or ``"member"``, the default).
        ``scopes`` limit it (``sandboxes:snapshot``, ``fncall:run``, ``volumes:use``,
        ``images:run:<pattern>``) or add
        ``metrics:read``; a key grants only rights it holds. The secret in ``key`` is
        returned only this once."""
        body = compact(
            {
                "projectId": project_id,
                "role": role,
                "name": name,
                "scopes": list(scopes) if scopes is not None else None,
            }
        )
        answer = self._http.json("POST", "/v1/keys", body=body, timeout=or_default(timeout, self._timeout))
        return from_wire(CreatedKey, answer)

    def delete_key(self, key_id: str, *, timeout: Optional[float] = None) -> None:
        self._http.json(
            "DELETE", f"/v1/keys/{segment(key_id)}", timeout=or_default(timeout, self._timeout), retry_safe=True
        )

    def list_edges(self, *, timeout: Optional[float] = None) -> List[EdgeStatus]:
        """The cluster's edges with health and load; needs an admin key of the root project."""
        return [from_wire(EdgeStatus, e) for e in (self._get("/v1/edges", timeout))["edges"]]

    def _get(self, path: str, timeout: Optional[float], params: Optional[List[Any]] = None) -> Dict[str, Any]:
        answer: Dict[str, Any] = self._http.json(
            "GET", path, params=params, timeout=or_default(timeout, self._timeout), retry_safe=True
        )
        return answer

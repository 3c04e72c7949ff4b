"""What the DSec API answers and accepts, as dataclasses.

Field names are the wire's camelCase in snake_case (``memoryLimitMb`` is
``memory_limit_mb``); units stay in the names. Timestamps are aware
``datetime`` objects. Fields a newer server adds are ignored, so an old SDK
keeps working against a new server.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type, TypeVar

from .errors import Internal

__all__ = [
    "DSecContainerRunArgs",
    "NetworkTarget",
    "Health",
    "Whoami",
    "SandboxSpec",
    "SandboxInfo",
    "CommandResult",
    "SessionResult",
    "CommandInfo",
    "SessionInfo",
    "FileInfo",
    "SandboxEvent",
    "LayerInfo",
    "SnapshotInfo",
    "JobSandbox",
    "JobFailure",
    "JobResult",
    "Quota",
    "Project",
    "CreatedKey",
    "EdgeStatus",
    "OutputEvent",
    "FnCallResult",
    "FnCallItem",
    "VolumeMount",
    "VolumeInfo",
]

_T = TypeVar("_T")

#: An explicit egress target: ``{"domain": "*.example.com", "ports": [443]}`` or ``{"cidr": "10.0.0.0/8"}``.
NetworkTarget = Mapping[str, Any]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _time(value: str) -> datetime:
    # fromisoformat accepts a trailing Z only from Python 3.11 on.
    return datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)


def _wire(decode: Callable[[Any], Any], **kwargs: Any) -> Any:
    """A dataclass field whose wire value is converted by ``decode``."""
    return field(metadata={"decode": decode}, **kwargs)


def _list_of(cls: Type[_T]) -> Callable[[Any], List[_T]]:
    return lambda items: [from_wire(cls, item) for item in items]


def from_wire(cls: Type[_T], data: Any) -> _T:
    """Builds ``cls`` from a JSON object of the API; unknown keys are ignored.

    Raises ``Internal`` when the answer lacks a field the dataclass requires
    (a server that does not speak this API).
    """
    if not isinstance(data, Mapping):
        raise Internal(f"DSec answered {type(data).__name__} where {cls.__name__} was expected")
    kwargs: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = _camel(f.name)
        if key not in data:
            continue
        value = data[key]
        decode = f.metadata.get("decode")
        kwargs[f.name] = decode(value) if decode is not None and value is not None else value
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise Internal(f"malformed {cls.__name__} in DSec's answer: {err}") from None


def to_wire(value: Any) -> Any:
    """A dataclass (or mapping of them) as the API's JSON, ``None`` fields left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            _camel(f.name): to_wire(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, Mapping):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    return value


@dataclass(frozen=True)
class VolumeMount:
    """The project's volume ``name`` mounted at ``path`` (absolute, outside /proc, /dev, /sys)."""

    name: str
    path: str


@dataclass
class DSecContainerRunArgs:
    """A container sandbox request: libdsec's ``DSecContainerRunArgs``.

    ``None`` means the server's default (docs/CONVENTIONS.md,
    ``CreateSandboxBody``): 512 MiB, 1 core, 1024 pids, a 3600 s TTL,
    egress denied, user ``root``.
    """

    #: Base image layer, ``name`` or ``name:version``.
    container_image: str
    memory_limit_mb: Optional[int] = None
    cpu_cores_limit: Optional[float] = None
    #: Seconds after creation when the sandbox is stopped and reclaimed (its TTL).
    ttl_running_stop: Optional[int] = None
    #: Named rules of the catalogue: ``{"pypi": True, "npm": False}``.
    network_rules: Optional[Mapping[str, bool]] = None
    #: User that commands run as unless they say otherwise.
    init_user: Optional[str] = None
    workspace: Optional[str] = None
    toolkits: Optional[Sequence[str]] = None
    pids_limit: Optional[int] = None
    #: Disk quota of the writable layer (ENOSPC past it); default none.
    disk_limit_mb: Optional[int] = None
    #: ``"latency-sensitive"`` (default) or ``"best-effort"``.
    qos_class: Optional[str] = None
    #: Egress allowed on top of ``network_rules``.
    network_allow: Optional[Sequence[NetworkTarget]] = None
    #: Egress denied whatever else allows it.
    network_deny: Optional[Sequence[NetworkTarget]] = None
    env: Optional[Mapping[str, str]] = None
    labels: Optional[Mapping[str, str]] = None
    #: Labels the chosen edge must carry, e.g. ``{"pool": "gpu"}``.
    edge_selector: Optional[Mapping[str, str]] = None
    #: The project's volumes to mount (``VolumeMount`` or ``{"name", "path"}``); the sandbox
    #: runs on the edge that holds them (docs/volumes.md).
    volumes: Optional[Sequence[Any]] = None
    project_id: Optional[str] = None
    #: Idempotency key; the SDK makes one when it is ``None`` so that retries are safe.
    request_id: Optional[str] = None

    def to_body(self) -> Dict[str, Any]:
        """The ``POST /v1/sandboxes`` body."""
        body: Dict[str, Any] = to_wire(self)
        body["image"] = body.pop("containerImage")
        if "ttlRunningStop" in body:
            body["ttlSeconds"] = body.pop("ttlRunningStop")
        return {"backend": "container", **body}


@dataclass(frozen=True)
class Health:
    ok: bool
    version: str


@dataclass(frozen=True)
class Whoami:
    key_id: str
    project_id: str
    #: ``"admin"`` or ``"member"``.
    role: str
    #: The key's scopes; ``None`` for an unscoped key.
    scopes: Optional[List[str]] = None


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox was created with, the server's defaults filled in."""

    backend: str
    image: str
    memory_limit_mb: int
    cpu_cores_limit: float
    pids_limit: int
    ttl_seconds: int
    init_user: str
    toolkits: List[str] = field(default_factory=list)
    network_rules: Dict[str, bool] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    workspace: Optional[str] = None
    qos_class: Optional[str] = None
    disk_limit_mb: Optional[int] = None
    network_allow: Optional[List[Dict[str, Any]]] = None
    network_deny: Optional[List[Dict[str, Any]]] = None
    edge_selector: Optional[Dict[str, str]] = None
    #: Volumes mounted at create: ``[{"name", "path"}]``.
    volumes: Optional[List[Dict[str, str]]] = None


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    edge_id: str
    project_id: str
    #: ``creating``, ``running``, ``paused``, ``stopping``, ``stopped`` or ``failed``.
    state: str
    spec: SandboxSpec = _wire(lambda v: from_wire(SandboxSpec, v))
    created_at: datetime = _wire(_time)
    #: When the TTL stops it (``Sandbox.set_timeout`` moves it).
    expires_at: datetime = _wire(_time)
    #: Why it failed or stopped, when it did.
    reason: Optional[str] = None
    paused_at: Optional[datetime] = _wire(_time, default=None)
    #: When a paused sandbox is stopped if nothing resumes it.
    paused_expires_at: Optional[datetime] = _wire(_time, default=None)
    #: Host memory charged to the sandbox now (from ``get_sandboxes``/``refresh``, not lists).
    memory_bytes: Optional[int] = None


@dataclass(frozen=True)
class CommandResult:
    """How a command ended. A non-zero exit is a result, not an error."""

    command_id: str
    exit_code: int
    #: ``exited``, ``signaled``, ``timeout``, ``killed`` or ``oom``.
    outcome: str
    stdout: str = ""
    stderr: str = ""
    #: True when either stream went past its cap and its middle was dropped.
    truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    duration_ms: float = 0
    #: The signal's name when the process died of one.
    signal: Optional[str] = None
    #: Why the platform ended or lost the command, when it did.
    reason: Optional[str] = None

    @property
    def ok(self) -> bool:
        """The command exited by itself with status 0."""
        return self.outcome == "exited" and self.exit_code == 0


@dataclass(frozen=True)
class SessionResult(CommandResult):
    """A session line's result (docs/adr/0004-shell-sessions.md)."""

    session: str = ""
    #: The session's shell had died and this call started a new one.
    shell_restarted: bool = False
    #: The shell exited during this call (``exit``, ``set -e``); the next call starts a new one.
    session_ended: bool = False


@dataclass(frozen=True)
class CommandInfo:
    """A command as the sandbox's command log keeps it."""

    command_id: str
    sandbox_id: str
    #: ``running`` or ``finished``.
    state: str
    background: bool = False
    started_at: Optional[datetime] = _wire(_time, default=None)
    finished_at: Optional[datetime] = _wire(_time, default=None)
    request_id: Optional[str] = None
    session: Optional[str] = None
    argv: Optional[List[str]] = None
    shell: Optional[str] = None
    line: Optional[str] = None
    #: Present once ``state`` is ``finished``.
    result: Optional[CommandResult] = _wire(lambda v: from_wire(CommandResult, v), default=None)


@dataclass(frozen=True)
class SessionInfo:
    name: str
    #: ``sh`` (the platform's shell) or the sandbox's shell path.
    shell: str
    user: str
    alive: bool
    busy: bool
    calls: int
    created_at: datetime = _wire(_time)
    pid: Optional[int] = None


@dataclass(frozen=True)
class FileInfo:
    #: The last path component.
    name: str
    path: str
    #: ``file``, ``directory``, ``symlink``, ``fifo``, ``socket``, ``char``, ``block`` or ``unknown``.
    type: str
    size: int
    #: Permission bits (``0o644``), setuid/setgid/sticky included.
    mode: int
    mtime: datetime = _wire(_time)
    uid: int = 0
    gid: int = 0
    #: A symlink's target (from ``stat`` only).
    target: Optional[str] = None


@dataclass(frozen=True)
class SandboxEvent:
    """Something a policy or limit stopped: ``network_denied``, ``dns_blocked``, ``oom_killed``, …"""

    #: Increasing; pass the last one seen as ``after_id`` to page.
    id: int
    sandbox_id: str
    time: datetime = _wire(_time)
    kind: str = ""
    message: str = ""
    count: int = 1
    details: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerInfo:
    name: str
    version: str
    #: ``base``, ``workspace``, ``toolkit`` or ``snapshot``.
    kind: str
    digest: str
    size_bytes: int = 0
    content_bytes: int = 0
    file_count: int = 0
    created_at: Optional[datetime] = _wire(_time, default=None)
    source: str = ""
    #: The project that owns it (its snapshots and forks); ``None`` for the platform's.
    project: Optional[str] = None
    #: Layer keys, bottom first: ``name:version``, or ``project/name:version`` for a project's.
    parents: Optional[List[str]] = None
    scrub: Optional[List[str]] = None

    @property
    def ref(self) -> str:
        """``name:version``, what ``container_image`` accepts."""
        return f"{self.name}:{self.version}"


@dataclass(frozen=True)
class SnapshotInfo:
    #: What ``DSecContainerRunArgs.container_image`` accepts to start from this state.
    image: str
    layer: LayerInfo = _wire(lambda v: from_wire(LayerInfo, v))
    #: The layers below it, lowest first.
    parents: List[str] = field(default_factory=list)
    scrub: List[str] = field(default_factory=list)
    #: How long the sandbox's processes were frozen.
    freeze_ms: float = 0
    total_ms: float = 0


@dataclass(frozen=True)
class JobSandbox:
    id: str
    state: str


@dataclass(frozen=True)
class JobFailure:
    id: str
    code: str
    message: str


@dataclass(frozen=True)
class JobResult:
    """A whole-job operation: every selected sandbox is in one list or the other."""

    sandboxes: List[JobSandbox] = _wire(_list_of(JobSandbox), default_factory=list)
    failed: List[JobFailure] = _wire(_list_of(JobFailure), default_factory=list)


@dataclass(frozen=True)
class Quota:
    sandboxes: Optional[int] = None
    memory_mb: Optional[int] = None
    cpu_cores: Optional[float] = None
    #: Function calls the subtree may start per second.
    fncalls_per_second: Optional[int] = None
    #: Bytes of layers (snapshots, forks) the subtree may own.
    image_bytes: Optional[int] = None
    #: Bytes of volumes (their sizes) the subtree may hold.
    volume_bytes: Optional[int] = None


@dataclass(frozen=True)
class VolumeInfo:
    """A project's named volume (docs/volumes.md)."""

    name: str
    project_id: str
    size_mb: int
    #: The edge that holds its bytes; sandboxes that mount it run there.
    edge_id: str
    #: ``creating`` or ``ready``.
    state: str
    created_at: datetime = _wire(_time)
    #: Bytes in use now (``get_volume`` only).
    used_bytes: Optional[int] = None
    #: Sandboxes that mount it now (``get_volume`` only).
    mounted_by: Optional[List[str]] = None


@dataclass(frozen=True)
class Project:
    id: str
    name: str
    #: ``None`` for the root project.
    parent_id: Optional[str] = None
    quota: Quota = _wire(lambda v: from_wire(Quota, v), default_factory=Quota)
    created_at: Optional[datetime] = _wire(_time, default=None)


@dataclass(frozen=True)
class CreatedKey:
    id: str
    #: The secret; shown only this once.
    key: str
    project_id: str
    role: str
    scopes: Optional[List[str]] = None


@dataclass(frozen=True)
class EdgeStatus:
    edge_id: str
    url: str
    healthy: bool
    backends: List[str] = field(default_factory=list)
    #: What placement may still put there: ``memoryMb``, ``cpuCores``, ``sandboxes``.
    capacity: Dict[str, float] = field(default_factory=dict)
    used: Dict[str, float] = field(default_factory=dict)
    sandboxes_by_project: Dict[str, int] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    #: Set by ``dsec edge cordon``: placement sends this edge nothing new.
    cordoned: bool = False


@dataclass(frozen=True)
class OutputEvent:
    """A piece of a command's output, decoded as UTF-8 per stream."""

    #: ``"stdout"`` or ``"stderr"``.
    stream: str
    data: str


@dataclass(frozen=True)
class FnCallResult:
    """How a function call ended (docs/fncall.md). A program that fails is a
    result (``exit_code``, ``outcome``), not an error."""

    #: The program's exit code (128 + signal when a signal ended it, -1 when it never ran).
    exit_code: int
    #: ``ok`` (the program ran to its own exit: read ``exit_code``), ``timeout``, ``oom``,
    #: ``output_limit``, ``signaled``, ``pids_limit`` or ``runtime_error``.
    outcome: str
    stdout: str = ""
    stderr: str = ""
    #: True when either stream went past ``max_output_bytes``.
    truncated: bool = False
    duration_ms: float = 0
    #: Set when the platform, not the program, ended or failed the call.
    reason: Optional[str] = None
    #: The edge that ran it (for support).
    edge_id: Optional[str] = None

    @property
    def ok(self) -> bool:
        """The program exited by itself with status 0."""
        return self.outcome == "ok" and self.exit_code == 0


@dataclass(frozen=True)
class FnCallItem:
    """One finished call of ``fncall.map``, in completion order: ``index`` is
    its place in the calls given; ``result`` is set, or ``error`` when the
    platform failed the call."""

    index: int
    result: Optional[FnCallResult] = None
    error: Optional[Exception] = None

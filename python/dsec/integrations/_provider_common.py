"""What the SWE-ReX, verifiers and tinker-cookbook providers share.

- Sandboxes a provider creates always carry a TTL (the backstop when every other clean-up fails)
  and are recorded in a process-wide registry; whatever is still recorded when the interpreter
  exits is stopped then (``atexit``, through the blocking client, since no event loop is left).
- Timeouts: the frameworks say ``None`` for "no timeout"; DSec's commands take at most 24 h, so
  ``None`` (and anything longer) becomes 24 h.
- Reads are streamed and stop at a cap, so a file the sandbox wrote never sits whole in the
  host's memory past what the caller allowed.
"""

from __future__ import annotations

import atexit
import importlib
import math
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from .._async import DSecClient, Sandbox
from .._core import resolve_settings
from ..errors import InvalidArgument
from ..models import DSecContainerRunArgs

#: The longest command DSec runs (``timeoutMs`` ≤ 86 400 000): what "no timeout" means here.
MAX_COMMAND_TIMEOUT_S = 86_400.0
#: The most output DSec keeps per stream of one command (``maxOutputBytes`` ≤ 64 MiB).
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
#: The longest TTL DSec accepts (7 days).
MAX_TTL_S = 7 * 24 * 3600
#: The TTL of a provider's sandbox when its framework names none.
DEFAULT_TTL_S = 3600

_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


def optional_module(name: str) -> Optional[ModuleType]:
    """The framework's module when it is installed, else ``None`` (never a partial import error)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def command_timeout(timeout: Optional[float], *, what: str = "timeout") -> float:
    """A framework's timeout in seconds as DSec takes it: ``None`` is the 24 h maximum."""
    if timeout is None:
        return MAX_COMMAND_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0:
        raise InvalidArgument(f"{what} must be a positive number of seconds or None, got {timeout!r}", field=what)
    return float(min(timeout, MAX_COMMAND_TIMEOUT_S))


def output_cap(limit: Optional[int], default: int, *, what: str = "max_output_bytes") -> int:
    """Bytes kept per stream: the caller's limit (1 … 64 MiB) or the provider's default."""
    if limit is None:
        return default
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"{what} must be a positive integer, got {limit!r}", field=what)
    return min(limit, MAX_OUTPUT_BYTES)


def ttl_seconds(seconds: Optional[float]) -> int:
    if seconds is None:
        return DEFAULT_TTL_S
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InvalidArgument(f"the sandbox lifetime must be positive seconds, got {seconds!r}", field="ttl")
    return int(min(math.ceil(seconds), MAX_TTL_S))


def labels_from(items: Iterable[str]) -> Dict[str, str]:
    """Framework labels (``"key=value"`` or a bare tag) as DSec's ``{key: value}``."""
    out: Dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not _LABEL_KEY.match(key):
            raise InvalidArgument(f"label {item!r}: keys are 1-63 chars of [A-Za-z0-9._/-]", field="labels")
        out[key] = value if sep else "true"
    return out


# --- the registry of live sandboxes ------------------------------------------


@dataclass
class _Registry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: sandbox ID -> (url, api key) of the apiserver it lives on.
    live: Dict[str, Tuple[str, Optional[str]]] = field(default_factory=dict)
    #: The process the entries belong to: a forked child inherits the dict (and the atexit hook)
    #: but must not stop its parent's sandboxes when it exits.
    pid: int = field(default_factory=os.getpid)


_REGISTRY = _Registry()


def _own() -> None:
    """Forgets entries inherited through ``fork`` (call with the lock held)."""
    if _REGISTRY.pid != os.getpid():
        _REGISTRY.live.clear()
        _REGISTRY.pid = os.getpid()


def register(sandbox_id: str, url: str, api_key: Optional[str]) -> None:
    with _REGISTRY.lock:
        _own()
        _REGISTRY.live[sandbox_id] = (url, api_key)


def unregister(sandbox_id: str) -> None:
    with _REGISTRY.lock:
        _REGISTRY.live.pop(sandbox_id, None)


def live_sandboxes() -> List[str]:
    """IDs of the sandboxes providers created and have not stopped yet (in this process)."""
    with _REGISTRY.lock:
        _own()
        return sorted(_REGISTRY.live)


def stop_leftovers() -> List[str]:
    """Stops, with the blocking client, every sandbox this process registered and has not
    stopped; returns their IDs. Runs at interpreter exit; safe to call by hand (e.g. from a
    signal handler). A forked child stops none of its parent's."""
    with _REGISTRY.lock:
        _own()
        leftovers = dict(_REGISTRY.live)
        _REGISTRY.live.clear()
    if not leftovers:
        return []
    from ..sync import DSecClient as BlockingClient

    by_server: Dict[Tuple[str, Optional[str]], List[str]] = {}
    for sandbox_id, server in leftovers.items():
        by_server.setdefault(server, []).append(sandbox_id)
    for (url, key), ids in by_server.items():
        try:
            with BlockingClient(url, key, timeout=10.0, max_retries=1) as client:
                for sandbox_id in ids:
                    try:
                        client.sandbox(sandbox_id).stop()
                    except Exception:  # noqa: BLE001 - exit-time best effort; the TTL is the backstop
                        pass
        except Exception:  # noqa: BLE001
            pass
    return sorted(leftovers)


atexit.register(stop_leftovers)


# --- creating and stopping ---------------------------------------------------


@dataclass
class SandboxSettings:
    """What a provider asks DSec for, whatever its framework calls it."""

    image: str
    ttl_s: Optional[float] = None
    memory_mb: Optional[int] = None
    cpus: Optional[float] = None
    disk_mb: Optional[int] = None
    env: Optional[Mapping[str, str]] = None
    labels: Optional[Mapping[str, str]] = None
    user: Optional[str] = None
    network_rules: Optional[Mapping[str, bool]] = None
    workspace: Optional[str] = None
    project_id: Optional[str] = None

    def run_args(self, provider: str) -> DSecContainerRunArgs:
        labels = {"dsec.provider": provider, **dict(self.labels or {})}
        return DSecContainerRunArgs(
            container_image=self.image,
            memory_limit_mb=self.memory_mb,
            cpu_cores_limit=self.cpus,
            ttl_running_stop=ttl_seconds(self.ttl_s),
            disk_limit_mb=self.disk_mb,
            env=dict(self.env) if self.env is not None else None,
            labels=labels,
            init_user=self.user,
            network_rules=dict(self.network_rules) if self.network_rules is not None else None,
            workspace=self.workspace,
            project_id=self.project_id,
            request_id=f"{provider}-{uuid.uuid4().hex}",
        )


@dataclass
class Connection:
    """A client and the settings it was made from (the exit-time clean-up needs the key)."""

    client: DSecClient
    url: str
    api_key: Optional[str]


def connect(url: Optional[str], api_key: Optional[str], *, timeout: float = 60.0) -> Connection:
    """A client for ``url``/``api_key`` (default ``DSEC_URL``/``DSEC_API_KEY``)."""
    resolved_url, key = resolve_settings(url, api_key)
    return Connection(DSecClient(resolved_url, key, timeout=timeout), resolved_url, key)


async def create_sandbox(conn: Connection, settings: SandboxSettings, provider: str, timeout: float) -> Sandbox:
    """Creates a sandbox with a TTL and registers it for exit-time clean-up."""
    sandbox = await conn.client.run_container(settings.run_args(provider), timeout=timeout)
    register(sandbox.id, conn.url, conn.api_key)
    return sandbox


async def stop_sandbox(sandbox: Sandbox) -> None:
    """Stops a sandbox (stopping twice is fine) and forgets it."""
    try:
        await sandbox.stop()
    finally:
        unregister(sandbox.id)


# --- capped reads -------------------------------------------------------------


@dataclass(frozen=True)
class CappedRead:
    data: bytes
    #: Bytes the file had from ``offset`` on as far as they were read (``data`` plus what was skipped past the cap).
    truncated: bool


async def read_capped(
    sandbox: Sandbox,
    path: str,
    limit: int,
    *,
    offset: int = 0,
    user: Optional[str] = None,
    timeout: Optional[float] = None,
) -> CappedRead:
    """Up to ``limit`` bytes of ``path`` from ``offset``; the stream is closed as soon as the
    limit is passed, so a huge file costs at most ``offset + limit`` bytes of transfer."""
    if offset < 0 or limit < 0:
        raise InvalidArgument("offset and limit must not be negative", field="offset")
    chunks: List[bytes] = []
    skipped = 0
    kept = 0
    truncated = False
    stream = sandbox.files.read_stream(path, user=user, timeout=timeout)
    try:
        async for chunk in stream:
            if skipped < offset:
                drop = min(offset - skipped, len(chunk))
                skipped += drop
                chunk = chunk[drop:]
                if not chunk:
                    continue
            room = limit - kept
            if len(chunk) > room:
                chunks.append(chunk[:room])
                kept += room
                truncated = True
                break
            chunks.append(chunk)
            kept += len(chunk)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return CappedRead(b"".join(chunks), truncated)


async def write_with_parents(
    sandbox: Sandbox,
    path: str,
    data: bytes,
    *,
    mode: Optional[int] = None,
    user: Optional[str] = None,
    timeout: Optional[float] = None,
) -> None:
    """Writes ``path``, creating its parent directories first (what every framework's write does)."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != "/":
        await sandbox.files.mkdir(parent, parents=True, user=user, timeout=timeout)
    await sandbox.files.write(path, data, mode=mode, user=user, timeout=timeout)

"""DSec as an inspect_ai sandbox: ``sandbox="dsec"``.

Implements inspect_ai's ``SandboxEnvironment`` as UKGovernmentBEIS/inspect_ai defines it at
commit 499e6152e7b8fc8cbd8ac5283536572aa6e4ab17 (``src/inspect_ai/util/_sandbox/environment.py``
and ``limits.py``). With inspect_ai installed, importing this module (which inspect does through
the ``inspect_ai`` entry point in python/pyproject.toml) registers ``DSecSandboxEnvironment``
under the name ``dsec`` and it subclasses inspect's base class, raising inspect's own
``OutputLimitExceededError``; without inspect_ai it is a plain class with the same methods and
errors (for tests and for use outside inspect).

Configuration (the ``config`` of ``SandboxEnvironmentSpec("dsec", config)``): a
``DSecSandboxConfig``, a path to a JSON file of its fields, or a path to a Dockerfile (built once
per task with DSec's Dockerfile builder; its directory is the build context). docs/integrations.md
describes each field.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .. import DSecClient, DSecContainerRunArgs
from ..errors import DSecError, InvalidArgument, NotFound, PermissionDenied
from ..models import CommandResult
from . import _provider_base as base

try:  # inspect_ai is optional: everything below works without it.
    from inspect_ai.util import ExecResult as _InspectExecResult
    from inspect_ai.util import OutputLimitExceededError as _InspectOutputLimitExceededError
    from inspect_ai.util import SandboxConnection as _InspectSandboxConnection
    from inspect_ai.util import SandboxEnvironment as _InspectSandboxEnvironment
    from inspect_ai.util import SandboxEnvironmentLimits as _InspectLimits
    from inspect_ai.util import sandboxenv as _inspect_sandboxenv

    HAVE_INSPECT = True
except ImportError:  # pragma: no cover - which branch runs depends on the machine
    HAVE_INSPECT = False

try:  # inspect_ai's configs are pydantic 2 models; with pydantic 1 (or none) a dataclass
    import pydantic as _pydantic
    from pydantic import BaseModel as _PydanticBaseModel

    HAVE_PYDANTIC = str(getattr(_pydantic, "VERSION", "1")).startswith("2")
except ImportError:  # pragma: no cover
    HAVE_PYDANTIC = False

#: inspect's defaults (limits.py), used when inspect_ai is not installed; the same environment
#: variables override them.
DEFAULT_MAX_EXEC_OUTPUT_SIZE = 10 * 1024**2
DEFAULT_MAX_READ_FILE_SIZE = 100 * 1024**2
#: The most output per stream a DSec command keeps (``maxOutputBytes``' bound on the API).
DSEC_MAX_OUTPUT_BYTES = 64 * 1024**2
#: Name inspect resolves ``sandbox="dsec"`` by.
SANDBOX_TYPE = "dsec"


def _human_size(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _env_limit(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer (bytes), got '{raw}'.") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer (bytes), got {value}.")
    return value


def max_exec_output_size() -> Tuple[int, str]:
    """inspect's exec output limit per stream (bytes, and as inspect prints it)."""
    if HAVE_INSPECT:
        return int(_InspectLimits.MAX_EXEC_OUTPUT_SIZE), str(_InspectLimits.MAX_EXEC_OUTPUT_SIZE_STR)
    n = _env_limit("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", DEFAULT_MAX_EXEC_OUTPUT_SIZE)
    return n, _human_size(n)


def max_read_file_size() -> Tuple[int, str]:
    """inspect's ``read_file`` size limit (bytes, and as inspect prints it)."""
    if HAVE_INSPECT:
        return int(_InspectLimits.MAX_READ_FILE_SIZE), str(_InspectLimits.MAX_READ_FILE_SIZE_STR)
    n = _env_limit("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", DEFAULT_MAX_READ_FILE_SIZE)
    return n, _human_size(n)


if HAVE_INSPECT:
    OutputLimitExceededError = _InspectOutputLimitExceededError
    ExecResult = _InspectExecResult
    SandboxConnection = _InspectSandboxConnection
    _Base: Any = _InspectSandboxEnvironment
    try:
        from inspect_ai.util._sandbox.environment import SandboxUnavailableError
    except ImportError:  # older inspect_ai

        class SandboxUnavailableError(RuntimeError):  # type: ignore[no-redef]
            """The sandbox is gone or unreachable."""

else:

    class OutputLimitExceededError(Exception):  # type: ignore[no-redef]
        """inspect's ``OutputLimitExceededError``: an output stream or file went past its limit."""

        def __init__(self, limit_str: str, truncated_output: Optional[str]) -> None:
            self.limit_str = limit_str
            self.truncated_output = truncated_output
            super().__init__(f"The sandbox output stream limit of {self.limit_str} was exceeded.")

    class SandboxUnavailableError(RuntimeError):  # type: ignore[no-redef]
        """inspect's ``SandboxUnavailableError``: the sandbox is gone or unreachable."""

    @dataclass
    class ExecResult:  # type: ignore[no-redef]
        """inspect's ``ExecResult[str]``."""

        success: bool
        returncode: int
        stdout: str
        stderr: str

    @dataclass
    class SandboxConnection:  # type: ignore[no-redef]
        """inspect's ``SandboxConnection``."""

        type: str
        command: str
        vscode_command: Optional[List[Any]] = None
        ports: Optional[List[Any]] = None
        container: Optional[str] = None

    class _PlainBase:
        """Stands in for inspect's ``SandboxEnvironment`` when inspect_ai is not installed."""

    _Base = _PlainBase


_CONFIG_DOC = {
    "image": "DSec image of the sandbox (name or name:version); ignored when dockerfile is set",
    "dockerfile": "a Dockerfile to build with DSec's builder (its directory is the context)",
    "url": "the apiserver (default DSEC_URL)",
    "api_key": "the API key (default DSEC_API_KEY)",
    "user": "the sandbox's init user (default the image's, root)",
    "workdir": "the per-sample working directory (default the user's home as the sandbox reports it)",
    "memory_mb": "memory limit",
    "cpus": "CPU cores",
    "disk_mb": "writable-layer quota",
    "ttl_seconds": "TTL backstop: the sandbox stops by itself this long after creation",
    "network_rules": "named egress rules ({'pypi': True})",
    "env": "environment of every command",
    "labels": "extra labels on every sandbox",
    "build_timeout": "seconds a Dockerfile build may take",
}

if HAVE_PYDANTIC:

    class DSecSandboxConfig(_PydanticBaseModel):  # type: ignore[misc,valid-type]
        """Configuration of the ``dsec`` sandbox (field meanings: docs/integrations.md)."""

        model_config = {"frozen": True, "extra": "forbid"}

        image: str = "debian"
        dockerfile: Optional[str] = None
        url: Optional[str] = None
        api_key: Optional[str] = None
        user: Optional[str] = None
        workdir: Optional[str] = None
        memory_mb: Optional[int] = None
        cpus: Optional[float] = None
        disk_mb: Optional[int] = None
        ttl_seconds: int = base.DEFAULT_TTL_SECONDS
        network_rules: Optional[Dict[str, bool]] = None
        env: Optional[Dict[str, str]] = None
        labels: Optional[Dict[str, str]] = None
        build_timeout: Optional[float] = None

        def __hash__(self) -> int:  # inspect's specs are frozen (hashed) models; dicts are not hashable
            return hash(_config_key(self))

else:

    @dataclass(frozen=True)
    class DSecSandboxConfig:  # type: ignore[no-redef]
        """Configuration of the ``dsec`` sandbox (field meanings: docs/integrations.md)."""

        image: str = "debian"
        dockerfile: Optional[str] = None
        url: Optional[str] = None
        api_key: Optional[str] = None
        user: Optional[str] = None
        workdir: Optional[str] = None
        memory_mb: Optional[int] = None
        cpus: Optional[float] = None
        disk_mb: Optional[int] = None
        ttl_seconds: int = base.DEFAULT_TTL_SECONDS
        network_rules: Optional[Dict[str, bool]] = None
        env: Optional[Dict[str, str]] = None
        labels: Optional[Dict[str, str]] = None
        build_timeout: Optional[float] = None

        def __hash__(self) -> int:  # inspect's specs are frozen (hashed) models; dicts are not hashable
            return hash(_config_key(self))


#: Largest JSON config file read (a config is a handful of fields).
MAX_CONFIG_FILE_BYTES = 1024 * 1024


_STR = ("image", "dockerfile", "url", "api_key", "user", "workdir")
_INT = ("memory_mb", "disk_mb", "ttl_seconds")
_NUM = ("cpus", "build_timeout")
_MAPS = {"network_rules": bool, "env": str, "labels": str}


def _check_config(raw: Mapping[str, Any]) -> None:
    """Type checks of every field (the plain dataclass does none; pydantic coerces more)."""
    for name, value in raw.items():
        if value is None and name not in ("image", "ttl_seconds"):
            continue
        if name in _STR and isinstance(value, str):
            continue
        if name in _INT and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            continue
        if name in _NUM and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            continue
        if name in _MAPS and isinstance(value, Mapping):
            if all(isinstance(k, str) and isinstance(v, _MAPS[name]) for k, v in value.items()):
                continue
        raise InvalidArgument(f"dsec sandbox config field {name} cannot be {value!r}", field="config")


def _config_from_dict(raw: Mapping[str, Any]) -> "DSecSandboxConfig":
    known = set(_CONFIG_DOC)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidArgument(f"unknown dsec sandbox config field(s): {', '.join(unknown)}", field="config")
    _check_config(raw)
    try:
        return DSecSandboxConfig(**dict(raw))
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"invalid dsec sandbox config: {err}", field="config") from None


def resolve_config(config: Any) -> "DSecSandboxConfig":
    """A ``DSecSandboxConfig`` from what inspect passes: ``None``, a config object, a dict, a
    path to a JSON file of its fields, or a path to a Dockerfile."""
    if config is None:
        return DSecSandboxConfig()
    if isinstance(config, DSecSandboxConfig):
        return config
    if isinstance(config, Mapping):
        return _config_from_dict(config)
    if isinstance(config, str):
        path = Path(config)
        if path.name == "Dockerfile" or path.name.endswith(".Dockerfile") or path.name.startswith("Dockerfile."):
            if not path.is_file():
                raise InvalidArgument(f"{config}: no such Dockerfile", field="config")
            return DSecSandboxConfig(dockerfile=str(path.resolve()))
        if path.suffix == ".json":
            try:
                size = path.stat().st_size
            except OSError as err:
                raise InvalidArgument(f"{config}: {err.strerror}", field="config") from None
            if size > MAX_CONFIG_FILE_BYTES:
                raise InvalidArgument(f"{config}: larger than {MAX_CONFIG_FILE_BYTES} bytes", field="config")
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as err:
                raise InvalidArgument(f"{config}: not JSON: {err}", field="config") from None
            if not isinstance(raw, dict):
                raise InvalidArgument(f"{config}: must hold a JSON object", field="config")
            return _config_from_dict(raw)
        raise InvalidArgument(
            f"{config}: the dsec sandbox takes a DSecSandboxConfig, a .json file of one, or a Dockerfile "
            "(compose files are not supported)",
            field="config",
        )
    raise InvalidArgument(f"the dsec sandbox cannot use a config of type {type(config).__name__}", field="config")


def _config_key(config: "DSecSandboxConfig") -> str:
    values = {f: getattr(config, f) for f in _CONFIG_DOC}
    return json.dumps(values, sort_keys=True, default=str)


@dataclass
class _TaskState:
    """What ``task_init`` set up for one task and config: the client, the image, the run label."""

    client: DSecClient
    image: str
    run: str
    sandboxes: Dict[str, Any] = field(default_factory=dict)


class DSecSandboxEnvironment(_Base):  # type: ignore[misc,valid-type]
    """One DSec sandbox as an inspect_ai ``SandboxEnvironment``."""

    _tasks: Dict[Tuple[str, str], _TaskState] = {}

    def __init__(self, sandbox: Any, client: DSecClient, config: "DSecSandboxConfig", workdir: str) -> None:
        if HAVE_INSPECT:
            super().__init__()
        self._sandbox = sandbox
        self._client = client
        self._config = config
        #: The per-sample working directory: relative paths and a missing ``cwd`` resolve here.
        self.workdir = workdir

    async def _load_identity(self) -> None:
        # The sandbox user's uid and groups, for write_file's permission check (writes are a
        # rename over the path, which the file's own mode bits would not stop).
        self._uid: Optional[int] = None
        self._groups: Tuple[int, ...] = ()
        try:
            uid = await self._sandbox.exec(["id", "-u"], timeout=60)
            groups = await self._sandbox.exec(["id", "-G"], timeout=60)
        except DSecError:
            return
        if uid.ok and uid.stdout.strip().isdigit():
            self._uid = int(uid.stdout.strip())
            self._groups = tuple(int(g) for g in groups.stdout.split() if g.isdigit()) if groups.ok else ()

    def _may_write(self, info: Any) -> bool:
        uid = getattr(self, "_uid", None)
        if uid is None or uid == 0:
            return True
        if info.uid == uid:
            return bool(info.mode & 0o200)
        if info.gid in self._groups:
            return bool(info.mode & 0o020)
        return bool(info.mode & 0o002)

    @property
    def sandbox_id(self) -> str:
        return str(self._sandbox.id)

    # --- lifecycle (classmethods inspect calls) ----------------------------

    @classmethod
    def config_files(cls) -> List[str]:
        return []

    @classmethod
    def default_concurrency(cls) -> Optional[int]:
        return None

    @classmethod
    def config_deserialize(cls, config: Dict[str, Any]) -> Any:
        return _config_from_dict(config)

    _task_locks: Dict[Tuple[int, str, str], asyncio.Lock] = {}

    @classmethod
    async def _task_state(cls, task_name: str, config: Any) -> _TaskState:
        resolved = resolve_config(config)
        key = (task_name, _config_key(resolved))
        # Samples may start concurrently (before or without task_init): one state per task.
        lock = cls._task_locks.setdefault((id(asyncio.get_running_loop()), *key), asyncio.Lock())
        async with lock:
            state = cls._tasks.get(key)
            if state is not None:
                return state
            state = await cls._new_task_state(task_name, resolved)
            cls._tasks[key] = state
            return state

    @classmethod
    async def _new_task_state(cls, task_name: str, resolved: "DSecSandboxConfig") -> _TaskState:
        client = await base.acquire_client(resolved.url, resolved.api_key)
        try:
            image = resolved.image
            if resolved.dockerfile:
                dockerfile = Path(resolved.dockerfile)
                image = await base.build_context_image(
                    client,
                    dockerfile.parent,
                    prefix="inspect",
                    name=task_name,
                    dockerfile=dockerfile.name,
                    timeout=resolved.build_timeout,
                )
        except BaseException:
            await base.release_client(client)
            raise
        return _TaskState(client=client, image=image, run=f"inspect-{uuid.uuid4().hex[:12]}")

    @classmethod
    async def task_init(cls, task_name: str, config: Any) -> None:
        """Checks the config and the server, and builds the Dockerfile if the config names one."""
        await cls._task_state(task_name, config)

    @classmethod
    async def sample_init(
        cls, task_name: str, config: Any, metadata: Dict[str, str]
    ) -> Dict[str, "DSecSandboxEnvironment"]:
        """Starts one sandbox for the sample (the ``default`` environment)."""
        resolved = resolve_config(config)
        state = await cls._task_state(task_name, resolved)
        labels = {
            **(resolved.labels or {}),
            base.PROVIDER_LABEL: "inspect_ai",
            "inspect-task": base.label_value(task_name),
            "inspect-run": state.run,
        }
        args = DSecContainerRunArgs(
            container_image=state.image,
            memory_limit_mb=resolved.memory_mb,
            cpu_cores_limit=resolved.cpus,
            disk_limit_mb=resolved.disk_mb,
            ttl_running_stop=resolved.ttl_seconds,
            network_rules=resolved.network_rules,
            init_user=resolved.user,
            env=resolved.env,
            labels=labels,
        )
        sandbox = await state.client.run_container(args)
        try:
            workdir = resolved.workdir
            if workdir is None:
                result = await sandbox.exec(["pwd"], timeout=60)
                workdir = result.stdout.strip() if result.ok and result.stdout.startswith("/") else "/"
            elif not workdir.startswith("/"):
                raise InvalidArgument("workdir must be an absolute path", field="workdir")
            else:
                await sandbox.files.mkdir(workdir, parents=True)
        except BaseException:
            await base.stop_quietly(sandbox)
            raise
        state.sandboxes[sandbox.id] = sandbox
        env = cls(sandbox, state.client, resolved, workdir)
        await env._load_identity()
        return {"default": env}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: Any,
        environments: Dict[str, Any],
        interrupted: bool,
    ) -> None:
        """Stops the sample's sandboxes (also when it was interrupted)."""
        for env in environments.values():
            if isinstance(env, DSecSandboxEnvironment):
                await base.stop_quietly(env._sandbox)
                for state in cls._tasks.values():
                    state.sandboxes.pop(env.sandbox_id, None)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: Any, cleanup: bool) -> None:
        """Stops whatever sandbox of the task's run is left (unless ``cleanup`` is False, when
        they are kept for inspection until their TTL) and closes the client."""
        resolved = resolve_config(config)
        key = (task_name, _config_key(resolved))
        state = cls._tasks.pop(key, None)
        cls._task_locks.pop((id(asyncio.get_running_loop()), *key), None)
        if state is None:
            return
        try:
            if cleanup:
                await state.client.stop_job({"inspect-run": state.run})
        finally:
            await base.release_client(state.client)

    @classmethod
    async def cli_cleanup(cls, id: Optional[str]) -> None:
        """``inspect sandbox cleanup dsec [ID]``: stops one sandbox, or every sandbox this
        provider started that the key can see."""
        client = await base.acquire_client(None, None)
        try:
            if id:
                await base.stop_quietly(client.sandbox(id))
            else:
                await client.stop_job({base.PROVIDER_LABEL: "inspect_ai"})
        finally:
            await base.release_client(client)

    # --- the sandbox interface --------------------------------------------

    def _path(self, file: str) -> str:
        return base.resolve_path(self.workdir, file)

    async def exec(
        self,
        cmd: List[str],
        input: Union[str, bytes, None] = None,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        timeout: Optional[int] = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> Any:
        """Runs ``cmd`` (argv, no shell) in the sandbox. ``TimeoutError`` past ``timeout``
        (the whole process tree is killed; DSec does not retry it), ``PermissionError`` when
        the program cannot be executed, ``OutputLimitExceededError`` when a stream passes
        inspect's exec output limit, ``SandboxUnavailableError`` when the sandbox is gone. A
        missing program, a missing ``cwd`` or an unknown ``user`` is a failed ``ExecResult``
        saying so."""
        if isinstance(cmd, str) or not cmd:
            raise ValueError("cmd must be a non-empty list of arguments")
        limit, limit_str = max_exec_output_size()
        options: Dict[str, Any] = {
            "timeout": timeout,
            "env": env,
            "cwd": self._path(cwd) if cwd is not None else self.workdir,
            "user": user,
            "max_output_bytes": min(limit, DSEC_MAX_OUTPUT_BYTES),
        }
        try:
            try:
                result = await self._run(list(cmd), input, options)
            except InvalidArgument as err:
                # Another user may not enter the per-sample directory (root's home): without
                # an explicit cwd the command then starts where the sandbox starts that user.
                if cwd is not None or user is None or "spawn failed: chdir" not in err.message:
                    raise
                result = await self._run(list(cmd), input, {**options, "cwd": None})
        except InvalidArgument as err:
            return self._spawn_failure(err, cmd, user)
        except DSecError as err:
            if base.is_gone(err):
                raise SandboxUnavailableError(f"sandbox {self.sandbox_id} is unavailable: {err.message}") from err
            raise
        if result.outcome == "timeout":
            raise TimeoutError(f"command timed out after {timeout} seconds: {cmd[0]}")
        if result.truncated or max(result.stdout_bytes, result.stderr_bytes) > limit:
            raise OutputLimitExceededError(limit_str, truncated_output=result.stdout)
        return ExecResult(
            success=result.exit_code == 0 and result.outcome == "exited",
            returncode=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
        )

    async def _run(self, cmd: List[str], data: Union[str, bytes, None], options: Dict[str, Any]) -> CommandResult:
        if data is None:
            result: CommandResult = await self._sandbox.exec(cmd, **options)
            return result
        return await self._exec_with_input(cmd, data, options)

    async def _exec_with_input(self, cmd: List[str], data: Union[str, bytes], options: Dict[str, Any]) -> CommandResult:
        # stdin of any size and any bytes: stream it to a background command, then wait.
        payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        handle = await self._sandbox.commands.start(cmd, stdin_open=True, **options)
        try:
            await handle.send_stdin(payload, eof=True)
        except DSecError as err:
            # A command that exits without reading all its stdin closes the pipe; its result
            # is still the answer. A sandbox that went away is not.
            if base.is_gone(err):
                raise
        result: CommandResult = await handle.wait()
        return result

    def _spawn_failure(self, err: InvalidArgument, cmd: List[str], user: Optional[str]) -> Any:
        code = str(err.details.get("errno", ""))
        # The server says which step of the spawn failed: entering cwd is not executing.
        entering_cwd = "spawn failed: chdir" in err.message
        if err.field == "argv" and code in ("EACCES", "EPERM") and not entering_cwd:
            raise PermissionError(errno.EACCES, f"permission denied executing {cmd[0]}: {err.message}", cmd[0])
        if err.field in ("argv", "user", "cwd"):
            # What a shell would print: the program, the directory or the user is not there.
            who = f" (user {user})" if err.field == "user" else ""
            status = 127 if err.field == "argv" and code == "ENOENT" and not entering_cwd else 126
            return ExecResult(success=False, returncode=status, stdout="", stderr=f"{err.message}{who}\n")
        raise err

    async def write_file(self, file: str, contents: Union[str, bytes]) -> None:
        """Writes a file, creating missing parent directories. ``IsADirectoryError`` when a
        directory is there, ``PermissionError`` when the sandbox's user may not write it."""
        path = self._path(file)
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        try:
            if getattr(self, "_uid", None) not in (None, 0):
                try:
                    info = await self._sandbox.files.stat(path)
                except NotFound:
                    info = None
                if info is not None and info.type == "file" and not self._may_write(info):
                    raise PermissionError(errno.EACCES, "permission denied: the file is not writable", file)
            try:
                await self._sandbox.files.write(path, data)
            except NotFound:
                parent = path.rsplit("/", 1)[0] or "/"
                try:
                    await self._sandbox.files.mkdir(parent, parents=True)
                except InvalidArgument as err:
                    # mkdir -p reports a refused parent as its own failure text
                    if "Permission denied" in err.message:
                        raise PermissionError(errno.EACCES, f"permission denied: {err.message}", file) from None
                    raise
                await self._sandbox.files.write(path, data)
        except DSecError as err:
            raise await self._file_error(err, path, file) from None

    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        """Reads a file (text: UTF-8, newlines kept as they are). ``FileNotFoundError``,
        ``IsADirectoryError``, ``PermissionError``, ``UnicodeDecodeError``, and
        ``OutputLimitExceededError`` past inspect's read limit: at most that many bytes are
        ever transferred."""
        path = self._path(file)
        limit, limit_str = max_read_file_size()
        try:
            info = await self._sandbox.files.stat(path)
            kind = info.type if info.type != "symlink" else await self._followed_type(path)
            if kind == "directory":
                raise IsADirectoryError(errno.EISDIR, "is a directory", file)
            if kind != "file":
                # A fifo or device would block or never end the read: only regular files.
                raise OSError(errno.EINVAL, f"not a regular file ({kind})", file)
            if info.type == "file" and info.size > limit:
                raise OutputLimitExceededError(limit_str, truncated_output=None)
            chunks: List[bytes] = []
            size = 0
            stream = self._sandbox.files.read_stream(path)
            try:
                async for chunk in stream:
                    size += len(chunk)
                    if size > limit:
                        raise OutputLimitExceededError(limit_str, truncated_output=None)
                    chunks.append(chunk)
            finally:
                await stream.aclose()
        except DSecError as err:
            raise await self._file_error(err, path, file) from None
        data = b"".join(chunks)
        return data.decode("utf-8") if text else data

    async def _followed_type(self, path: str) -> str:
        # The files API's stat does not follow a final symlink; `test` does, in the sandbox.
        for flag, kind in (("-f", "file"), ("-d", "directory")):
            result = await self._sandbox.exec(["test", flag, path], timeout=60)
            if result.ok:
                return kind
        missing = await self._sandbox.exec(["test", "-e", path], timeout=60)
        if not missing.ok:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory (dangling symlink)", path)
        return "special"

    async def _file_error(self, err: DSecError, path: str, file: str) -> BaseException:
        if isinstance(err, NotFound) and not base.is_gone(err):
            return FileNotFoundError(errno.ENOENT, f"no such file or directory: {err.message}", file)
        if isinstance(err, PermissionDenied):
            return PermissionError(errno.EACCES, f"permission denied: {err.message}", file)
        if isinstance(err, InvalidArgument) and err.field == "path":
            try:
                info = await self._sandbox.files.stat(path)
            except DSecError:
                return err
            if info.type == "directory":
                return IsADirectoryError(errno.EISDIR, "is a directory", file)
            return OSError(errno.EINVAL, err.message, file)
        if base.is_gone(err):
            return SandboxUnavailableError(f"sandbox {self.sandbox_id} is unavailable: {err.message}")
        return err

    async def connection(self, *, user: Optional[str] = None) -> Any:
        """How to get a shell in the sandbox: ``dsec sandbox shell ID``."""
        command = f"dsec sandbox shell {self.sandbox_id}"
        if user:
            command += f" --user {user}"
        return SandboxConnection(type=SANDBOX_TYPE, command=command, container=self.sandbox_id)


if HAVE_INSPECT:
    _inspect_sandboxenv(name=SANDBOX_TYPE)(DSecSandboxEnvironment)

__all__ = [
    "DSecSandboxEnvironment",
    "DSecSandboxConfig",
    "ExecResult",
    "OutputLimitExceededError",
    "SandboxConnection",
    "SandboxUnavailableError",
    "HAVE_INSPECT",
    "resolve_config",
    "max_exec_output_size",
    "max_read_file_size",
]

"""DSec as a Harbor environment: ``import_path: dsec.integrations.harbor:DSecEnvironment``.

Implements Harbor's ``BaseEnvironment`` (``src/harbor/environments/base.py``) as the fork
LegoX/harbor has it at commit 73fd120e731217b38f31667932ea26a28cdd4fff (the upstream
laude-institute/harbor could not be fetched here; docs/eval.md read the same commit). With Harbor
installed ``DSecEnvironment`` subclasses its ``BaseEnvironment`` and returns its ``ExecResult``;
without it, it is a plain class with the same constructor, methods and results.

Per trial it builds the task's ``environment/Dockerfile`` with DSec's Dockerfile builder through
the API (``client.build_image``; a context builds once, its image named by a digest of it), or
uses ``[environment] docker_image`` (built as ``FROM`` that image), or a prebuilt DSec image
given as the ``image`` kwarg; then runs one sandbox of it with the task's cpus, memory and storage.
Harbor's environment kwargs (``environment.kwargs`` in a trial or job config) are this class's
keyword arguments; docs/integrations.md lists them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import stat as stat_mod
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Mapping, Optional, Union

from .. import DSecClient, DSecContainerRunArgs
from ..errors import DSecError, InvalidArgument, NotFound
from . import _provider_base as base

try:  # Harbor is optional: everything below works without it.
    from harbor.environments.base import BaseEnvironment as _HarborBaseEnvironment
    from harbor.environments.base import ExecResult as _HarborExecResult

    HAVE_HARBOR = True
except ImportError:  # pragma: no cover - which branch runs depends on the machine
    HAVE_HARBOR = False

#: Where Harbor's agent and verifier write logs inside the environment (its EnvironmentPaths).
LOGS_DIRS = ("/logs", "/logs/agent", "/logs/verifier", "/logs/artifacts")
#: Output kept per stream of one ``exec`` (DSec keeps head and tail past it).
DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024**2


class DSecEnvironmentType(str, enum.Enum):
    """What ``DSecEnvironment.type()`` returns: Harbor's own enum has no member for a provider
    loaded by import path, and Harbor only reads ``.value`` of it."""

    DSEC = "dsec"


if HAVE_HARBOR:
    ExecResult: Any = _HarborExecResult
    _Base: Any = _HarborBaseEnvironment
else:

    @dataclass
    class ExecResult:  # type: ignore[no-redef]
        """Harbor's ``ExecResult``."""

        return_code: int
        stdout: Optional[str] = None
        stderr: Optional[str] = None

    class _PlainBase:
        """Stands in for Harbor's ``BaseEnvironment`` when Harbor is not installed: the same
        constructor arguments and the two helpers the interface relies on."""

        def __init__(
            self,
            environment_dir: Path,
            environment_name: str,
            session_id: str,
            trial_paths: Any,
            task_env_config: Any,
            logger: Optional[logging.Logger] = None,
            override_cpus: Optional[int] = None,
            override_memory_mb: Optional[int] = None,
            override_storage_mb: Optional[int] = None,
            override_gpus: Optional[int] = None,
            suppress_override_warnings: bool = False,
            persistent_env: Optional[Dict[str, str]] = None,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            self.environment_dir = Path(environment_dir)
            self.environment_name = environment_name
            self.session_id = session_id
            self.trial_paths = trial_paths
            self.task_env_config = task_env_config
            self.default_user: Union[str, int, None] = None
            self.logger = (logger or logging.getLogger("dsec.integrations.harbor")).getChild(__name__)
            for attr, value in (
                ("cpus", override_cpus),
                ("memory_mb", override_memory_mb),
                ("storage_mb", override_storage_mb),
                ("gpus", override_gpus),
            ):
                if value is not None:
                    setattr(task_env_config, attr, value)
            task_env = dict(getattr(task_env_config, "env", None) or {})
            self._persistent_env: Dict[str, str] = {**task_env, **(persistent_env or {})}
            self._validate_definition()
            if (getattr(task_env_config, "gpus", 0) or 0) > 0:
                raise RuntimeError("the dsec environment does not support GPU allocation")

        def _resolve_user(self, user: Union[str, int, None]) -> Union[str, int, None]:
            return user if user is not None else self.default_user

        def _merge_env(self, env: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
            if not self._persistent_env and not env:
                return None
            return {**self._persistent_env, **(env or {})} or None

        def _validate_definition(self) -> None:  # overridden below
            pass

    _Base = _PlainBase


_build_locks: Dict[tuple, asyncio.Lock] = {}


class DSecEnvironment(_Base):  # type: ignore[misc,valid-type]
    """A Harbor environment backed by one DSec sandbox per trial.

    Keyword arguments (Harbor's ``environment.kwargs``): ``url``, ``api_key`` (default
    ``DSEC_URL``/``DSEC_API_KEY``); ``image``, a prebuilt DSec image (skips the build);
    ``shell`` that runs each command (``bash``, as Harbor's Docker environment; ``sh`` for
    images without bash); ``ttl_seconds``, the sandbox's TTL backstop; ``network_rules``,
    DSec's named egress rules; ``labels``; ``build_timeout_sec`` (default the task's);
    ``max_output_bytes`` kept per stream of a command; ``keep_sandbox`` to leave the sandbox
    running at ``stop`` (until its TTL)."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        image: Optional[str] = None,
        shell: str = "bash",
        ttl_seconds: int = base.DEFAULT_TTL_SECONDS,
        network_rules: Optional[Mapping[str, bool]] = None,
        labels: Optional[Mapping[str, str]] = None,
        build_timeout_sec: Optional[float] = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        keep_sandbox: bool = False,
        **kwargs: Any,
    ) -> None:
        # Set before the base constructor: it calls _validate_definition.
        self._url = url
        self._api_key = api_key
        self._image = image
        if not shell or "\0" in shell:
            raise InvalidArgument("shell must name a program", field="shell")
        self._shell = shell
        if not isinstance(ttl_seconds, int) or ttl_seconds <= 0:
            raise InvalidArgument("ttl_seconds must be a positive integer", field="ttl_seconds")
        self._ttl_seconds = ttl_seconds
        self._network_rules = dict(network_rules) if network_rules else None
        self._labels = dict(labels or {})
        self._build_timeout_sec = build_timeout_sec
        if not isinstance(max_output_bytes, int) or not 0 < max_output_bytes <= 64 * 1024**2:
            raise InvalidArgument("max_output_bytes must be 1..67108864", field="max_output_bytes")
        self._max_output_bytes = max_output_bytes
        self._keep_sandbox = keep_sandbox
        self._client: Optional[DSecClient] = None
        self._sandbox: Any = None
        #: The DSec image the sandbox runs, once ``start`` resolved it.
        self.image: Optional[str] = image
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args, **kwargs)

    # --- what Harbor asks of an environment type --------------------------

    @staticmethod
    def type() -> Any:
        return DSecEnvironmentType.DSEC

    @property
    def is_mounted(self) -> bool:
        # Logs are not bind-mounted: Harbor downloads /logs through download_dir.
        return False

    @property
    def supports_gpus(self) -> bool:
        return False

    @property
    def can_disable_internet(self) -> bool:
        # DSec denies egress unless rules allow it.
        return True

    @property
    def sandbox_id(self) -> Optional[str]:
        return None if self._sandbox is None else str(self._sandbox.id)

    @property
    def _dockerfile_path(self) -> Path:
        return Path(self.environment_dir) / "Dockerfile"

    def _validate_definition(self) -> None:
        if self._image or getattr(self.task_env_config, "docker_image", None):
            return
        if not self._dockerfile_path.is_file():
            raise FileNotFoundError(f"{self._dockerfile_path} not found, and no image was given")

    def _require(self) -> Any:
        if self._sandbox is None:
            raise RuntimeError("the dsec environment is not started")
        return self._sandbox

    # --- lifecycle ----------------------------------------------------------

    async def _resolve_image(self, client: DSecClient, force_build: bool) -> str:
        if self._image:
            return self._image
        timeout = self._build_timeout_sec or getattr(self.task_env_config, "build_timeout_sec", None)
        docker_image = getattr(self.task_env_config, "docker_image", None)
        if docker_image and (force_build is False or not self._dockerfile_path.is_file()):
            # A registry image: DSec's builder pulls it as a one-line Dockerfile.
            if any(c in docker_image for c in "\n\r\0 "):
                raise InvalidArgument(f"docker_image is not an image reference: {docker_image!r}", field="docker_image")
            with tempfile.TemporaryDirectory(prefix="dsec-harbor-") as context:
                (Path(context) / "Dockerfile").write_text(f"FROM {docker_image}\n")
                return await self._build(client, Path(context), timeout)
        return await self._build(client, Path(self.environment_dir), timeout)

    async def _build(self, client: DSecClient, context: Path, timeout: Optional[float]) -> str:
        digest = await asyncio.get_running_loop().run_in_executor(None, base.context_digest, context, "Dockerfile")
        # An asyncio lock belongs to one event loop: one lock per loop and context.
        lock = _build_locks.setdefault((id(asyncio.get_running_loop()), digest), asyncio.Lock())
        async with lock:  # trials of one task build once, the others wait for it
            return await base.build_context_image(
                client, context, prefix="harbor", name=self.environment_name, timeout=timeout
            )

    async def start(self, force_build: bool) -> None:
        """Builds (or reuses) the image and starts the trial's sandbox with the task's
        resources, then makes Harbor's log directories (world-writable, as Harbor's Docker
        environment does)."""
        if self._sandbox is not None:
            raise RuntimeError("the dsec environment is already started")
        client = await base.acquire_client(self._url, self._api_key)
        try:
            self.image = await self._resolve_image(client, force_build)
            config = self.task_env_config
            if getattr(config, "allow_internet", True) and not self._network_rules:
                self.logger.info("dsec: egress follows DSec's policy (denied unless network_rules allow it)")
            args = DSecContainerRunArgs(
                container_image=self.image,
                cpu_cores_limit=getattr(config, "cpus", None),
                memory_limit_mb=getattr(config, "memory_mb", None),
                disk_limit_mb=getattr(config, "storage_mb", None),
                ttl_running_stop=self._ttl_seconds,
                network_rules=self._network_rules,
                env=self._persistent_env or None,
                labels={
                    **self._labels,
                    base.PROVIDER_LABEL: "harbor",
                    "harbor-session": base.label_value(self.session_id),
                    "harbor-environment": base.label_value(self.environment_name),
                },
            )
            sandbox = await client.run_container(args)
        except BaseException:
            await base.release_client(client)
            raise
        self._client = client
        self._sandbox = sandbox
        try:
            for path in LOGS_DIRS:
                await sandbox.files.mkdir(path, parents=True, mode=0o777, user="root")
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        """Stops the sandbox (unless ``keep_sandbox``, when its TTL does) and releases the
        client. The built image stays: other trials of the task use it."""
        sandbox, client = self._sandbox, self._client
        self._sandbox = None
        self._client = None
        try:
            if sandbox is not None:
                if self._keep_sandbox:
                    self.logger.info(f"dsec: keeping sandbox {sandbox.id} until its TTL")
                else:
                    await base.stop_quietly(sandbox)
        finally:
            if client is not None:
                await base.release_client(client)

    # --- commands -------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout_sec: Optional[int] = None,
        user: Union[str, int, None] = None,
    ) -> Any:
        """Runs ``command`` with ``shell -c`` (as Harbor's Docker environment runs ``bash -c``).
        Past ``timeout_sec`` the process tree is killed and ``RuntimeError`` raised, as Harbor's
        Docker environment does; a command that cannot start (no shell, no ``cwd``, unknown
        ``user``) is a failed result saying why."""
        sandbox = self._require()
        resolved_user = self._resolve_user(user)
        try:
            result = await sandbox.exec(
                [self._shell, "-c", command],
                timeout=timeout_sec,
                env=self._merge_env(env),
                cwd=cwd,
                user=None if resolved_user is None else str(resolved_user),
                max_output_bytes=self._max_output_bytes,
            )
        except InvalidArgument as err:
            if err.field not in ("argv", "user", "cwd"):
                raise
            status = 127 if str(err.details.get("errno")) == "ENOENT" and "chdir" not in err.message else 126
            return ExecResult(return_code=status, stdout=None, stderr=err.message + "\n")
        if result.outcome == "timeout":
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(return_code=result.exit_code, stdout=result.stdout or None, stderr=result.stderr or None)

    async def is_dir(self, path: str, user: Union[str, int, None] = None) -> bool:
        return await self._is_type(path, "directory", user)

    async def is_file(self, path: str, user: Union[str, int, None] = None) -> bool:
        return await self._is_type(path, "file", user)

    async def _is_type(self, path: str, kind: str, user: Union[str, int, None]) -> bool:
        sandbox = self._require()
        resolved = self._resolve_user(user)
        try:
            info = await sandbox.files.stat(path, user=None if resolved is None else str(resolved))
        except NotFound:
            return False
        if info.type == "symlink":  # test -d / -f follow the link
            flag = "-d" if kind == "directory" else "-f"
            result = await sandbox.exec(["test", flag, path], user=None if resolved is None else str(resolved))
            return bool(result.ok)
        return bool(info.type == kind)

    # --- files ----------------------------------------------------------------

    async def upload_file(self, source_path: Union[Path, str], target_path: str) -> None:
        """Copies a local file in (into ``target_path`` when that is a directory, as
        ``docker cp``), making missing parents and keeping its permission bits."""
        sandbox = self._require()
        source = Path(source_path)
        if not source.is_file():
            raise FileNotFoundError(f"{source}: not a file")
        target = target_path
        try:
            if (await sandbox.files.stat(target)).type == "directory":
                target = str(PurePosixPath(target) / source.name)
        except NotFound:
            pass
        parent = str(PurePosixPath(target).parent)
        await sandbox.files.mkdir(parent, parents=True)
        await sandbox.files.upload(source, target, mode=stat_mod.S_IMODE(source.stat().st_mode))

    async def upload_dir(self, source_dir: Union[Path, str], target_dir: str) -> None:
        """Copies a local directory's contents into ``target_dir`` (made if missing). Regular
        files and directories are copied with their permission bits; symlinks and special
        files are skipped (the files API makes no links)."""
        sandbox = self._require()
        root = Path(source_dir)
        if not root.is_dir():
            raise NotADirectoryError(f"{root}: not a directory")
        await sandbox.files.mkdir(target_dir, parents=True)
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            rel = Path(dirpath).relative_to(root)
            remote_dir = PurePosixPath(target_dir) / rel.as_posix() if rel.parts else PurePosixPath(target_dir)
            for name in sorted(dirnames):
                local = Path(dirpath) / name
                if local.is_symlink():
                    self.logger.warning(f"dsec: upload_dir skips the symlink {local}")
                    continue
                mode = stat_mod.S_IMODE(local.stat().st_mode)
                await sandbox.files.mkdir(str(remote_dir / name), parents=True, mode=mode)
            for name in sorted(filenames):
                local = Path(dirpath) / name
                st = os.lstat(local)
                if not stat_mod.S_ISREG(st.st_mode):
                    self.logger.warning(f"dsec: upload_dir skips {local} (not a regular file)")
                    continue
                await sandbox.files.upload(local, str(remote_dir / name), mode=stat_mod.S_IMODE(st.st_mode))

    async def download_file(self, source_path: str, target_path: Union[Path, str]) -> None:
        """Copies one file out of the sandbox (streamed; parents made on the host)."""
        sandbox = self._require()
        try:
            info = await sandbox.files.stat(source_path)
        except NotFound:
            raise FileNotFoundError(f"{source_path}: no such file in the sandbox") from None
        if info.type == "symlink" and not await self.is_file(source_path):
            raise FileNotFoundError(f"{source_path}: not a regular file in the sandbox")
        if info.type not in ("file", "symlink"):
            # A fifo or device would block or never end the read.
            raise FileNotFoundError(f"{source_path}: not a regular file in the sandbox ({info.type})")
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await sandbox.files.download(source_path, target)

    async def download_dir(self, source_dir: str, target_dir: Union[Path, str]) -> None:
        """Copies a sandbox directory's contents into ``target_dir`` (overwriting files there).

        What the sandbox wrote is untrusted: the tree is listed through the files API, only
        regular files and directories come out, names are single path components, links are
        never followed on either side, and the walk is bounded (see ``_provider_base``)."""
        sandbox = self._require()
        try:
            await base.download_tree(sandbox.files, source_dir, Path(target_dir))
        except DSecError as err:
            if isinstance(err, NotFound) and not base.is_gone(err):
                raise FileNotFoundError(f"{source_dir}: {err.message}") from None
            raise

    async def attach(self) -> None:
        """An interactive shell in the sandbox through the ``dsec`` CLI."""
        sandbox = self._require()
        os.execvp("dsec", ["dsec", "sandbox", "shell", str(sandbox.id), "--shell", self._shell])


__all__ = ["DSecEnvironment", "DSecEnvironmentType", "ExecResult", "HAVE_HARBOR"]

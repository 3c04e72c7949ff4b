"""verifiers on DSec: the sandbox client verifiers' ``SandboxEnv`` calls, backed by DSec.

verifiers (github:PrimeIntellect-ai/verifiers at a60a606ecc4d309247edf9ff92c3eabca362781f) runs
its sandbox environments (``verifiers.legacy.envs.sandbox_env.SandboxEnv``, ``SandboxMixin`` and
the composable tasksets) through one object, ``env.sandbox_client``: prime-sandboxes'
``AsyncSandboxClient`` behind a thread pool. ``DSecSandboxClient`` has the methods of that client
that verifiers calls, with prime-sandboxes' signatures, return types and exceptions
(github:PrimeIntellect-ai/prime at 66fb4b704377aa56b0f580756c80f3bc824a797a), so the one change is::

    env = vf.SandboxEnv(docker_image="python:3.11-slim", ...)
    env.sandbox_client = DSecSandboxClient()        # DSEC_URL / DSEC_API_KEY

or ``DSecSandboxEnv`` (a ``SandboxEnv`` subclass doing that and tearing down through DSec, not
through Prime's API), available where verifiers is installed.

Where ``prime_sandboxes`` is installed its models and exceptions are used; otherwise twins with
the same names and fields (``dsec.integrations._prime_api``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .. import errors as dsec_errors
from .._async import Sandbox
from ..models import CommandResult, SandboxInfo
from . import _prime_api
from . import _provider_common as common

_prime: Any = common.optional_module("prime_sandboxes") or _prime_api

#: True when the classes below are prime-sandboxes' own.
PRIME_SANDBOXES_INSTALLED = _prime is not _prime_api

APIError = _prime.APIError
SandboxFileNotFoundError = _prime.SandboxFileNotFoundError
SandboxFileTooLargeError = getattr(_prime, "SandboxFileTooLargeError", _prime_api.SandboxFileTooLargeError)
SandboxNotRunningError = _prime.SandboxNotRunningError
CommandTimeoutError = _prime.CommandTimeoutError
UploadTimeoutError = _prime.UploadTimeoutError
DownloadTimeoutError = _prime.DownloadTimeoutError
SandboxOOMError = _prime.SandboxOOMError
SandboxTimeoutError = _prime.SandboxTimeoutError
SandboxImagePullError = getattr(_prime, "SandboxImagePullError", _prime_api.SandboxImagePullError)

CreateSandboxRequest = _prime.CreateSandboxRequest
SandboxModel = _prime.Sandbox
CommandResponse = _prime.CommandResponse
BackgroundJob = _prime.BackgroundJob
BackgroundJobStatus = _prime.BackgroundJobStatus
FileUploadResponse = _prime.FileUploadResponse
ReadFileResponse = _prime.ReadFileResponse
BulkDeleteSandboxResponse = _prime.BulkDeleteSandboxResponse

#: prime-sandboxes' default ``execute_command`` timeout (seconds).
DEFAULT_COMMAND_TIMEOUT = 300
#: prime-sandboxes' default ``start_command``: DSec sandboxes need none.
IDLE_START_COMMAND = "tail -f /dev/null"
#: Output kept per stream of one command (head and tail).
DEFAULT_MAX_OUTPUT_BYTES = 10 * 1024 * 1024
#: The largest file (or window) ``read_file`` returns; past it ``SandboxFileTooLargeError``.
DEFAULT_MAX_READ_BYTES = 16 * 1024 * 1024
#: The largest file ``download_file`` writes to the host.
DEFAULT_MAX_DOWNLOAD_BYTES = 4 * 1024 * 1024 * 1024

_STATUS = {"starting": "PENDING", "running": "RUNNING", "paused": "RUNNING", "stopped": "TERMINATED"}


def _make(model: Any, **values: Any) -> Any:
    """A prime-sandboxes model (pydantic, field names) or its dataclass twin."""
    validate = getattr(model, "model_validate", None)
    if validate is not None:
        return validate(values)
    return model(**values)


class DSecSandboxClient:
    """prime-sandboxes' ``AsyncSandboxClient`` (the part verifiers uses) on DSec.

    ``image_map`` maps a request's ``docker_image`` to a DSec image (default: the same name).
    ``url``/``api_key`` default to ``DSEC_URL``/``DSEC_API_KEY``. Extra keyword arguments of
    ``ThreadedAsyncSandboxClient`` (``max_workers``, ``max_keepalive_connections``) are accepted
    and ignored: one asyncio client serves every call, so use it from one event loop (the
    environment's); ``teardown``/``stop_blocking`` need none.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        image_map: Optional[Mapping[str, str]] = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
        create_timeout: float = 300.0,
        max_connections: int = 256,
        **_ignored: Any,
    ) -> None:
        self._url = url
        self._api_key = api_key
        self._image_map = dict(image_map or {})
        self._max_output = common.output_cap(max_output_bytes, DEFAULT_MAX_OUTPUT_BYTES)
        self._max_read = common.output_cap(max_read_bytes, DEFAULT_MAX_READ_BYTES, what="max_read_bytes")
        if not isinstance(max_download_bytes, int) or max_download_bytes < 1:
            raise dsec_errors.InvalidArgument(
                "max_download_bytes must be a positive integer", field="max_download_bytes"
            )
        self._max_download = max_download_bytes
        self._create_timeout = create_timeout
        self._max_connections = max_connections
        self._conn: Optional[common.Connection] = None
        #: Sandboxes this client created and has not deleted.
        self.active: Dict[str, Sandbox] = {}

    # --- plumbing -----------------------------------------------------------

    @property
    def _connection(self) -> common.Connection:
        if self._conn is None:
            self._conn = common.connect(self._url, self._api_key)
        return self._conn

    def _sandbox(self, sandbox_id: str) -> Sandbox:
        return self.active.get(sandbox_id) or self._connection.client.sandbox(sandbox_id)

    def _model(self, info: SandboxInfo, request: Any = None) -> Any:
        spec = info.spec
        labels = [f"{k}={v}" if v != "true" else k for k, v in spec.labels.items() if not k.startswith("dsec.")]
        now = datetime.now(timezone.utc)
        return _make(
            SandboxModel,
            id=info.id,
            name=spec.labels.get("dsec.name", info.id),
            docker_image=getattr(request, "docker_image", None) or spec.image,
            start_command=getattr(request, "start_command", None),
            cpu_cores=float(spec.cpu_cores_limit or 0),
            memory_gb=(spec.memory_limit_mb or 0) / 1024,
            disk_size_gb=(spec.disk_limit_mb or 0) / 1024,
            disk_mount_path="/",
            gpu_count=0,
            vm=False,
            status=_STATUS.get(info.state, "ERROR"),
            timeout_minutes=max(1, (spec.ttl_seconds or 60) // 60),
            labels=labels,
            environment_vars=dict(spec.env or {}),
            created_at=info.created_at or now,
            updated_at=now,
            started_at=info.created_at,
            termination_reason=info.reason,
        )

    def _not_running(self, sandbox_id: str, err: dsec_errors.DSecError, command: Optional[str] = None) -> Exception:
        status = "TERMINATED" if isinstance(err, (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning)) else None
        message = f"Sandbox {sandbox_id}: {err}"
        return SandboxNotRunningError(sandbox_id, status=status, command=command, message=message)

    def _api_error(self, what: str, err: dsec_errors.DSecError) -> Exception:
        return APIError(f"HTTP {err.status} {what}: {err}")

    # --- sandboxes ------------------------------------------------------------

    async def create(self, request: Any) -> Any:
        """Creates a sandbox (DSec returns once it runs). ``timeout_minutes`` is its TTL."""
        if int(getattr(request, "gpu_count", 0) or 0) > 0:
            raise APIError("HTTP 400 POST /sandbox: DSec sandboxes have no GPUs (gpu_count must be 0)")
        image = self._image_map.get(request.docker_image, request.docker_image)
        labels = common.labels_from(getattr(request, "labels", None) or [])
        name = str(getattr(request, "name", "") or "")
        if name and common._LABEL_KEY.match(name.replace(" ", "-")):  # noqa: SLF001
            labels["dsec.name"] = name.replace(" ", "-")
        env = dict(getattr(request, "environment_vars", None) or {})
        env.update(dict(getattr(request, "secrets", None) or {}))
        settings = common.SandboxSettings(
            image=image,
            ttl_s=int(getattr(request, "timeout_minutes", 60) or 60) * 60,
            memory_mb=int(float(request.memory_gb) * 1024) if getattr(request, "memory_gb", None) else None,
            cpus=float(request.cpu_cores) if getattr(request, "cpu_cores", None) else None,
            disk_mb=int(float(request.disk_size_gb) * 1024) if getattr(request, "disk_size_gb", None) else None,
            env=env or None,
            labels=labels,
        )
        try:
            sandbox = await common.create_sandbox(self._connection, settings, "verifiers", self._create_timeout)
        except dsec_errors.ImageNotFound as err:
            raise SandboxImagePullError("(not created)", error_type="IMAGE_PULL_FAILED", message=str(err)) from err
        except dsec_errors.DSecError as err:
            raise self._api_error("POST /sandbox", err) from err
        self.active[sandbox.id] = sandbox
        start = getattr(request, "start_command", None)
        if isinstance(start, str) and start.strip() and start.strip() != IDLE_START_COMMAND:
            await sandbox.commands.start(start, timeout=common.MAX_COMMAND_TIMEOUT_S)
        assert sandbox.info is not None
        return self._model(sandbox.info, request)

    async def get(self, sandbox_id: str) -> Any:
        try:
            info = await self._sandbox(sandbox_id).refresh()
        except dsec_errors.DSecError as err:
            raise self._api_error(f"GET /sandbox/{sandbox_id}", err) from err
        return self._model(info)

    async def wait_for_creation(
        self,
        sandbox_id: str,
        max_attempts: int = 60,
        stability_checks: int = 1,
        image_build_timeout_seconds: int = 3000,
    ) -> None:
        """Returns once the sandbox runs (DSec's create already waited; this checks it still
        does). Raises ``SandboxNotRunningError`` for a stopped or unknown one."""
        sandbox = self._sandbox(sandbox_id)
        for _ in range(max(1, int(max_attempts))):
            try:
                info = await sandbox.refresh()
            except dsec_errors.DSecError as err:
                raise self._not_running(sandbox_id, err) from err
            if info.state in ("running", "paused"):
                return
            if info.state == "stopped":
                raise SandboxNotRunningError(sandbox_id, status="TERMINATED")
            await asyncio.sleep(1.0)
        raise SandboxNotRunningError(sandbox_id, status=_STATUS.get(info.state, "PENDING"))

    async def delete(self, sandbox_id: str) -> Dict[str, Any]:
        sandbox = self._sandbox(sandbox_id)
        try:
            await common.stop_sandbox(sandbox)
        except dsec_errors.DSecError as err:
            raise self._api_error(f"DELETE /sandbox/{sandbox_id}", err) from err
        finally:
            self.active.pop(sandbox_id, None)
        return {"id": sandbox_id, "status": "TERMINATED"}

    async def bulk_delete(
        self,
        sandbox_ids: Optional[List[str]] = None,
        labels: Optional[List[str]] = None,
        team_id: Optional[str] = None,
        user_id: Optional[str] = None,
        all_users: bool = False,
    ) -> Any:
        """Deletes the given sandboxes, or every sandbox carrying all of ``labels``."""
        if not sandbox_ids and not labels:
            raise ValueError("bulk_delete needs sandbox_ids or labels")
        succeeded: List[str] = []
        failed: List[Dict[str, str]] = []
        for sandbox_id in sandbox_ids or []:
            try:
                await self.delete(sandbox_id)
                succeeded.append(sandbox_id)
            except Exception as err:  # noqa: BLE001 - reported per sandbox, as Prime's API does
                failed.append({"sandbox_id": sandbox_id, "error": str(err)})
        if labels:
            try:
                job = await self._connection.client.stop_job(common.labels_from(labels))
            except dsec_errors.DSecError as err:
                raise self._api_error("DELETE /sandbox", err) from err
            for item in job.sandboxes:
                common.unregister(item.id)
                self.active.pop(item.id, None)
                succeeded.append(item.id)
            failed.extend({"sandbox_id": f.id, "error": f.message} for f in job.failed)
        return _make(
            BulkDeleteSandboxResponse,
            succeeded=succeeded,
            failed=failed,
            message=f"deleted {len(succeeded)} sandbox(es), {len(failed)} failed",
        )

    # --- commands ---------------------------------------------------------------

    async def execute_command(
        self,
        sandbox_id: str,
        command: str,
        working_dir: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[int] = None,
        user: Optional[str] = None,
    ) -> Any:
        """Runs a shell command and waits for it (``timeout`` seconds, default 300).

        Raises ``CommandTimeoutError``, ``SandboxNotRunningError`` (stopped or unknown sandbox),
        ``SandboxOOMError`` (the sandbox's memory limit killed the command)."""
        effective = timeout if timeout is not None else DEFAULT_COMMAND_TIMEOUT
        seconds = common.command_timeout(effective)
        try:
            result = await self._sandbox(sandbox_id).commands.run(
                command, timeout=seconds, env=env, cwd=working_dir, user=user, max_output_bytes=self._max_output
            )
        except dsec_errors.DeadlineExceeded as err:
            raise CommandTimeoutError(sandbox_id, command, effective) from err
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err, command) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"POST /sandbox/{sandbox_id}/exec", err) from err
        self._raise_for_outcome(sandbox_id, command, effective, result)
        return _make(CommandResponse, stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)

    def _raise_for_outcome(self, sandbox_id: str, command: str, timeout: Any, result: CommandResult) -> None:
        if result.outcome == "timeout":
            raise CommandTimeoutError(sandbox_id, command, timeout)
        if result.outcome == "oom":
            raise SandboxOOMError(sandbox_id, status="RUNNING", error_type="OOM_KILLED", command=command)

    async def start_background_job(
        self,
        sandbox_id: str,
        command: str,
        working_dir: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
    ) -> Any:
        """Starts a DSec background command; ``job_id`` is its command ID (its output lives in
        DSec's command log, not in files: the ``*_file`` fields name it ``dsec:commands/<id>/…``)."""
        try:
            handle = await self._sandbox(sandbox_id).commands.start(
                command,
                timeout=common.MAX_COMMAND_TIMEOUT_S,
                env=env,
                cwd=working_dir,
                user=user,
                max_output_bytes=self._max_output,
            )
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err, command) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"POST /sandbox/{sandbox_id}/exec", err) from err
        return _job(sandbox_id, handle.id)

    async def get_background_job(self, sandbox_id: str, job: Any, timeout: Optional[int] = None) -> Any:
        try:
            # Commands.get percent-encodes both IDs: a hostile job or sandbox ID is one path segment.
            handle = await self._sandbox(sandbox_id).commands.get(str(job.job_id), timeout=timeout)
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"GET /sandbox/{sandbox_id}/job/{job.job_id}", err) from err
        info = handle.info
        assert info is not None
        if info.state != "finished" or info.result is None:
            return _make(BackgroundJobStatus, job_id=job.job_id, completed=False)
        return _status(job.job_id, info.result)

    async def run_background_job(
        self,
        sandbox_id: str,
        command: str,
        timeout: int = 900,
        working_dir: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        poll_interval: int = 3,
    ) -> Any:
        """Runs a command in the background and waits for it. DSec waits on the server (no
        polling); past ``timeout`` the command is killed and ``CommandTimeoutError`` raised."""
        seconds = common.command_timeout(timeout)
        try:
            handle = await self._sandbox(sandbox_id).commands.start(
                command, timeout=seconds, env=env, cwd=working_dir, max_output_bytes=self._max_output
            )
            result = await handle.wait()
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err, command) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"POST /sandbox/{sandbox_id}/exec", err) from err
        self._raise_for_outcome(sandbox_id, command, timeout, result)
        return _status(handle.id, result)

    # --- files --------------------------------------------------------------------

    async def upload_file(
        self, sandbox_id: str, file_path: str, local_file_path: str, timeout: Optional[int] = None
    ) -> Any:
        if not os.path.exists(local_file_path):
            raise FileNotFoundError(f"Local file not found: {local_file_path}")
        size = os.path.getsize(local_file_path)
        sandbox = self._sandbox(sandbox_id)
        try:
            parent = os.path.dirname(file_path.rstrip("/"))
            if parent and parent != "/":
                await sandbox.files.mkdir(parent, parents=True, timeout=timeout)
            await sandbox.files.upload(local_file_path, file_path, timeout=timeout)
        except dsec_errors.DeadlineExceeded as err:
            raise UploadTimeoutError(sandbox_id, file_path, timeout or 300) from err
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"POST /sandbox/{sandbox_id}/upload", err) from err
        return _upload_response(file_path, size)

    async def upload_bytes(
        self, sandbox_id: str, file_path: str, file_bytes: bytes, filename: str, timeout: Optional[int] = None
    ) -> Any:
        try:
            await common.write_with_parents(self._sandbox(sandbox_id), file_path, bytes(file_bytes), timeout=timeout)
        except dsec_errors.DeadlineExceeded as err:
            raise UploadTimeoutError(sandbox_id, file_path, timeout or 300) from err
        except (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning) as err:
            raise self._not_running(sandbox_id, err) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"POST /sandbox/{sandbox_id}/upload", err) from err
        return _upload_response(file_path, len(file_bytes))

    async def download_file(
        self, sandbox_id: str, file_path: str, local_file_path: str, timeout: Optional[int] = None
    ) -> None:
        """Streams a file to ``local_file_path`` (a temp file renamed over it); a file over
        ``max_download_bytes`` raises ``SandboxFileTooLargeError`` and leaves nothing behind."""
        tmp = f"{local_file_path}.dsec-part-{uuid.uuid4().hex[:8]}"
        size = 0
        stream = self._sandbox(sandbox_id).files.read_stream(file_path, timeout=timeout or 300)
        try:
            with open(tmp, "wb") as out:
                async for chunk in stream:
                    size += len(chunk)
                    if size > self._max_download:
                        raise SandboxFileTooLargeError(
                            f"File too large to download: {file_path}: over {self._max_download} bytes"
                        )
                    out.write(chunk)
            os.replace(tmp, local_file_path)
        except dsec_errors.NotFound as err:
            if isinstance(err, dsec_errors.SandboxNotFound):
                raise self._not_running(sandbox_id, err) from err
            raise SandboxFileNotFoundError(f"File not found: {file_path}") from err
        except dsec_errors.DeadlineExceeded as err:
            raise DownloadTimeoutError(sandbox_id, file_path, timeout or 300) from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"GET /sandbox/{sandbox_id}/download", err) from err
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            if os.path.exists(tmp):
                os.unlink(tmp)

    async def read_file(
        self,
        sandbox_id: str,
        file_path: str,
        timeout: Optional[int] = None,
        offset: Optional[int] = None,
        length: Optional[int] = None,
    ) -> Any:
        """A file (or the window ``offset``/``length``) as text. Past ``max_read_bytes`` without
        a window: ``SandboxFileTooLargeError``; a missing file: ``SandboxFileNotFoundError``."""
        if (offset is not None and offset < 0) or (length is not None and length < 0):
            raise APIError(f"HTTP 400 GET /read-file: offset and length must not be negative ({file_path})")
        sandbox = self._sandbox(sandbox_id)
        start = offset or 0
        limit = self._max_read if length is None else min(length, self._max_read)
        try:
            total = (await sandbox.files.stat(file_path, timeout=timeout or 30)).size
            read = await common.read_capped(sandbox, file_path, limit, offset=start, timeout=timeout or 30)
        except dsec_errors.NotFound as err:
            if isinstance(err, dsec_errors.SandboxNotFound):
                raise self._not_running(sandbox_id, err) from err
            raise SandboxFileNotFoundError(f"File not found: {file_path}") from err
        except dsec_errors.DeadlineExceeded as err:
            raise APIError(f"Read file timed out after {timeout or 30}s: {file_path}") from err
        except dsec_errors.DSecError as err:
            raise self._api_error(f"GET /sandbox/{sandbox_id}/read-file", err) from err
        if read.truncated and length is None:
            raise SandboxFileTooLargeError(f"File too large to read: {file_path}: over {self._max_read} bytes")
        return _make(
            ReadFileResponse,
            content=read.data.decode("utf-8", "replace"),
            size=len(read.data),
            total_size=total,
            offset=start,
            truncated=start + len(read.data) < total,
        )

    # --- clean-up -----------------------------------------------------------------

    async def aclose(self) -> None:
        """Deletes what this client created and still holds, then closes the connection."""
        for sandbox_id in list(self.active):
            try:
                await self.delete(sandbox_id)
            except Exception:  # noqa: BLE001 - best effort; TTL and atexit remain
                pass
        if self._conn is not None:
            await self._conn.client.close()
            self._conn = None

    async def __aenter__(self) -> "DSecSandboxClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def teardown(self, wait: bool = True) -> None:
        """``ThreadedAsyncSandboxClient.teardown``: stops what is left with the blocking client
        (this runs from signal handlers and interpreter shutdown, where no loop may be left)."""
        self.stop_blocking(list(self.active))

    def stop_blocking(self, sandbox_ids: Sequence[str]) -> List[str]:
        """Stops sandboxes without an event loop (verifiers tears down from ``atexit`` and signal
        handlers, in a loop other than the one that made them); returns those stopped."""
        if not sandbox_ids:
            return []
        conn = self._conn or common.connect(self._url, self._api_key)
        from ..sync import DSecClient as BlockingClient

        stopped: List[str] = []
        with BlockingClient(conn.url, conn.api_key, timeout=10.0, max_retries=1) as client:
            for sandbox_id in sandbox_ids:
                try:
                    client.sandbox(sandbox_id).stop()
                    stopped.append(sandbox_id)
                except dsec_errors.DSecError:
                    pass
                common.unregister(sandbox_id)
                self.active.pop(sandbox_id, None)
        return stopped


def _job(sandbox_id: str, command_id: str) -> Any:
    base = f"dsec:commands/{command_id}"
    return _make(
        BackgroundJob,
        job_id=command_id,
        sandbox_id=sandbox_id,
        stdout_log_file=f"{base}/stdout",
        stderr_log_file=f"{base}/stderr",
        exit_file=f"{base}/exit",
    )


def _status(job_id: str, result: CommandResult) -> Any:
    return _make(
        BackgroundJobStatus,
        job_id=job_id,
        completed=True,
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_truncated=result.stdout_bytes > len(result.stdout.encode()),
        stderr_truncated=result.stderr_bytes > len(result.stderr.encode()),
    )


def _upload_response(path: str, size: int) -> Any:
    return _make(FileUploadResponse, success=True, path=path, size=size, timestamp=datetime.now(timezone.utc))


def _sandbox_env_class() -> Any:
    vf = common.optional_module("verifiers.legacy") or common.optional_module("verifiers")
    base = getattr(vf, "SandboxEnv", None) if vf is not None else None
    if base is None:
        raise ImportError(
            "DSecSandboxEnv needs verifiers (and prime-sandboxes, which verifiers' SandboxEnv imports); "
            "without them use DSecSandboxClient directly"
        )
    teardown = getattr(vf, "teardown")

    class DSecSandboxEnv(base):  # type: ignore[misc,valid-type]
        """verifiers' ``SandboxEnv`` whose sandboxes are DSec's. ``dsec_url``, ``dsec_api_key``
        and ``dsec_image_map`` configure the client; everything else is ``SandboxEnv``'s."""

        def __init__(
            self,
            *args: Any,
            dsec_url: Optional[str] = None,
            dsec_api_key: Optional[str] = None,
            dsec_image_map: Optional[Mapping[str, str]] = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            self.sandbox_client = DSecSandboxClient(dsec_url, dsec_api_key, image_map=dsec_image_map)

        @teardown  # type: ignore[misc]
        async def teardown_sandboxes(self) -> None:
            """Replaces SandboxEnv's (which deletes through Prime's API): the blocking client,
            because verifiers runs teardown in a fresh loop from ``atexit``/SIGTERM."""
            ids: Sequence[str] = list(self.active_sandboxes)
            if ids:
                self.sandbox_client.stop_blocking(ids)
                self.active_sandboxes.difference_update(ids)

        @teardown  # type: ignore[misc]
        async def teardown_sandbox_client(self) -> None:
            self.sandbox_client.teardown()

    return DSecSandboxEnv


def __getattr__(name: str) -> Any:
    if name == "DSecSandboxEnv":
        return _sandbox_env_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PRIME_SANDBOXES_INSTALLED",
    "DSecSandboxClient",
    "APIError",
    "SandboxFileNotFoundError",
    "SandboxFileTooLargeError",
    "SandboxNotRunningError",
    "CommandTimeoutError",
    "UploadTimeoutError",
    "DownloadTimeoutError",
    "SandboxOOMError",
    "SandboxTimeoutError",
    "SandboxImagePullError",
    "CreateSandboxRequest",
    "SandboxModel",
    "CommandResponse",
    "BackgroundJob",
    "BackgroundJobStatus",
    "FileUploadResponse",
    "ReadFileResponse",
    "BulkDeleteSandboxResponse",
]

"""tinker-cookbook on DSec: a ``SandboxInterface`` implementation.

tinker-cookbook (github:thinking-machines-lab/tinker-cookbook at
9dfcc3a2cf44432d621a01005073dc6d76a1e87a) runs agent tools and graders through
``tinker_cookbook.sandbox.SandboxInterface`` (``sandbox_id``, ``send_heartbeat``, ``run_command``,
``read_file``, ``write_file``, ``cleanup``); its recipes take a ``SandboxFactory``
(``async (env_dir, timeout) -> SandboxInterface``, Modal by default). The one change::

    from dsec.integrations.tinker import make_sandbox_factory

    sandbox_factory = make_sandbox_factory("python311")      # instead of default_sandbox_factory

or directly ``sandbox = await DSecSandbox.create(image="python311", timeout=600)``.

Like the cookbook's ``ModalSandbox``: failures come back as a ``SandboxResult`` with a non-zero
``exit_code`` and the reason in ``stderr``, except a sandbox that is gone, which raises
``SandboxTerminatedError``. Output is capped per stream (``max_stream_output_bytes``, 128 KiB
by default) and ``metrics`` says when it was (``truncated``) and when a command ran out of time
(``timed_out``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional, Union

from .. import errors as dsec_errors
from .._async import Sandbox
from . import _provider_common as common
from . import _tinker_api

_iface: Any = common.optional_module("tinker_cookbook.sandbox.sandbox_interface") or _tinker_api
_exc: Any = common.optional_module("tinker_cookbook.exceptions") or _tinker_api

#: True when the classes below are tinker-cookbook's own.
TINKER_COOKBOOK_INSTALLED = _iface is not _tinker_api

SandboxResult = _iface.SandboxResult
SandboxTerminatedError = _iface.SandboxTerminatedError
SandboxError = _exc.SandboxError
TinkerCookbookError = _exc.TinkerCookbookError

#: ``ModalSandbox``'s default cap on each output stream.
DEFAULT_MAX_STREAM_OUTPUT_BYTES = 128 * 1024
#: ``ModalSandbox.create``'s default sandbox lifetime (seconds).
DEFAULT_SANDBOX_TIMEOUT = 600
#: Exit code of a command that could not run or ran out of time (``ModalSandbox`` uses -1).
FAILED_EXIT_CODE = -1


def _gone(err: dsec_errors.DSecError) -> bool:
    return isinstance(err, (dsec_errors.SandboxNotFound, dsec_errors.SandboxNotRunning))


class DSecSandbox:
    """One DSec sandbox behind tinker-cookbook's ``SandboxInterface``.

    ``timeout`` is the sandbox's lifetime in seconds, as for ``ModalSandbox``; each
    ``send_heartbeat`` moves that deadline to ``timeout`` seconds from then, so a sandbox that is
    still heartbeating is not reclaimed, and one whose job died is (the TTL backstop).
    ``shell`` runs commands with the image's shell (``"/bin/bash"`` gives ``bash -lc`` as Modal
    does); ``None`` is DSec's platform ``sh``, which every image has.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        conn: common.Connection,
        *,
        timeout: int = DEFAULT_SANDBOX_TIMEOUT,
        max_stream_output_bytes: int = DEFAULT_MAX_STREAM_OUTPUT_BYTES,
        user: Optional[str] = None,
        shell: Optional[str] = None,
        owns_connection: bool = True,
    ) -> None:
        self._sandbox = sandbox
        self._conn = conn
        self._timeout = common.ttl_seconds(timeout)
        self._max_stream = common.output_cap(
            max_stream_output_bytes, DEFAULT_MAX_STREAM_OUTPUT_BYTES, what="max_stream_output_bytes"
        )
        self._user = user
        self._shell = shell
        self._owns_connection = owns_connection
        self._cleaned = False

    @classmethod
    async def create(
        cls,
        image: str,
        timeout: int = DEFAULT_SANDBOX_TIMEOUT,
        *,
        max_stream_output_bytes: int = DEFAULT_MAX_STREAM_OUTPUT_BYTES,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        memory_mb: Optional[int] = None,
        cpus: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        shell: Optional[str] = None,
        network_rules: Optional[Mapping[str, bool]] = None,
        create_timeout: float = 180.0,
    ) -> "DSecSandbox":
        """Creates a sandbox of the DSec image ``image`` living ``timeout`` seconds. Raises
        ``SandboxError`` (the DSec error as its cause) when it cannot be created."""
        settings = common.SandboxSettings(
            image=image,
            ttl_s=timeout,
            memory_mb=memory_mb,
            cpus=cpus,
            env=env,
            labels=labels,
            user=user,
            network_rules=network_rules,
        )
        conn = common.connect(url, api_key)
        try:
            sandbox = await common.create_sandbox(conn, settings, "tinker", create_timeout)
        except dsec_errors.DSecError as err:
            await conn.client.close()
            raise SandboxError(f"DSec could not create a sandbox of {image!r}: {err}") from err
        return cls(
            sandbox, conn, timeout=timeout, max_stream_output_bytes=max_stream_output_bytes, user=user, shell=shell
        )

    def _check_open(self) -> None:
        if self._cleaned:
            raise SandboxTerminatedError(f"sandbox {self._sandbox.id} was cleaned up")

    @property
    def sandbox_id(self) -> str:
        return self._sandbox.id

    @property
    def sandbox(self) -> Sandbox:
        """The DSec handle, for what the interface does not cover (snapshots, network rules)."""
        return self._sandbox

    async def send_heartbeat(self, timeout: int = 30) -> None:
        """Checks the sandbox is alive and moves its deadline ``timeout`` (the sandbox's) seconds
        on. Raises ``SandboxTerminatedError`` when it is gone."""
        self._check_open()
        try:
            await self._sandbox.set_timeout(self._timeout, timeout=timeout)
        except dsec_errors.DSecError as err:
            if _gone(err):
                raise SandboxTerminatedError(str(err)) from err
            raise SandboxError(str(err)) from err

    async def run_command(
        self,
        command: str,
        workdir: Optional[str] = None,
        timeout: int = 60,
        max_output_bytes: Optional[int] = None,
    ) -> Any:
        """Runs a shell command; ``workdir=None`` is the image's working directory."""
        self._check_open()
        cap = common.output_cap(max_output_bytes, self._max_stream)
        seconds = common.command_timeout(timeout)
        target: Any = [self._shell, "-lc", command] if self._shell else command
        try:
            result = await self._sandbox.commands.run(
                target, timeout=seconds, cwd=workdir, user=self._user, max_output_bytes=cap
            )
        except dsec_errors.DSecError as err:
            if _gone(err):
                raise SandboxTerminatedError(str(err)) from err
            return SandboxResult(stdout="", stderr=str(err), exit_code=FAILED_EXIT_CODE)
        metrics = {"duration_ms": result.duration_ms, "truncated": result.truncated, "outcome": result.outcome}
        if result.outcome == "timeout":
            stderr = result.stderr + f"\ncommand timed out after {timeout}s"
            return SandboxResult(
                stdout=result.stdout, stderr=stderr, exit_code=FAILED_EXIT_CODE, metrics={**metrics, "timed_out": True}
            )
        return SandboxResult(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code, metrics=metrics)

    async def read_file(self, path: str, max_bytes: Optional[int] = None, timeout: int = 60) -> Any:
        """A file's first ``max_bytes`` (default the output cap) bytes as text in ``stdout``;
        nothing past them is transferred. A missing or unreadable file: ``exit_code`` 1."""
        self._check_open()
        limit = common.output_cap(max_bytes, self._max_stream, what="max_bytes")
        try:
            read = await common.read_capped(
                self._sandbox, path, limit, user=self._user, timeout=common.command_timeout(timeout)
            )
        except dsec_errors.DSecError as err:
            if _gone(err):
                raise SandboxTerminatedError(str(err)) from err
            return SandboxResult(stdout="", stderr=f"{path}: {err.message}", exit_code=1)
        return SandboxResult(
            stdout=read.data.decode("utf-8", "replace"),
            stderr="",
            exit_code=0,
            metrics={"bytes": len(read.data), "truncated": read.truncated},
        )

    async def write_file(
        self, path: str, content: Union[str, bytes] = "", executable: bool = False, timeout: int = 60
    ) -> Any:
        """Writes ``content`` (parents created; ``executable`` gives mode 0755)."""
        self._check_open()
        data = content.encode() if isinstance(content, str) else bytes(content)
        try:
            await common.write_with_parents(
                self._sandbox,
                path,
                data,
                mode=0o755 if executable else None,
                user=self._user,
                timeout=common.command_timeout(timeout),
            )
        except dsec_errors.DSecError as err:
            if _gone(err):
                raise SandboxTerminatedError(str(err)) from err
            return SandboxResult(stdout="", stderr=f"{path}: {err.message}", exit_code=1)
        return SandboxResult(stdout="", stderr="", exit_code=0, metrics={"bytes": len(data)})

    async def cleanup(self) -> None:
        """Stops the sandbox and closes the connection; cleaning up twice is fine."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            await common.stop_sandbox(self._sandbox)
        except dsec_errors.SandboxNotFound:
            pass
        finally:
            if self._owns_connection:
                await self._conn.client.close()

    async def __aenter__(self) -> "DSecSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cleanup()


SandboxFactory = Callable[[Path, int], Awaitable[DSecSandbox]]


def make_sandbox_factory(image: Union[str, Callable[[Path], str]], **create_kwargs: Any) -> SandboxFactory:
    """A tinker-cookbook ``SandboxFactory`` (``async (env_dir, timeout) -> SandboxInterface``)
    creating DSec sandboxes: ``image`` is a DSec image name, or a function of the task's
    ``env_dir`` giving one (e.g. the image built from its ``environment/Dockerfile``)."""

    async def factory(env_dir: Path, timeout: int) -> DSecSandbox:
        name = image(env_dir) if callable(image) else image
        return await DSecSandbox.create(image=name, timeout=timeout, **create_kwargs)

    return factory


__all__ = [
    "TINKER_COOKBOOK_INSTALLED",
    "DSecSandbox",
    "make_sandbox_factory",
    "SandboxFactory",
    "SandboxResult",
    "SandboxError",
    "SandboxTerminatedError",
    "TinkerCookbookError",
]

"""SWE-ReX on DSec: a runtime (``AbstractRuntime``) and a deployment (``AbstractDeployment``).

The interface is SWE-ReX's as github:SWE-agent/SWE-ReX writes it at commit
5c995c365dfb1fd5bc56fda688be5d8538f9931f. Where ``swerex`` is installed the classes here subclass
its ``AbstractRuntime``/``AbstractDeployment``, take and return its pydantic models and raise its
exceptions; where it is not, they use twins of those types with the same names, fields and bases
(``dsec.integrations._swerex_api``). Either way SWE-agent's one change is the deployment::

    from dsec.integrations.swerex import DSecDeployment

    deployment = DSecDeployment(image="python:3.11")   # instead of DockerDeployment(image=...)
    await deployment.start()
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    obs = await runtime.run_in_session(BashAction(command="ls", timeout=30))
    await deployment.stop()

A bash session is a DSec shell session (docs/adr/0004-shell-sessions.md): cwd, variables and
background jobs persist between calls, stdout and stderr come back merged in order as a pty
would give them, and the exit code is the shell's own. Differences from SWE-ReX's pexpect
sessions are listed in docs/integrations.md (interactive programs, ``expect``, a timeout kills
the line's foreground job).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from .. import errors as dsec_errors
from .._async import Sandbox, Session
from ..models import CommandResult
from . import _provider_common as common
from . import _swerex_api

_exc: Any = common.optional_module("swerex.exceptions") or _swerex_api
_api: Any = common.optional_module("swerex.runtime.abstract") or _swerex_api
_deployment_api = common.optional_module("swerex.deployment.abstract")

#: True when the classes below are swerex's own (the framework is installed).
SWEREX_INSTALLED = _api is not _swerex_api

SwerexException = _exc.SwerexException
SessionNotInitializedError = _exc.SessionNotInitializedError
NonZeroExitCodeError = _exc.NonZeroExitCodeError
BashIncorrectSyntaxError = _exc.BashIncorrectSyntaxError
CommandTimeoutError = _exc.CommandTimeoutError
NoExitCodeError = _exc.NoExitCodeError
SessionExistsError = _exc.SessionExistsError
SessionDoesNotExistError = _exc.SessionDoesNotExistError
DeploymentNotStartedError = _exc.DeploymentNotStartedError
DeploymentStartupError = _exc.DeploymentStartupError

IsAliveResponse = _api.IsAliveResponse
CreateBashSessionRequest = _api.CreateBashSessionRequest
CreateBashSessionResponse = _api.CreateBashSessionResponse
BashAction = _api.BashAction
BashInterruptAction = _api.BashInterruptAction
BashObservation = _api.BashObservation
CloseBashSessionRequest = _api.CloseBashSessionRequest
CloseBashSessionResponse = _api.CloseBashSessionResponse
Command = _api.Command
CommandResponse = _api.CommandResponse
ReadFileRequest = _api.ReadFileRequest
ReadFileResponse = _api.ReadFileResponse
WriteFileRequest = _api.WriteFileRequest
WriteFileResponse = _api.WriteFileResponse
UploadRequest = _api.UploadRequest
UploadResponse = _api.UploadResponse
CloseResponse = _api.CloseResponse

_RuntimeBase: Any = getattr(_api, "AbstractRuntime", object) if SWEREX_INSTALLED else object
_DeploymentBase: Any = getattr(_deployment_api, "AbstractDeployment", object)


class FileTooLargeError(SwerexException, ValueError):  # type: ignore[misc,valid-type]
    """``read_file`` of a file larger than the runtime's ``max_read_bytes`` (DSec's own limit;
    SWE-ReX names none). The file is not read past the limit."""


#: Output kept per stream of one call (head and tail; the middle is dropped past it).
DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
#: The largest file ``read_file`` returns.
DEFAULT_MAX_READ_BYTES = 64 * 1024 * 1024

_SESSION_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _remote_session_name(name: str) -> str:
    """DSec session names are ``[A-Za-z0-9._-]{1,64}``; SWE-ReX's are any string."""
    if _SESSION_NAME.match(name) and not name.startswith("swerex-"):
        return name
    return "swerex-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _syntax_checked_line(command: str, marker: str) -> str:
    """One session line that parses ``command`` (as the body of a function it never calls, so
    nothing runs), prints ``marker`` after the shell's error when that fails, and otherwise runs
    ``command`` in the session's shell with stderr merged into stdout. Everything happens in the
    one call: no extra round trip, no fork."""
    definition = f"__swerex_syntax_check() {{\n{command}\n}}"
    return (
        f"if {{ command eval {_sh_quote(definition)}; }} 2>&1; then "
        f"unset -f __swerex_syntax_check; eval {_sh_quote(command)} 2>&1; "
        f"else printf '%s' {marker}; false; fi"
    )


@dataclass
class _SessionState:
    handle: Session
    remote_name: str


class DSecRuntime(_RuntimeBase):  # type: ignore[misc]
    """SWE-ReX's ``AbstractRuntime`` over one DSec sandbox.

    ``session_shell`` is the shell of bash sessions: ``None`` is DSec's platform ``sh`` (busybox
    ash, present in every image), ``"/bin/bash"`` the image's bash. ``user`` runs commands,
    sessions and file operations as that user (default the sandbox's). ``owns_sandbox`` makes
    ``close()`` stop the sandbox (the deployment passes it).
    """

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        session_shell: Optional[str] = None,
        user: Optional[str] = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        owns_sandbox: bool = False,
        logger: Optional[logging.Logger] = None,
    ) -> None:
        self.logger = logger or logging.getLogger("rex-runtime.dsec")
        self.sandbox = sandbox
        self._shell = session_shell
        self._user = user
        self._max_output = common.output_cap(max_output_bytes, DEFAULT_MAX_OUTPUT_BYTES)
        self._max_read = common.output_cap(max_read_bytes, DEFAULT_MAX_READ_BYTES, what="max_read_bytes")
        self._owns_sandbox = owns_sandbox
        self._sessions: Dict[str, _SessionState] = {}
        self._closed = False

    @property
    def sessions(self) -> Dict[str, Session]:
        return {name: state.handle for name, state in self._sessions.items()}

    async def is_alive(self, *, timeout: Optional[float] = None) -> Any:
        """Alive while the sandbox runs (a paused one counts: DSec resumes it on the next call)."""
        try:
            info = await self.sandbox.refresh(timeout=timeout)
        except dsec_errors.DSecError as err:
            return IsAliveResponse(is_alive=False, message=str(err))
        if info.state in ("running", "paused", "starting"):
            return IsAliveResponse(is_alive=True)
        return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} is {info.state}")

    async def create_session(self, request: Any) -> Any:
        """Starts a bash session; ``startup_source`` files are sourced within ``startup_timeout``."""
        if getattr(request, "session_type", "bash") != "bash":
            raise ValueError(f"unknown session type: {request!r}")
        name: str = request.session
        if name in self._sessions:
            raise SessionExistsError(f"session {name} already exists")
        remote = _remote_session_name(name)
        handle = self.sandbox.session(remote, shell=self._shell, user=self._user)
        # A session of that name left on the server by an earlier runtime must not leak its state.
        await handle.close()
        sources = list(getattr(request, "startup_source", []) or [])
        line = " ; ".join(f". {_sh_quote(path)}" for path in sources) if sources else ":"
        timeout = common.command_timeout(getattr(request, "startup_timeout", 1.0), what="startup_timeout")
        result = await handle.run(f"{{ {line} ; }} 2>&1", timeout=timeout, max_output_bytes=self._max_output)
        if result.outcome == "timeout":
            await handle.close()
            raise CommandTimeoutError(f"timeout after {timeout} seconds while starting session {name!r}")
        self._sessions[name] = _SessionState(handle, remote)
        return CreateBashSessionResponse(output=result.stdout)

    async def run_in_session(self, action: Any) -> Any:
        """Runs a ``BashAction`` (or a ``BashInterruptAction``) in its session.

        Raises ``SessionDoesNotExistError``, ``BashIncorrectSyntaxError`` (nothing ran),
        ``CommandTimeoutError``, ``NonZeroExitCodeError`` (``check="raise"``)."""
        state = self._sessions.get(action.session)
        if state is None:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if getattr(action, "action_type", "bash") == "bash_interrupt":
            return await self._interrupt(state)
        if action.is_interactive_command or action.is_interactive_quit:
            raise NotImplementedError(
                "interactive commands (is_interactive_command/is_interactive_quit) need a pty that stays "
                "attached between calls; DSec sessions run each call to its end"
            )
        command: str = action.command
        timeout = common.command_timeout(action.timeout)
        if not command.strip() or all(line.strip().startswith("#") for line in command.strip().splitlines()):
            result = await state.handle.run(":", timeout=timeout)
            output = ""
        else:
            marker = f"SWEREX_SYNTAX_{secrets.token_hex(16)}"
            result = await state.handle.run(
                _syntax_checked_line(command, marker), timeout=timeout, max_output_bytes=self._max_output
            )
            if result.outcome == "exited" and result.stdout.endswith(marker):
                error = result.stdout[: -len(marker)]
                msg = (
                    f"Error (exit code 2) while checking bash command \n{command!r}\n"
                    f"---- Stderr ----\n{error}\n---- Stdout ----\n"
                )
                raise BashIncorrectSyntaxError(msg, extra_info={"bash_stdout": "", "bash_stderr": error})
            output = result.stdout + result.stderr
        if result.outcome == "timeout":
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {command!r}")
        exit_code: Optional[int] = None if action.check == "ignore" else result.exit_code
        failure = _failure_reason(result)
        if action.check == "raise" and exit_code != 0:
            msg = f"Command {command!r} failed with exit code {exit_code}. Here is the output:\n{output!r}"
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return BashObservation(output=output, exit_code=exit_code, failure_reason=failure, expect_string="")

    async def _interrupt(self, state: _SessionState) -> Any:
        """Kills the session's running call, if any (its ``run_in_session`` then returns)."""
        killed = 0
        for info in await self.sandbox.commands.list():
            if info.state == "running" and info.session == state.remote_name:
                try:
                    await (await self.sandbox.commands.get(info.command_id)).kill()
                    killed += 1
                except dsec_errors.CommandNotFound:
                    pass
        return BashObservation(output="", exit_code=0, expect_string="", failure_reason="" if killed else "idle")

    async def close_session(self, request: Any) -> Any:
        state = self._sessions.get(request.session)
        if state is None:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        await state.handle.close()
        del self._sessions[request.session]
        return CloseBashSessionResponse()

    async def execute(self, command: Any) -> Any:
        """Runs a command outside any session, like ``subprocess.run``: a list is argv, a string
        with ``shell=True`` a shell line, a string without it one program name.

        Raises ``CommandTimeoutError`` and, with ``check``, ``NonZeroExitCodeError``."""
        timeout = common.command_timeout(command.timeout)
        target: Any = command.command
        merge = bool(command.merge_output_streams)
        if isinstance(target, str):
            line: Optional[str] = target if command.shell else None
            argv: Optional[List[str]] = None if command.shell else [target]
        else:
            parts = [str(a) for a in target]
            if not parts:
                raise ValueError("Command.command must not be an empty list")
            if command.shell:
                line, argv = (f"set -- {shlex.join(parts[1:])}; " if len(parts) > 1 else "") + parts[0], None
            else:
                line, argv = None, parts
        if merge:
            if argv is not None:
                line, argv = f"exec 2>&1; exec {shlex.join(argv)}", None
            else:
                line = f"{{ {line}\n}} 2>&1"
        env: Optional[Mapping[str, str]] = dict(command.env) if command.env is not None else None
        run_target: Any = argv if argv is not None else line
        try:
            result = await self.sandbox.commands.run(
                run_target,
                timeout=timeout,
                env=env,
                cwd=command.cwd,
                user=self._user,
                max_output_bytes=self._max_output,
            )
        except dsec_errors.InvalidArgument as err:
            # A program that cannot be started is subprocess.run's OSError, not a result.
            program = argv[0] if argv else str(run_target)
            if "ENOENT" in err.message:
                raise FileNotFoundError(errno.ENOENT, err.message, program) from err
            if "EACCES" in err.message or "EPERM" in err.message:
                raise PermissionError(errno.EACCES, err.message, program) from err
            raise
        if result.outcome == "timeout":
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        response = CommandResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)
        if command.check and result.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {result.exit_code}. "
                f"Stdout:\n{result.stdout!r}\nStderr:\n{result.stderr!r}"
            )
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return response

    async def read_file(self, request: Any) -> Any:
        """A file as text (``encoding``/``errors`` as ``Path.read_text``). Raises
        ``FileNotFoundError``, ``PermissionError``, ``FileTooLargeError`` past ``max_read_bytes``."""
        try:
            read = await common.read_capped(self.sandbox, request.path, self._max_read, user=self._user)
        except dsec_errors.DSecError as err:
            raise _os_error(err, request.path) from err
        if read.truncated:
            raise FileTooLargeError(f"{request.path} is larger than max_read_bytes ({self._max_read} bytes)")
        content = read.data.decode(request.encoding or "utf-8", request.errors or "strict")
        return ReadFileResponse(content=content)

    async def write_file(self, request: Any) -> Any:
        """Writes text to a file, creating its parent directories."""
        try:
            await common.write_with_parents(
                self.sandbox, request.path, str(request.content).encode(), user=self._user
            )
        except dsec_errors.DSecError as err:
            raise _os_error(err, request.path) from err
        return WriteFileResponse()

    async def upload(self, request: Any) -> Any:
        """Copies a local file or directory tree into the sandbox (``shutil.copy`` /
        ``shutil.copytree`` semantics: a file onto a directory lands inside it; a tree's target
        must not exist; missing parent directories are created). Symlinked directories in the tree are
        not followed."""
        source = os.fspath(request.source_path)
        target = str(request.target_path)
        if not os.path.exists(source):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", source)
        try:
            if os.path.isdir(source):
                if await self.sandbox.files.exists(target, user=self._user):
                    raise FileExistsError(errno.EEXIST, "File exists", target)
                await self.sandbox.files.mkdir(target, parents=True, user=self._user)
                for root, dirs, files in os.walk(source):
                    rel = os.path.relpath(root, source)
                    remote_root = target if rel == "." else f"{target.rstrip('/')}/{rel}"
                    for d in sorted(dirs):
                        if not os.path.islink(os.path.join(root, d)):
                            await self.sandbox.files.mkdir(f"{remote_root}/{d}", parents=True, user=self._user)
                    for f in sorted(files):
                        local = os.path.join(root, f)
                        await self.sandbox.files.upload(
                            local, f"{remote_root}/{f}", mode=os.stat(local).st_mode & 0o777, user=self._user
                        )
            else:
                remote = target
                try:
                    if (await self.sandbox.files.stat(target, user=self._user)).type == "directory":
                        remote = f"{target.rstrip('/')}/{os.path.basename(source)}"
                except dsec_errors.NotFound:
                    pass
                parent = os.path.dirname(remote.rstrip("/"))
                if parent and parent != "/":
                    # In the sandbox the target's directory may not exist yet (it does on SWE-ReX's own host).
                    await self.sandbox.files.mkdir(parent, parents=True, user=self._user)
                await self.sandbox.files.upload(
                    source, remote, mode=os.stat(source).st_mode & 0o777, user=self._user
                )
        except dsec_errors.DSecError as err:
            raise _os_error(err, target) from err
        return UploadResponse()

    async def close(self) -> Any:
        """Closes every session; stops the sandbox when this runtime owns it."""
        if self._closed:
            return CloseResponse()
        self._closed = True
        try:
            for state in list(self._sessions.values()):
                try:
                    await state.handle.close()
                except dsec_errors.DSecError:
                    pass
            self._sessions.clear()
        finally:
            if self._owns_sandbox:
                await common.stop_sandbox(self.sandbox)
        return CloseResponse()


def _failure_reason(result: CommandResult) -> str:
    reasons = []
    if result.truncated:
        reasons.append("output truncated (the middle of a stream past max_output_bytes was dropped)")
    if getattr(result, "session_ended", False):
        reasons.append("the session's shell exited; the next call starts a new one")
    if result.outcome in ("killed", "oom", "signaled"):
        reasons.append(f"command {result.outcome}" + (f" ({result.signal})" if result.signal else ""))
    return "; ".join(reasons)


def _os_error(err: dsec_errors.DSecError, path: str) -> Exception:
    """DSec's file errors as the ``OSError`` subclasses ``LocalRuntime``'s ``pathlib`` calls raise."""
    if isinstance(err, dsec_errors.NotFound):
        return FileNotFoundError(errno.ENOENT, err.message, path)
    if isinstance(err, dsec_errors.PermissionDenied) or "permission denied" in err.message.lower():
        return PermissionError(errno.EACCES, err.message, path)
    if isinstance(err, dsec_errors.Conflict):
        return FileExistsError(errno.EEXIST, err.message, path)
    if isinstance(err, dsec_errors.InvalidArgument) and (
        "is a directory" in err.message.lower() or "wrong file type" in err.message.lower()
    ):
        return IsADirectoryError(errno.EISDIR, err.message, path)
    return err


class DSecDeployment(_DeploymentBase):  # type: ignore[misc]
    """SWE-ReX's ``AbstractDeployment``: ``start()`` creates a DSec sandbox of ``image`` (a DSec
    image name, ``name`` or ``name:version``), ``runtime`` is its ``DSecRuntime``, ``stop()``
    stops it. The sandbox always has a TTL (``ttl`` seconds, default 1 h) and is stopped at
    interpreter exit if ``stop()`` never ran. ``url``/``api_key`` default to ``DSEC_URL`` and
    ``DSEC_API_KEY``."""

    def __init__(
        self,
        image: str,
        *,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        ttl: float = common.DEFAULT_TTL_S,
        memory_mb: Optional[int] = None,
        cpus: Optional[float] = None,
        disk_mb: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        network_rules: Optional[Mapping[str, bool]] = None,
        session_shell: Optional[str] = None,
        startup_timeout: float = 180.0,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        logger: Optional[logging.Logger] = None,
    ) -> None:
        self.logger = logger or logging.getLogger("rex-deploy.dsec")
        self._settings = common.SandboxSettings(
            image=image,
            ttl_s=ttl,
            memory_mb=memory_mb,
            cpus=cpus,
            disk_mb=disk_mb,
            env=env,
            labels=labels,
            user=user,
            network_rules=network_rules,
        )
        common.ttl_seconds(ttl)  # a bad TTL fails here, not at start()
        self._url = url
        self._api_key = api_key
        self._session_shell = session_shell
        self._startup_timeout = startup_timeout
        self._max_output = max_output_bytes
        self._max_read = max_read_bytes
        self._hooks: List[Any] = []
        self._conn: Optional[common.Connection] = None
        self._runtime: Optional[DSecRuntime] = None

    def add_hook(self, hook: Any) -> None:
        self._hooks.append(hook)

    def _step(self, message: str) -> None:
        for hook in self._hooks:
            hook.on_custom_step(message)

    @property
    def sandbox(self) -> Sandbox:
        return self.runtime.sandbox

    @property
    def runtime(self) -> DSecRuntime:
        """The runtime. Raises ``DeploymentNotStartedError`` before ``start()``."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: Optional[float] = None) -> Any:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Creates the sandbox. Raises ``DeploymentStartupError`` (the DSec error as its cause)."""
        if self._runtime is not None:
            return
        self._step("Starting DSec sandbox")
        conn = common.connect(self._url, self._api_key)
        try:
            sandbox = await common.create_sandbox(conn, self._settings, "swerex", self._startup_timeout)
        except dsec_errors.DSecError as err:
            await conn.client.close()
            raise DeploymentStartupError(f"DSec could not start a sandbox of {self._settings.image!r}: {err}") from err
        self._conn = conn
        self._runtime = DSecRuntime(
            sandbox,
            session_shell=self._session_shell,
            user=self._settings.user,
            max_output_bytes=self._max_output,
            max_read_bytes=self._max_read,
            owns_sandbox=True,
            logger=self.logger,
        )
        self._step(f"DSec sandbox {sandbox.id} running")

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Closes the sessions and stops the sandbox; stopping twice (or unstarted) is fine."""
        runtime, conn = self._runtime, self._conn
        self._runtime, self._conn = None, None
        try:
            if runtime is not None:
                await runtime.close()
        finally:
            if conn is not None:
                await conn.client.close()

    async def __aenter__(self) -> "DSecDeployment":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@dataclass
class DSecDeploymentConfig:
    """A deployment config in SWE-ReX's style (``type`` names it; ``get_deployment()`` builds it),
    for configuration files that list deployments by type."""

    image: str
    type: str = "dsec"
    url: Optional[str] = None
    ttl: float = common.DEFAULT_TTL_S
    memory_mb: Optional[int] = None
    cpus: Optional[float] = None
    env: Dict[str, str] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    user: Optional[str] = None
    session_shell: Optional[str] = None
    startup_timeout: float = 180.0

    def get_deployment(self) -> DSecDeployment:
        return DSecDeployment(
            self.image,
            url=self.url,
            ttl=self.ttl,
            memory_mb=self.memory_mb,
            cpus=self.cpus,
            env=self.env or None,
            labels=self.labels or None,
            user=self.user,
            session_shell=self.session_shell,
            startup_timeout=self.startup_timeout,
        )


__all__ = [
    "SWEREX_INSTALLED",
    "DSecRuntime",
    "DSecDeployment",
    "DSecDeploymentConfig",
    "FileTooLargeError",
    "SwerexException",
    "SessionNotInitializedError",
    "NonZeroExitCodeError",
    "BashIncorrectSyntaxError",
    "CommandTimeoutError",
    "NoExitCodeError",
    "SessionExistsError",
    "SessionDoesNotExistError",
    "DeploymentNotStartedError",
    "DeploymentStartupError",
    "IsAliveResponse",
    "CreateBashSessionRequest",
    "CreateBashSessionResponse",
    "BashAction",
    "BashInterruptAction",
    "BashObservation",
    "CloseBashSessionRequest",
    "CloseBashSessionResponse",
    "Command",
    "CommandResponse",
    "ReadFileRequest",
    "ReadFileResponse",
    "WriteFileRequest",
    "WriteFileResponse",
    "UploadRequest",
    "UploadResponse",
    "CloseResponse",
]

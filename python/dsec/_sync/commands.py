# GENERATED from dsec/_async/commands.py by python/tools/gen_sync.py: do not edit.
"""Commands in a sandbox: one-shot (``run``), streamed (``stream``), and
background ones by ID (``start``, ``get``: wait, kill, signal, stdin, output)."""

from __future__ import annotations

from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    Generic,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Type,
    TypeVar,
    Union,
)

from .._core import (
    COMMAND_DEADLINE_SLACK,
    DEFAULT_COMMAND_TIMEOUT,
    LONG_WAIT,
    CommandStreamDecoder,
    command_target,
    compact,
    decode_json,
    deliver,
    ms,
    or_default,
    segment,
)
from ..models import CommandInfo, CommandResult, OutputEvent, from_wire
from .transport import Transport

_R = TypeVar("_R", bound=CommandResult)
OutputCallback = Callable[[str], Any]

NDJSON = "application/x-ndjson"


class OutputStream(Generic[_R]):
    """A command's output as it comes, as ``OutputEvent`` items; ``result`` once it ended.

    Iterate it once. Leaving the loop early closes the connection (a command
    without a request ID is then killed); use it as a context manager to
    close it at once rather than when it is garbage-collected::

        with sandbox.commands.stream("make") as output:
            for event in output:
                print(event.stream, event.data, end="")
        print(output.result.exit_code)
    """

    def __init__(
        self,
        http: Transport,
        method: str,
        path: str,
        *,
        body: Optional[Mapping[str, Any]],
        timeout: float,
        retry_safe: bool,
        result_type: Type[_R],
    ) -> None:
        self._http = http
        self._method = method
        self._path = path
        self._body = body
        self._timeout = timeout
        self._retry_safe = retry_safe
        self._result_type = result_type
        self._events: Optional[Generator[OutputEvent, None, None]] = None
        #: The command's result, set once the stream ended.
        self.result: Optional[_R] = None

    def __iter__(self) -> Iterator[OutputEvent]:
        if self._events is not None:
            raise RuntimeError("an OutputStream can be iterated only once")
        self._events = self._read()
        return self._events

    def __enter__(self) -> "OutputStream[_R]":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events is not None:
            self._events.close()

    def _read(self) -> Generator[OutputEvent, None, None]:
        with self._http.stream(
            self._method,
            self._path,
            body=self._body,
            headers={"accept": NDJSON},
            timeout=self._timeout,
            retry_safe=self._retry_safe,
        ) as response:
            if not response.headers.get("content-type", "").startswith(NDJSON):
                # A server that does not stream answers with the plain
                # result: its output comes as one event per stream.
                result = from_wire(self._result_type, decode_json(response.read(), response.status_code))
                for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
                    if data:
                        yield OutputEvent(stream, data)
                self.result = result
                return
            decoder = CommandStreamDecoder(self._result_type)
            for chunk in response.iter_bytes():
                for event in decoder.push(chunk):
                    yield event
            for event in decoder.end():
                yield event
            self.result = decoder.result  # type: ignore[assignment]


def run_command(
    http: Transport,
    path: str,
    body: Dict[str, Any],
    *,
    timeout: Optional[float],
    on_stdout: Optional[OutputCallback],
    on_stderr: Optional[OutputCallback],
    result_type: Type[_R],
) -> _R:
    """Sends a command-shaped request: plain JSON, or NDJSON when a callback wants the output live."""
    deadline = or_default(timeout, DEFAULT_COMMAND_TIMEOUT) + COMMAND_DEADLINE_SLACK
    retry_safe = body.get("requestId") is not None
    if on_stdout is None and on_stderr is None:
        answer = http.json("POST", path, body=body, timeout=deadline, retry_safe=retry_safe)
        return from_wire(result_type, answer)
    output = OutputStream(
        http, "POST", path, body=body, timeout=deadline, retry_safe=retry_safe, result_type=result_type
    )
    return _collect(output, on_stdout, on_stderr)


def _collect(
    output: OutputStream[_R], on_stdout: Optional[OutputCallback], on_stderr: Optional[OutputCallback]
) -> _R:
    with output:
        for event in output:
            deliver((event,), on_stdout, on_stderr)
    assert output.result is not None  # the decoder raised otherwise
    return output.result


def command_body(
    command: Union[str, Sequence[str]],
    *,
    timeout: Optional[float],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    stdin: Optional[str],
    max_output_bytes: Optional[int],
    request_id: Optional[str],
) -> Dict[str, Any]:
    return compact(
        {
            **command_target(command),
            "env": dict(env) if env is not None else None,
            "cwd": cwd,
            "user": user,
            "stdin": stdin,
            "timeoutMs": ms(timeout),
            "maxOutputBytes": max_output_bytes,
            "requestId": request_id,
        }
    )


class Commands:
    """``sandbox.commands``: commands through the sandbox's command log.

    Every command has an ID; results stay readable for an hour (256 per
    sandbox), and a ``request_id`` makes a command run at most once, so a
    call that carries one is resent after a lost answer.
    """

    def __init__(self, http: Transport, sandbox_id: str, default_timeout: float) -> None:
        self._http = http
        self._path = f"/v1/sandboxes/{segment(sandbox_id)}/commands"
        self._timeout = default_timeout

    def run(
        self,
        command: Union[str, Sequence[str]],
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> CommandResult:
        """Runs a command and waits for it: a string is a shell line (the
        platform's shell), a sequence is argv. ``timeout`` (seconds, default
        60) is enforced by the server, which kills the whole process tree.
        With ``on_stdout``/``on_stderr`` the output streams to them as text,
        in order. A non-zero exit is a result, not an error.

        Raises ``SandboxNotFound``, ``SandboxNotRunning``, ``InvalidArgument``,
        ``DeadlineExceeded``, ``Unavailable``.
        """
        body = command_body(
            command,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )
        return run_command(
            self._http,
            self._path,
            body,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            result_type=CommandResult,
        )

    def stream(
        self,
        command: Union[str, Sequence[str]],
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> OutputStream[CommandResult]:
        """Runs a command; iterate the answer for its output as it comes (see ``run``)."""
        body = command_body(
            command,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )
        return OutputStream(
            self._http,
            "POST",
            self._path,
            body=body,
            timeout=or_default(timeout, DEFAULT_COMMAND_TIMEOUT) + COMMAND_DEADLINE_SLACK,
            retry_safe=request_id is not None,
            result_type=CommandResult,
        )

    def start(
        self,
        command: Union[str, Sequence[str]],
        *,
        stdin_open: bool = False,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> "CommandHandle":
        """Starts a background command and returns its handle at once.
        ``stdin_open`` keeps its stdin open for ``send_stdin`` until ``close_stdin``."""
        body = command_body(
            command,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )
        body["background"] = True
        if stdin_open:
            body["stdinOpen"] = True
        answer = self._http.json(
            "POST", self._path, body=body, timeout=self._timeout, retry_safe=request_id is not None
        )
        info = from_wire(CommandInfo, answer)
        return CommandHandle(self._http, self._path, info.command_id, info, self._timeout)

    def get(self, command_id: str, *, timeout: Optional[float] = None) -> "CommandHandle":
        """Reconnects to a command by ID (running, or finished within the
        retention). Raises ``CommandNotFound``."""
        handle = CommandHandle(self._http, self._path, command_id, None, self._timeout)
        handle.refresh(timeout=timeout)
        return handle

    def list(self, *, timeout: Optional[float] = None) -> List[CommandInfo]:
        """Running commands, then finished ones still retained, newest first."""
        answer = self._http.json("GET", self._path, timeout=or_default(timeout, self._timeout), retry_safe=True)
        return [from_wire(CommandInfo, c) for c in answer["commands"]]


class CommandHandle:
    """A command by ID: wait, kill, signal, stdin, output (also from another client)."""

    def __init__(
        self, http: Transport, base: str, command_id: str, info: Optional[CommandInfo], default_timeout: float
    ) -> None:
        self._http = http
        self.id = command_id
        #: Last known state.
        self.info = info
        self._path = f"{base}/{segment(command_id)}"
        self._timeout = default_timeout

    def refresh(self, *, timeout: Optional[float] = None) -> CommandInfo:
        answer = self._http.json("GET", self._path, timeout=or_default(timeout, self._timeout), retry_safe=True)
        self.info = from_wire(CommandInfo, answer)
        return self.info

    def wait(self, *, timeout: Optional[float] = None) -> CommandResult:
        """Waits for the result. With ``timeout`` (seconds) the server gives up
        after that long with ``DeadlineExceeded``; the command keeps running."""
        params = [("timeoutMs", str(ms(timeout)))] if timeout is not None else None
        answer = self._http.json(
            "GET",
            f"{self._path}/wait",
            params=params,
            timeout=or_default(timeout, LONG_WAIT) + COMMAND_DEADLINE_SLACK,
            retry_safe=True,
        )
        return from_wire(CommandResult, answer)

    def kill(self, *, timeout: Optional[float] = None) -> None:
        """Kills the command's whole process tree; its outcome becomes ``killed``."""
        self._http.json("POST", f"{self._path}/kill", timeout=or_default(timeout, self._timeout), retry_safe=True)

    def signal(self, signal: Union[str, int], *, timeout: Optional[float] = None) -> None:
        """Sends a signal (``"SIGTERM"``, ``"SIGINT"``, a number) to the command's process group."""
        self._http.json(
            "POST", f"{self._path}/signal", body={"signal": signal}, timeout=or_default(timeout, self._timeout)
        )

    def send_stdin(
        self,
        data: Union[str, bytes, Iterable[bytes]],
        *,
        eof: bool = False,
        timeout: Optional[float] = None,
    ) -> int:
        """Streams bytes to the command's stdin (started with ``stdin_open``);
        ``eof`` closes it after them. Returns the number of bytes written."""
        content = data.encode() if isinstance(data, str) else data
        with self._http.stream(
            "POST",
            f"{self._path}/stdin",
            params=[("eof", "1")] if eof else None,
            content=content,
            headers={"content-type": "application/octet-stream"},
            timeout=or_default(timeout, LONG_WAIT),
        ) as response:
            answer = decode_json(response.read(), response.status_code)
        return int(answer["bytes"])

    def close_stdin(self, *, timeout: Optional[float] = None) -> None:
        """Closes the command's stdin (it reads EOF)."""
        self.send_stdin(b"", eof=True, timeout=timeout)

    def output(
        self,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
    ) -> CommandResult:
        """Delivers the output kept so far (head and tail within the cap), then
        live output, to the callbacks, and returns the result."""
        return _collect(self.stream(timeout=timeout), on_stdout, on_stderr)

    def stream(self, *, timeout: Optional[float] = None) -> OutputStream[CommandResult]:
        """The output kept so far, then live output, as an ``OutputStream``."""
        return OutputStream(
            self._http,
            "GET",
            f"{self._path}/output",
            body=None,
            timeout=or_default(timeout, LONG_WAIT),
            retry_safe=True,
            result_type=CommandResult,
        )

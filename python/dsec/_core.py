"""What the asyncio client and its sync twin share and is not I/O.

Settings, default deadlines, the retry policy, request IDs, the mapping of
``httpx`` failures to DSec errors, and the decoder of the NDJSON command
stream. The I/O classes live once, in ``dsec/_async``; ``dsec/_sync`` is
generated from them (``python/tools/gen_sync.py``).
"""

from __future__ import annotations

import base64
import codecs
import importlib
import json
import os
import random
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union
from urllib.parse import quote

import httpx

from .errors import DSecError, DeadlineExceeded, Internal, InvalidArgument, Unavailable, error_from_body
from .models import CommandResult, OutputEvent, from_wire

DEFAULT_URL = "http://127.0.0.1:7420"
#: Deadline of calls that do not say otherwise, seconds.
DEFAULT_TIMEOUT = 30.0
#: Deadline of ``run_container``, seconds (the paper's ``timeout=120``).
DEFAULT_CREATE_TIMEOUT = 120.0
# A full VM boots Debian and X: minutes under TCG (no KVM).
DEFAULT_VM_CREATE_TIMEOUT = 900.0
#: The server's default command timeout, seconds (docs/CONVENTIONS.md, ``CommandBody``).
DEFAULT_COMMAND_TIMEOUT = 60.0
#: Slack on top of a command's own timeout before the client gives up on the answer.
COMMAND_DEADLINE_SLACK = 30.0
#: Deadline of calls that wait on work: snapshot, fork, whole-job operations.
DEFAULT_LIFECYCLE_TIMEOUT = 120.0
#: How long a file transfer may wait for the server between chunks.
TRANSFER_TIMEOUT = 120.0
#: Waiting on a background command has no deadline of its own unless given (7 days).
LONG_WAIT = 7 * 24 * 3600.0
#: Retries after the first attempt, for calls that are safe to resend.
DEFAULT_MAX_RETRIES = 3

Params = List[Tuple[str, str]]


def resolve_settings(url: Optional[str], api_key: Optional[str]) -> Tuple[str, Optional[str]]:
    """The apiserver URL and key: the arguments, else ``DSEC_URL``/``DSEC_API_KEY``."""
    base = url or os.environ.get("DSEC_URL") or DEFAULT_URL
    parsed = httpx.URL(base) if "://" in base else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidArgument(f"DSec URL must be http(s)://host[:port]: {base!r}", field="url")
    return base.rstrip("/"), api_key or os.environ.get("DSEC_API_KEY") or None


def new_request_id() -> str:
    """An idempotency key (``[A-Za-z0-9._:-]{1,128}``) for a call the SDK may resend."""
    return f"py-{uuid.uuid4().hex}"


def segment(value: str) -> str:
    """One path segment, percent-encoded (an ID or a session name is never a path)."""
    return quote(value, safe="")


def compact(body: Mapping[str, Any]) -> Dict[str, Any]:
    """A JSON body without its ``None`` fields (the server's defaults apply)."""
    return {k: v for k, v in body.items() if v is not None}


def command_target(command: Union[str, Sequence[str]]) -> Dict[str, Any]:
    """A string is a shell line (the platform's shell), a sequence is argv."""
    if isinstance(command, str):
        return {"shell": command}
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidArgument("a command is a shell string or a non-empty list of strings", field="argv")
    return {"argv": argv}


def or_default(timeout: Optional[float], default: float) -> float:
    """The call's ``timeout`` in seconds, or the default when it gives none."""
    return default if timeout is None else timeout


def ms(seconds: Optional[float]) -> Optional[int]:
    """Seconds (the SDK's unit) as the wire's whole milliseconds."""
    return None if seconds is None else max(1, int(round(seconds * 1000)))


# --- retries -----------------------------------------------------------------

#: Codes worth resending a retry-safe call for: the platform was briefly
#: down, full, or over quota. `resource_exhausted` is not among them: the
#: limit is the sandbox's own and only the caller can free it (docs/errors.md).
RETRY_CODES = frozenset({"unavailable", "capacity_exhausted", "quota_exceeded"})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, for calls that are safe to resend."""

    max_retries: int = DEFAULT_MAX_RETRIES
    base_delay: float = 0.25
    max_delay: float = 4.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        ceiling = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def should_retry(self, error: DSecError, attempt: int, retry_safe: bool) -> bool:
        """Whether to resend after ``error`` on attempt ``attempt`` (1-based).

        A request that never reached the server is always safe to resend; one
        that may have is resent only when ``retry_safe`` (idempotent by nature,
        or carrying a request ID the server deduplicates on).
        """
        if attempt > self.max_retries:
            return False
        if getattr(error, "never_sent", False):
            return True
        if not retry_safe:
            return False
        # A create with this requestId is still being served (the first try
        # outlived its client): the answer will be there shortly.
        if error.code == "conflict" and error.field == "requestId":
            return True
        return error.code in RETRY_CODES


def _never_sent(error: DSecError) -> DSecError:
    """Marks an error after which no byte of the request reached the server."""
    setattr(error, "never_sent", True)
    return error


def transport_error(err: httpx.HTTPError, base_url: str, method: str, path: str) -> DSecError:
    """The DSec error for a failure of ``httpx`` itself (no HTTP answer)."""
    where = f"{method} {path}"
    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return _never_sent(
            Unavailable(
                f"cannot reach DSec at {base_url}: {err} — is `dsec up` running?",
                details={"errno": type(err).__name__},
            )
        )
    if isinstance(err, httpx.PoolTimeout):
        return _never_sent(Unavailable(f"{where}: no free connection to DSec in time"))
    if isinstance(err, httpx.TimeoutException):
        return DeadlineExceeded(f"{where} ran past its deadline ({type(err).__name__})")
    return Unavailable(f"connection to DSec at {base_url} failed during {where}: {err}")


def http_timeout(seconds: float) -> httpx.Timeout:
    """httpx's per-operation limits for a call with a ``seconds`` deadline.

    httpx bounds each wait (connect, each read, each write), not the whole
    exchange: a streamed answer may run longer as long as bytes keep coming.
    """
    return httpx.Timeout(seconds, connect=min(seconds, 10.0))


def async_connection_pool(max_connections: int) -> httpx.AsyncHTTPTransport:
    """The asyncio client's connection pool (asyncio turns Nagle off by itself)."""
    return httpx.AsyncHTTPTransport(limits=_limits(max_connections))


def sync_connection_pool(max_connections: int) -> httpx.HTTPTransport:
    """The blocking client's connection pool, with Nagle off.

    httpx writes a request's headers and body in two sends; with Nagle on,
    the body waits for the ACK of the headers, which the server delays:
    40 ms added to every POST (measured: exec p50 49 ms instead of 4 ms).
    """
    nodelay = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Passed by keyword from a dict: httpx < 0.24 does not know the option.
    options: Dict[str, Any] = {"socket_options": [nodelay]}
    try:
        return httpx.HTTPTransport(limits=_limits(max_connections), **options)
    except TypeError:
        pass
    # httpx < 0.24 (Debian 12's 0.23) has no socket_options: its httpcore
    # pool gets a network backend that sets the option on connect.
    import httpcore

    sync_backend: Any = importlib.import_module("httpcore.backends.sync").SyncBackend()

    class NoDelayBackend:
        def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
            stream = sync_backend.connect_tcp(*args, **kwargs)
            stream.get_extra_info("socket").setsockopt(*nodelay)
            return stream

        def __getattr__(self, name: str) -> Any:
            return getattr(sync_backend, name)

    backend: Any = NoDelayBackend()
    transport = httpx.HTTPTransport(limits=_limits(max_connections))
    transport._pool = httpcore.ConnectionPool(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=transport._pool._keepalive_expiry,
        ssl_context=transport._pool._ssl_context,
        network_backend=backend,
    )
    return transport


def _limits(max_connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)


def decode_json(response_body: bytes, status: int) -> Any:
    """A 2xx answer's JSON (``None`` for an empty body)."""
    if not response_body:
        return None
    try:
        return json.loads(response_body)
    except ValueError:
        raise Internal(f"DSec answered {status} with a body that is not JSON") from None


def raise_for_answer(status: int, body: bytes) -> None:
    """Raises the DSec error of a non-2xx answer."""
    if 200 <= status < 300:
        return
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    raise error_from_body(parsed, status)


# --- function calls (docs/fncall.md) ----------------------------------------

#: Deadline slack over a call's own time limit (queueing for a warm worker, the hops), seconds.
FNCALL_SLACK = 60.0
#: A call's own time limit when it names none (the server's default), seconds.
FNCALL_DEFAULT_LIMIT = 10.0
#: Deadline of one ``map`` batch request, seconds.
FNCALL_MAP_TIMEOUT = 6 * 3600.0
#: A batch body stays under the API's 1 MiB request limit.
FNCALL_MAX_BATCH_BYTES = 900 * 1024
FNCALL_MAX_BATCH_CALLS = 10_000
#: Times ``map`` sends a call again: after the platform refused it for now
#: (``RETRY_CODES``), or when its batch's stream broke before it finished.
FNCALL_MAP_RESENDS = 3
FNCALL_BACKOFF = 0.25
FNCALL_MAX_BACKOFF = 4.0


def fncall_backoff(attempt: int) -> float:
    """Seconds ``map`` waits before sending refused calls again (0-based ``attempt``)."""
    return min(FNCALL_MAX_BACKOFF, FNCALL_BACKOFF * 2.0**attempt)


def fncall_retry_after(error: DSecError) -> float:
    """The wait a ``QuotaExceeded`` names (``details.retryAfterMs``), capped, in seconds; 0 when none."""
    details = getattr(error, "details", None) or {}
    try:
        ms = float(details.get("retryAfterMs", 0))
    except (TypeError, ValueError):
        return 0.0
    return min(ms / 1000, FNCALL_MAX_BACKOFF) if ms > 0 else 0.0


def fncall_body(call: Mapping[str, Any]) -> Dict[str, Any]:
    """A call as the API's JSON: top-level keys in snake_case or camelCase
    (``timeout_ms`` or ``timeoutMs``), ``None`` fields left out. The keys of
    ``files``, ``env`` and ``edge_selector`` are the caller's and stay as given."""
    if not isinstance(call, Mapping):
        raise InvalidArgument("a function call is a mapping (language, code, stdin, ...)", field="calls")
    body: Dict[str, Any] = {}
    for key, value in call.items():
        if value is None:
            continue
        head, *rest = str(key).split("_")
        body[head + "".join(part.capitalize() for part in rest)] = value
    return body


def fncall_batches(calls: Sequence[Dict[str, Any]]) -> List[List[Tuple[int, Dict[str, Any]]]]:
    """Splits wire bodies into batches under the size and count limits, numbering them."""
    out: List[List[Tuple[int, Dict[str, Any]]]] = []
    current: List[Tuple[int, Dict[str, Any]]] = []
    size = 0
    for index, body in enumerate(calls):
        n = len(json.dumps(body).encode()) + 1
        if current and (size + n > FNCALL_MAX_BATCH_BYTES or len(current) >= FNCALL_MAX_BATCH_CALLS):
            out.append(current)
            current, size = [], 0
        current.append((index, body))
        size += n
    if current:
        out.append(current)
    return out


class NdjsonLines:
    """Splits a byte stream into parsed JSON lines (the batch stream of ``POST /v1/fncall/batch``)."""

    def __init__(self) -> None:
        self._pending = b""

    def push(self, chunk: bytes) -> List[Any]:
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        return [self._parse(line) for line in lines if line.strip()]

    def end(self) -> List[Any]:
        rest, self._pending = self._pending, b""
        return [self._parse(rest)] if rest.strip() else []

    @staticmethod
    def _parse(line: bytes) -> Any:
        try:
            return json.loads(line)
        except ValueError:
            raise Internal("malformed line in the fncall batch stream") from None


# --- the NDJSON command stream -----------------------------------------------


class CommandStreamDecoder:
    """Decodes the NDJSON events of a streamed command (``Accept: application/x-ndjson``).

    Output events carry base64 bytes; they are decoded to UTF-8 per stream,
    so a character split across two events comes out whole. ``push`` and
    ``end`` return the output events in order; ``result`` is set by the final
    ``result`` event. An ``error`` event raises its ``DSecError``.
    """

    def __init__(self, result_type: Type[CommandResult] = CommandResult) -> None:
        self._result_type = result_type
        self._pending = b""
        self._text = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }
        self.result: Optional[CommandResult] = None

    def push(self, chunk: bytes) -> List[OutputEvent]:
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        return [ev for line in lines for ev in self._event(line)]

    def end(self) -> List[OutputEvent]:
        """Call at the end of the body; raises ``Unavailable`` if no result came."""
        events = self._event(self._pending)
        self._pending = b""
        events.extend(self._flush())
        if self.result is None:
            raise Unavailable("the command stream ended before its result")
        return events

    def _event(self, line: bytes) -> List[OutputEvent]:
        if not line.strip():
            return []
        try:
            event = json.loads(line)
        except ValueError:
            raise Internal("malformed line in the command stream") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in ("stdout", "stderr"):
            data = base64.b64decode(event.get("data") or "")
            text = self._text[kind].decode(data)
            return [OutputEvent(kind, text)] if text else []
        if kind == "result":
            events = self._flush()
            self.result = from_wire(self._result_type, event.get("result"))
            return events
        if kind == "error":
            raise error_from_body({"error": event.get("error")}, 500)
        # Unknown event types are skipped so the server can add new ones.
        return []

    def _flush(self) -> List[OutputEvent]:
        events = []
        for stream, decoder in self._text.items():
            tail = decoder.decode(b"", final=True)
            if tail:
                events.append(OutputEvent(stream, tail))
        return events


def deliver(
    events: Iterable[OutputEvent],
    on_stdout: Optional[Callable[[str], Any]],
    on_stderr: Optional[Callable[[str], Any]],
) -> None:
    """Hands output events to the caller's callbacks, in order."""
    for event in events:
        callback = on_stdout if event.stream == "stdout" else on_stderr
        if callback is not None:
            callback(event.data)

"""What the asyncio client and its sync twin share and is not I/O.

Settings, default deadlines, the retry policy, request IDs, the mapping of
``httpx`` failures to DSec errors, the decoder of the NDJSON command
stream, and the two connection pools (asyncio and blocking: httpx
transports with a lean HTTP/1.1 path for JSON calls). The other I/O
classes live once, in ``dsec/_async``; ``dsec/_sync`` is generated from
them (``python/tools/gen_sync.py``).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import importlib
import json
import os
import random
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union
from urllib.parse import quote, urlencode

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
#: How long ``build_image`` waits for a build (the server's default build timeout).
DEFAULT_BUILD_TIMEOUT = 1800.0
#: How often ``build_image`` asks how a build goes.
BUILD_POLL_INTERVAL = 1.0
#: The most a build context may weigh (the server's default ``maxContextBytes``).
MAX_BUILD_CONTEXT_BYTES = 2**30

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


def build_context_tar(context_dir: Union[str, "os.PathLike[str]"]) -> bytes:
    """The directory as the tar archive ``POST /v1/images/builds`` takes.

    Entries are relative to ``context_dir`` (``./…``); symlinks are sent as
    links, never followed; owners become root and device nodes, FIFOs and
    sockets are refused here, as the server would. ``InvalidArgument``
    (field ``context_dir``) for a missing directory, a special file, or a
    context past ``MAX_BUILD_CONTEXT_BYTES``.
    """
    import io
    import tarfile

    root = os.fspath(context_dir)
    if not os.path.isdir(root):
        raise InvalidArgument(f"{root!r} is not a directory", field="context_dir")

    def only_plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
            raise InvalidArgument(
                f"{info.name!r} in the build context is a device node, FIFO or socket", field="context_dir"
            )
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in sorted(os.listdir(root)):
            archive.add(os.path.join(root, name), arcname=name, recursive=True, filter=only_plain)
            if buf.tell() > MAX_BUILD_CONTEXT_BYTES:
                raise InvalidArgument(
                    f"the build context {root!r} is larger than {MAX_BUILD_CONTEXT_BYTES} bytes", field="context_dir"
                )
    data = buf.getvalue()
    if len(data) > MAX_BUILD_CONTEXT_BYTES:
        raise InvalidArgument(
            f"the build context {root!r} is larger than {MAX_BUILD_CONTEXT_BYTES} bytes", field="context_dir"
        )
    return data


def build_params(
    name: str,
    dockerfile: str,
    build_args: Optional[Mapping[str, str]],
    target: Optional[str],
    timeout: float,
) -> Params:
    """The query of ``POST /v1/images/builds``."""
    params: Params = [("name", name), ("dockerfile", dockerfile)]
    for key, value in (build_args or {}).items():
        params.append(("buildArg", f"{key}={value}"))
    if target is not None:
        params.append(("target", target))
    params.append(("timeout", str(max(1, int(-(-timeout // 1))))))
    return params


def build_failure(info: Mapping[str, Any]) -> DSecError:
    """The error of a failed build (``errorCode``, ``error``, ``errorDetails``) as the SDK raises it."""
    body = {
        "error": {
            "code": info.get("errorCode") or "internal",
            "message": info.get("error") or "the build failed",
            "details": info.get("errorDetails") or {},
        }
    }
    return error_from_body(body, 400)


def monotonic() -> float:
    return time.monotonic()


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
#: down, full, over quota, or limiting this client. `resource_exhausted` is not
#: among them: the limit is the sandbox's own and only the caller can free it
#: (docs/errors.md).
RETRY_CODES = frozenset({"unavailable", "capacity_exhausted", "quota_exceeded", "rate_limited"})


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


def async_connection_pool(max_connections: int) -> "AsyncLeanTransport":
    """The asyncio client's connection pool (asyncio turns Nagle off by itself)."""
    return AsyncLeanTransport(max_connections)


def sync_connection_pool(max_connections: int) -> "SyncLeanTransport":
    """The blocking client's connection pool, with Nagle off.

    httpx writes a request's headers and body in two sends; with Nagle on,
    the body waits for the ACK of the headers, which the server delays:
    40 ms added to every POST (measured: exec p50 49 ms instead of 4 ms).
    """
    nodelay = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Passed by keyword from a dict: httpx < 0.24 does not know the option.
    options: Dict[str, Any] = {"socket_options": [nodelay]}
    try:
        return SyncLeanTransport(max_connections, **options)
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
    transport = SyncLeanTransport(max_connections)
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


# --- the lean HTTP/1.1 path of JSON calls --------------------------------------
#
# A JSON call (exec, create, get…) through httpx costs about a millisecond of
# client CPU per call (the request and URL models, httpcore's h11 state
# machine, anyio's cancel scopes); the exchange itself is one write and one
# read on a kept-alive connection. The connection pools below carry those
# calls straight on their own HTTP/1.1 connections (``exchange``) and stay
# httpx transports for everything streamed (NDJSON output, uploads,
# downloads). Plain ``http://`` only: an ``https://`` DSec URL goes through
# httpx for every call.

#: A kept-alive connection idle this long is not reused (the server's
#: ``Keep-Alive: timeout=`` minus a second wins when shorter).
LEAN_IDLE_SECONDS = 30.0
#: Largest response head (status line and headers) the lean path reads.
LEAN_MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class LeanOrigin:
    """Where lean requests go, and the header lines every request carries."""

    host: str
    port: int
    #: The URL's path prefix (``""`` at the root), put before every request path.
    prefix: str
    #: ``Host`` and the client's own headers, as request lines.
    fixed: bytes


def lean_origin(base_url: str, headers: Mapping[str, str]) -> Optional[LeanOrigin]:
    """The lean path's origin for a DSec URL, or None when httpx must carry every call (https)."""
    url = httpx.URL(base_url)
    if url.scheme != "http" or not url.host:
        return None
    port = url.port or 80
    host = f"[{url.host}]" if ":" in url.host else url.host
    lines = [f"host: {host}" if port == 80 else f"host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    fixed = ("".join(line + "\r\n" for line in lines)).encode("latin-1")
    return LeanOrigin(url.host, port, url.raw_path.decode("ascii").rstrip("/"), fixed)


def encode_request(
    origin: LeanOrigin,
    method: str,
    path: str,
    params: Optional[Sequence[Tuple[str, str]]],
    body: Optional[Mapping[str, Any]],
) -> bytes:
    """One HTTP/1.1 request, head and JSON body in one buffer (one write, so Nagle never holds the body)."""
    target = origin.prefix + path
    if params:
        target += "?" + urlencode(list(params), quote_via=quote)
    head = f"{method} {target} HTTP/1.1\r\n".encode("latin-1") + origin.fixed
    if body is None:
        return head + (b"content-length: 0\r\n\r\n" if method in ("POST", "PUT", "PATCH") else b"\r\n")
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return head + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data


@dataclass
class LeanHead:
    status: int
    #: The body's length; None when it is chunked (``chunked``) or runs to the end of the connection.
    length: Optional[int]
    chunked: bool
    #: Seconds the connection may be reused after the answer; 0: close it.
    keep_alive: float
    encoding: str


def parse_head(head: bytes, method: str) -> LeanHead:
    """The status line and headers of an answer (``ValueError`` for anything that is not HTTP/1.x)."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    status = int(rest[:3])
    fields: Dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line[:80]!r}")
        key = name.strip().lower()
        fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    length: Optional[int] = None
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        length = 0
    elif not chunked and "content-length" in fields:
        length = int(fields["content-length"])
        if length < 0:
            raise ValueError("negative content-length")
    connection = fields.get("connection", "").lower()
    keep = LEAN_IDLE_SECONDS
    for part in fields.get("keep-alive", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.lower() == "timeout" and value.isdigit():
            keep = min(keep, float(value) - 1.0)
    reusable = version == "HTTP/1.1" and "close" not in connection and (chunked or length is not None)
    return LeanHead(status, length, chunked, keep if reusable and keep > 0 else 0.0, fields.get("content-encoding", ""))


def chunk_size(line: bytes) -> int:
    """The size of a chunk from its size line (extensions ignored)."""
    return int(line.split(b";", 1)[0].strip(), 16)


def decode_content(head: LeanHead, body: bytes) -> bytes:
    """The body without its content coding (the lean path asks for none; a server may still use one)."""
    coding = head.encoding.lower()
    if coding in ("", "identity"):
        return body
    if coding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if coding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:
            return zlib.decompress(body, -zlib.MAX_WBITS)
    raise ValueError(f"unsupported content-encoding {coding!r}")


def lean_unreachable(origin: LeanOrigin, err: BaseException) -> DSecError:
    return _never_sent(
        Unavailable(
            f"cannot reach DSec at {origin.host}:{origin.port}: {err or type(err).__name__} — is `dsec up` running?",
            details={"errno": type(err).__name__},
        )
    )


def lean_broken(origin: LeanOrigin, where: str, err: BaseException) -> DSecError:
    detail = str(err) or type(err).__name__
    return Unavailable(f"connection to DSec at {origin.host}:{origin.port} failed during {where}: {detail}")


def lean_deadline(where: str) -> DSecError:
    return DeadlineExceeded(f"{where} ran past its deadline")


class _AsyncLeanConnection:
    __slots__ = ("reader", "writer", "idle_until")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_until = 0.0


class AsyncLeanTransport(httpx.AsyncHTTPTransport):
    """httpx's asyncio transport (streams) plus ``exchange``, the lean path of JSON calls."""

    def __init__(self, max_connections: int) -> None:
        super().__init__(limits=_limits(max_connections))
        self._lean_max = max_connections
        self._lean_idle: List[_AsyncLeanConnection] = []
        # Made in the event loop on first use (Python 3.9 binds a semaphore to the loop current at creation).
        self._lean_slots: Optional[asyncio.Semaphore] = None
        self._lean_closed = False

    async def exchange(
        self, origin: LeanOrigin, request: bytes, method: str, where: str, timeout: float
    ) -> Tuple[int, bytes]:
        """Sends one request and reads its whole answer: (status, body)."""
        if self._lean_closed:
            raise _never_sent(Unavailable(f"{where}: the client is closed"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._lean_slots is None:
            self._lean_slots = asyncio.Semaphore(self._lean_max)
        slots = self._lean_slots
        if slots.locked():
            try:
                await asyncio.wait_for(slots.acquire(), timeout)
            except asyncio.TimeoutError:
                raise _never_sent(Unavailable(f"{where}: no free connection to DSec in time")) from None
        else:
            await slots.acquire()
        try:
            conn = self._take_idle(loop.time())
            if conn is None:
                try:
                    reader, writer = await _within(
                        asyncio.open_connection(origin.host, origin.port, limit=LEAN_MAX_HEAD_BYTES),
                        min(timeout, 10.0),
                    )
                except (OSError, asyncio.TimeoutError) as err:
                    raise lean_unreachable(origin, err) from err
                conn = _AsyncLeanConnection(reader, writer)
            try:
                conn.writer.write(request)
                head, body = await _within(_async_read_answer(conn.reader, method), deadline - loop.time())
            except asyncio.TimeoutError:
                conn.writer.close()
                raise lean_deadline(where) from None
            except (OSError, EOFError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
                conn.writer.close()
                raise lean_broken(origin, where, err) from err
            except BaseException:
                conn.writer.close()
                raise
            if head.keep_alive > 0 and not self._lean_closed:
                conn.idle_until = loop.time() + head.keep_alive
                self._lean_idle.append(conn)
            else:
                conn.writer.close()
            try:
                return head.status, decode_content(head, body)
            except (ValueError, zlib.error) as err:
                raise lean_broken(origin, where, err) from err
        finally:
            slots.release()

    def _take_idle(self, now: float) -> Optional[_AsyncLeanConnection]:
        # The most recently used first; one the server closed meanwhile (EOF seen) or idle too long is dropped.
        while self._lean_idle:
            conn = self._lean_idle.pop()
            if conn.idle_until > now and not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.writer.close()
        return None

    async def aclose(self) -> None:
        self._lean_closed = True
        idle, self._lean_idle = self._lean_idle, []
        for conn in idle:
            conn.writer.close()
        await super().aclose()


async def _within(awaitable: Any, seconds: float) -> Any:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``seconds``.

    ``asyncio.wait_for`` runs the awaitable in a task of its own, a cost the
    hot path does not need: a timer cancels this task instead, as
    ``asyncio.timeout`` (Python 3.11 only) does.
    """
    if seconds <= 0:
        if hasattr(awaitable, "close"):
            awaitable.close()
        raise asyncio.TimeoutError()
    current = asyncio.current_task()
    assert current is not None
    task: "asyncio.Task[Any]" = current
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not expired:
            raise
        uncancel = getattr(task, "uncancel", None)
        if uncancel is not None:
            uncancel()
        raise asyncio.TimeoutError() from None
    finally:
        timer.cancel()


async def _async_read_answer(reader: asyncio.StreamReader, method: str) -> Tuple[LeanHead, bytes]:
    while True:
        head = parse_head(await reader.readuntil(b"\r\n\r\n"), method)
        if not 100 <= head.status < 200:
            break
    if head.length is not None:
        return head, (await reader.readexactly(head.length) if head.length else b"")
    if not head.chunked:
        return head, await reader.read()
    parts: List[bytes] = []
    while True:
        size = chunk_size(await reader.readuntil(b"\r\n"))
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return head, b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])


class _SyncLeanConnection:
    __slots__ = ("sock", "buffer", "idle_until")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.idle_until = 0.0

    def fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        self.sock.settimeout(remaining)
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buffer += data

    def read_until(self, marker: bytes, deadline: float, limit: int = LEAN_MAX_HEAD_BYTES) -> bytes:
        start = 0
        while True:
            at = self.buffer.find(marker, start)
            if at >= 0:
                out = bytes(self.buffer[: at + len(marker)])
                del self.buffer[: at + len(marker)]
                return out
            if len(self.buffer) > limit:
                raise ValueError("response head too long")
            start = max(0, len(self.buffer) - len(marker) + 1)
            self.fill(deadline)

    def read_exactly(self, n: int, deadline: float) -> bytes:
        while len(self.buffer) < n:
            self.fill(deadline)
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out

    def read_to_end(self, deadline: float) -> bytes:
        while True:
            try:
                self.fill(deadline)
            except EOFError:
                out = bytes(self.buffer)
                self.buffer.clear()
                return out

    def closed_by_peer(self) -> bool:
        """Whether the server closed (or wrote to) the idle connection: either way it cannot carry a request."""
        try:
            self.sock.setblocking(False)
            try:
                return self.sock.recv(1, socket.MSG_PEEK) is not None
            finally:
                self.sock.setblocking(True)
        except BlockingIOError:
            return False
        except OSError:
            return True


class SyncLeanTransport(httpx.HTTPTransport):
    """httpx's blocking transport (streams) plus ``exchange``, the lean path of JSON calls."""

    def __init__(self, max_connections: int, **options: Any) -> None:
        super().__init__(limits=_limits(max_connections), **options)
        self._lean_idle: List[_SyncLeanConnection] = []
        self._lean_lock = threading.Lock()
        self._lean_slots = threading.BoundedSemaphore(max_connections)
        self._lean_closed = False

    def exchange(
        self, origin: LeanOrigin, request: bytes, method: str, where: str, timeout: float
    ) -> Tuple[int, bytes]:
        """Sends one request and reads its whole answer: (status, body)."""
        if self._lean_closed:
            raise _never_sent(Unavailable(f"{where}: the client is closed"))
        deadline = time.monotonic() + timeout
        if not self._lean_slots.acquire(timeout=timeout):
            raise _never_sent(Unavailable(f"{where}: no free connection to DSec in time"))
        try:
            conn = self._take_idle(time.monotonic())
            if conn is None:
                try:
                    sock = socket.create_connection((origin.host, origin.port), timeout=min(timeout, 10.0))
                except OSError as err:
                    raise lean_unreachable(origin, err) from err
                # One write per request already; no Nagle wait on anything else either.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _SyncLeanConnection(sock)
            try:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.sock.sendall(request)
                head, body = _sync_read_answer(conn, method, deadline)
            except socket.timeout:
                conn.sock.close()
                raise lean_deadline(where) from None
            except (OSError, EOFError, ValueError) as err:
                conn.sock.close()
                raise lean_broken(origin, where, err) from err
            except BaseException:
                conn.sock.close()
                raise
            if head.keep_alive > 0 and not self._lean_closed and not conn.buffer:
                conn.idle_until = time.monotonic() + head.keep_alive
                with self._lean_lock:
                    self._lean_idle.append(conn)
            else:
                conn.sock.close()
            try:
                return head.status, decode_content(head, body)
            except (ValueError, zlib.error) as err:
                raise lean_broken(origin, where, err) from err
        finally:
            self._lean_slots.release()

    def _take_idle(self, now: float) -> Optional[_SyncLeanConnection]:
        while True:
            with self._lean_lock:
                if not self._lean_idle:
                    return None
                conn = self._lean_idle.pop()
            if conn.idle_until > now and not conn.closed_by_peer():
                return conn
            conn.sock.close()

    def close(self) -> None:
        self._lean_closed = True
        with self._lean_lock:
            idle, self._lean_idle = self._lean_idle, []
        for conn in idle:
            conn.sock.close()
        super().close()


def _sync_read_answer(conn: _SyncLeanConnection, method: str, deadline: float) -> Tuple[LeanHead, bytes]:
    while True:
        head = parse_head(conn.read_until(b"\r\n\r\n", deadline), method)
        if not 100 <= head.status < 200:
            break
    if head.length is not None:
        return head, conn.read_exactly(head.length, deadline)
    if not head.chunked:
        return head, conn.read_to_end(deadline)
    parts: List[bytes] = []
    while True:
        size = chunk_size(conn.read_until(b"\r\n", deadline))
        if size == 0:
            while conn.read_until(b"\r\n", deadline) != b"\r\n":
                pass  # trailers
            return head, b"".join(parts)
        parts.append(conn.read_exactly(size + 2, deadline)[:-2])


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
#: The longest ``details.retryAfterMs`` of a ``QuotaExceeded`` that ``map`` waits for, seconds.
FNCALL_MAX_RETRY_AFTER = 4.0


def fncall_retry_after(error: DSecError) -> float:
    """The wait a ``QuotaExceeded`` names (``details.retryAfterMs``), capped, in seconds; 0 when none."""
    details = getattr(error, "details", None) or {}
    try:
        ms = float(details.get("retryAfterMs", 0))
    except (TypeError, ValueError):
        return 0.0
    return min(ms / 1000, FNCALL_MAX_RETRY_AFTER) if ms > 0 else 0.0


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

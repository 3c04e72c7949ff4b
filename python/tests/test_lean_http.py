"""The lean HTTP/1.1 path of JSON calls (``dsec._core``, ``exchange``).

Both clients, against a raw loopback server that answers from a script, so
what goes on the wire (one connection kept alive, one request per write)
and every way an answer can come back (length, chunks, gzip, a closed or
silent connection) can be checked byte by byte.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

from dsec import DeadlineExceeded, SandboxNotFound, Unavailable
from dsec._async.transport import Transport as AsyncTransport
from dsec._core import RetryPolicy, parse_head
from dsec._sync.transport import Transport as SyncTransport

#: (request head, request body) → the raw answer; None closes the connection unanswered, b"" never answers.
Script = Callable[[int, bytes, bytes], Optional[bytes]]


def answer(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


class RawServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: List[Tuple[bytes, bytes]] = []
        self.connections = 0
        self.reads: List[int] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._open: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    self.reads.append(len(chunk))
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                self.requests.append((head, body))
                out = self.script(len(self.requests) - 1, head, body)
                if out is None:
                    conn.close()
                    return
                if out:
                    conn.sendall(out)
        except OSError:
            return

    def close(self) -> None:
        self._sock.close()
        for conn in self._open:
            conn.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Script], RawServer]]:
    servers: List[RawServer] = []

    def start(script: Script) -> RawServer:
        servers.append(RawServer(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


OK = answer(b'{"ok":true}')


async def test_json_calls_share_one_kept_alive_connection_one_write_each(serve: Callable[[Script], RawServer]) -> None:
    server = serve(lambda i, head, body: OK)
    http = AsyncTransport(server.url, "dsk_key", retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        for _ in range(3):
            assert await http.json("POST", "/v1/x", timeout=5, body={"argv": ["true"], "é": 1}) == {"ok": True}
        assert await http.json("GET", "/v1/y", timeout=5, params=[("q", "a b/c"), ("n", "1")]) == {"ok": True}
    finally:
        await http.close()
    assert server.connections == 1
    head, body = server.requests[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/x HTTP/1.1"
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert fields["authorization"] == "Bearer dsk_key"
    assert fields["content-type"] == "application/json"
    assert fields["host"] == server.url[len("http://") :]
    assert json.loads(body) == {"argv": ["true"], "é": 1}
    assert int(fields["content-length"]) == len(body)
    assert server.requests[3][0].split(b"\r\n")[0] == b"GET /v1/y?q=a%20b%2Fc&n=1 HTTP/1.1"
    assert server.requests[3][1] == b""


async def test_chunked_gzip_and_error_answers(serve: Callable[[Script], RawServer]) -> None:
    data = json.dumps({"big": "x" * 5000}).encode()
    zipped = gzip.compress(b'{"z":1}')
    err = json.dumps({"error": {"code": "sandbox_not_found", "message": "no sandbox sb-1"}}).encode()
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in (data[:100], data[100:]))
    answers = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\nx-trailer: 1\r\n\r\n",
        answer(zipped, headers="content-encoding: gzip\r\n"),
        answer(err, status="404 Not Found"),
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ]
    server = serve(lambda i, head, body: answers[i])
    http = AsyncTransport(server.url, None, retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        assert await http.json("GET", "/a", timeout=5) == {"big": "x" * 5000}
        assert await http.json("GET", "/b", timeout=5) == {"z": 1}
        with pytest.raises(SandboxNotFound):
            await http.json("GET", "/c", timeout=5)
        assert await http.json("DELETE", "/d", timeout=5) is None
    finally:
        await http.close()
    assert server.connections == 1


async def test_a_closed_connection_is_not_reused_and_a_lost_answer_is_unavailable(
    serve: Callable[[Script], RawServer]
) -> None:
    def script(i: int, head: bytes, body: bytes) -> Optional[bytes]:
        if i == 0:
            return answer(b"{}", headers="connection: close\r\n")
        if i == 2:
            return None  # the connection breaks before the answer
        return answer(b"{}", headers="keep-alive: timeout=72\r\n")

    server = serve(script)
    http = AsyncTransport(server.url, None, retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        await http.json("POST", "/1", timeout=5)
        await http.json("POST", "/2", timeout=5)  # a new connection: the first said close
        with pytest.raises(Unavailable) as lost:
            await http.json("POST", "/3", timeout=5)
        # The request reached the server: it is not marked as never sent (no blind resend).
        assert not getattr(lost.value, "never_sent", False)
        await http.json("POST", "/4", timeout=5)
    finally:
        await http.close()
    assert server.connections == 3
    assert len(server.requests) == 4


async def test_deadline_nothing_listening_and_a_closed_client() -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    http = AsyncTransport(silent_url, None, retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await http.json("POST", "/x", timeout=0.3)
        assert time.monotonic() - started < 5
        # The timer that ended the call does not leak into the task: it goes on.
        await asyncio.sleep(0.01)
    finally:
        await http.close()
        silent.close()
    with pytest.raises(Unavailable):
        await http.json("GET", "/x", timeout=1)

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    nowhere = AsyncTransport(f"http://127.0.0.1:{port}", None, retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        with pytest.raises(Unavailable) as refused:
            await nowhere.json("POST", "/x", timeout=2)
        assert getattr(refused.value, "never_sent", False)
    finally:
        await nowhere.close()


async def test_connections_are_bounded_and_concurrent_calls_get_their_own(
    serve: Callable[[Script], RawServer]
) -> None:
    def slow(i: int, head: bytes, body: bytes) -> bytes:
        time.sleep(0.05)
        return answer(json.dumps({"path": head.split(b" ")[1].decode()}).encode())

    server = serve(slow)
    http = AsyncTransport(server.url, None, retry=RetryPolicy(max_retries=0), max_connections=2)
    try:
        got = await asyncio.gather(*(http.json("GET", f"/{n}", timeout=10) for n in range(6)))
    finally:
        await http.close()
    assert [g["path"] for g in got] == [f"/{n}" for n in range(6)]
    assert server.connections == 2


def test_sync_client_same_wire(serve: Callable[[Script], RawServer]) -> None:
    zipped = gzip.compress(b'{"z":1}')

    def script(i: int, head: bytes, body: bytes) -> Optional[bytes]:
        if i == 1:
            return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\n{\"a\":1}\r\n0\r\n\r\n"
        if i == 2:
            return answer(zipped, headers="content-encoding: gzip\r\nconnection: close\r\n")
        if i == 4:
            return b""  # never answers
        return answer(b'{"ok":true}')

    server = serve(script)
    http = SyncTransport(server.url, "dsk_key", retry=RetryPolicy(max_retries=0), max_connections=4)
    try:
        assert http.json("POST", "/v1/x", timeout=5, body={"argv": ["true"]}) == {"ok": True}
        assert http.json("GET", "/v1/y", timeout=5) == {"a": 1}
        assert http.json("GET", "/v1/z", timeout=5) == {"z": 1}
        assert http.json("GET", "/v1/w", timeout=5) == {"ok": True}
        with pytest.raises(DeadlineExceeded):
            http.json("POST", "/v1/hang", timeout=0.3)
        assert http.json("GET", "/v1/after", timeout=5) == {"ok": True}
    finally:
        http.close()
    # One for the first three, a new one after `connection: close`, one after the deadline.
    assert server.connections == 3
    head, body = server.requests[0]
    assert head.split(b"\r\n")[0] == b"POST /v1/x HTTP/1.1"
    assert b"authorization: Bearer dsk_key" in head
    assert json.loads(body) == {"argv": ["true"]}
    # Head and body leave in one write (no Nagle wait between them).
    assert server.reads[0] == len(head) + 4 + len(body)
    with pytest.raises(Unavailable):
        http.json("GET", "/v1/closed", timeout=1)


def test_answer_heads() -> None:
    h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nKeep-Alive: timeout=5\r\n\r\n", "GET")
    assert (h.status, h.length, h.chunked, h.keep_alive) == (200, 5, False, 4.0)
    h = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "GET")
    assert (h.length, h.chunked, h.keep_alive > 0) == (None, True, True)
    # No length and no chunks: the body runs to the end of the connection, which is not reused.
    h = parse_head(b"HTTP/1.1 200 OK\r\n\r\n", "GET")
    assert (h.length, h.chunked, h.keep_alive) == (None, False, 0.0)
    h = parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", "GET")
    assert h.keep_alive == 0.0
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", "HEAD").length == 0
    for bad in (b"SSH-2.0-x\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", b"HTTP/1.1 2x OK\r\n\r\n"):
        with pytest.raises(ValueError):
            parse_head(bad, "GET")

"""The shared, I/O-free core: the NDJSON decoder, requests, retries.

The retry tests talk to a stub HTTP server on loopback that answers from a
script, so the number of attempts can be counted.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import dsec
from dsec._core import CommandStreamDecoder, RetryPolicy, resolve_settings
from dsec.models import OutputEvent, SessionResult


def ndjson(*events: Dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def out(stream: str, data: bytes) -> Dict[str, Any]:
    return {"type": stream, "data": base64.b64encode(data).decode()}


RESULT = {"commandId": "cmd-1", "exitCode": 0, "outcome": "exited", "stdout": "é", "stderr": ""}


def test_decoder_joins_lines_and_characters_split_across_chunks() -> None:
    body = ndjson(
        out("stdout", b"\xc3"), out("stderr", b"e"), out("stdout", b"\xa9!"), {"type": "result", "result": RESULT}
    )
    for size in (1, 7, len(body)):
        decoder = CommandStreamDecoder()
        events: List[OutputEvent] = []
        for i in range(0, len(body), size):
            events += decoder.push(body[i : i + size])
        events += decoder.end()
        assert events == [OutputEvent("stderr", "e"), OutputEvent("stdout", "é!")]
        assert decoder.result is not None and decoder.result.command_id == "cmd-1"


def test_decoder_raises_the_error_event_and_a_stream_without_result() -> None:
    decoder = CommandStreamDecoder()
    with pytest.raises(dsec.SandboxNotRunning):
        decoder.push(ndjson({"type": "error", "error": {"code": "sandbox_not_running", "message": "stopped"}}))
    cut = CommandStreamDecoder()
    cut.push(ndjson(out("stdout", b"partial")))
    with pytest.raises(dsec.Unavailable):
        cut.end()


def test_decoder_skips_unknown_events_and_builds_session_results() -> None:
    decoder = CommandStreamDecoder(SessionResult)
    decoder.push(ndjson({"type": "progress", "x": 1}, {"type": "result", "result": {**RESULT, "session": "s"}}))
    decoder.end()
    assert isinstance(decoder.result, SessionResult) and decoder.result.session == "s"


def test_run_args_map_to_the_create_body() -> None:
    args = dsec.DSecContainerRunArgs(
        container_image="img:v1",
        memory_limit_mb=4096,
        cpu_cores_limit=0.5,
        ttl_running_stop=300,
        network_rules={"npm": False, "pypi": True},
        init_user="1000",
        toolkits=["t:1"],
        network_allow=[{"cidr": "10.0.0.0/8"}],
        env={"A_B": "1"},
    )
    assert args.to_body() == {
        "backend": "container",
        "image": "img:v1",
        "memoryLimitMb": 4096,
        "cpuCoresLimit": 0.5,
        "ttlSeconds": 300,
        "networkRules": {"npm": False, "pypi": True},
        "initUser": "1000",
        "toolkits": ["t:1"],
        "networkAllow": [{"cidr": "10.0.0.0/8"}],
        "env": {"A_B": "1"},
    }


def test_settings_come_from_arguments_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", "http://10.1.2.3:9000/")
    monkeypatch.setenv("DSEC_API_KEY", "env-key")
    assert resolve_settings(None, None) == ("http://10.1.2.3:9000", "env-key")
    assert resolve_settings("https://dsec.internal", "k") == ("https://dsec.internal", "k")
    monkeypatch.delenv("DSEC_URL")
    monkeypatch.delenv("DSEC_API_KEY")
    assert resolve_settings(None, None) == (dsec.DEFAULT_URL, None)


def test_retry_policy_resends_only_what_is_safe() -> None:
    policy = RetryPolicy(max_retries=2)
    unavailable = dsec.Unavailable("down")
    assert policy.should_retry(unavailable, 1, retry_safe=True)
    assert not policy.should_retry(unavailable, 1, retry_safe=False)
    assert not policy.should_retry(unavailable, 3, retry_safe=True)
    assert policy.should_retry(dsec.QuotaExceeded("full"), 1, retry_safe=True)
    assert not policy.should_retry(dsec.ResourceExhausted("pids"), 1, retry_safe=True)
    assert not policy.should_retry(dsec.InvalidArgument("bad"), 1, retry_safe=True)
    assert policy.should_retry(dsec.Conflict("in progress", field="requestId"), 1, retry_safe=True)
    assert not policy.should_retry(dsec.Conflict("taken", field="name"), 1, retry_safe=True)
    for attempt in (1, 2, 5, 20):
        assert 0 < policy.delay(attempt) <= policy.max_delay


# --- against a scripted stub server -----------------------------------------

Answer = Tuple[int, Dict[str, Any]]


class Stub:
    """A loopback HTTP server answering each request with the next scripted answer."""

    def __init__(self, answers: List[Answer]) -> None:
        self.answers = answers
        self.requests: List[Tuple[str, str, Dict[str, Any]]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                stub.requests.append((self.command, self.path, body))
                status, payload = stub.answers.pop(0)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub([])
    yield s
    s.close()


DOWN = (503, {"error": {"code": "unavailable", "message": "edge restarting"}})
INFO = {
    "id": "sb-1",
    "edgeId": "e",
    "projectId": "p",
    "state": "running",
    "spec": {"backend": "container", "image": "busybox", "memoryLimitMb": 512, "cpuCoresLimit": 1,
             "pidsLimit": 1024, "ttlSeconds": 3600, "initUser": "root"},
    "createdAt": "2026-01-01T00:00:00.000Z",
    "expiresAt": "2026-01-01T01:00:00.000Z",
}


async def test_a_read_is_resent_after_unavailable(stub: Stub) -> None:
    stub.answers += [DOWN, DOWN, (200, INFO)]
    client = dsec.DSecClient(stub.url, "k", max_retries=2)
    sandbox = await client.get_sandbox("sb-1")
    await client.close()
    assert sandbox.info is not None and sandbox.info.created_at.year == 2026
    assert [r[:2] for r in stub.requests] == [("GET", "/v1/sandboxes/sb-1")] * 3


async def test_creates_carry_a_request_id_so_a_resend_is_the_same_create(stub: Stub) -> None:
    stub.answers += [DOWN, (201, INFO)]
    client = dsec.DSecClient(stub.url, "k")
    await client.run_container(dsec.DSecContainerRunArgs(container_image="busybox"))
    await client.close()
    first, second = (r[2] for r in stub.requests)
    assert first == second and first["requestId"].startswith("py-")


async def test_a_command_without_request_id_is_not_resent(stub: Stub) -> None:
    stub.answers += [DOWN]
    client = dsec.DSecClient(stub.url, "k")
    with pytest.raises(dsec.Unavailable) as err:
        await client.sandbox("sb-1").run_shell("make")
    await client.close()
    assert err.value.message == "edge restarting"
    assert len(stub.requests) == 1


async def test_a_command_with_request_id_is_resent(stub: Stub) -> None:
    result = {"commandId": "cmd-1", "exitCode": 0, "outcome": "exited", "stdout": "ok\n", "stderr": ""}
    stub.answers += [DOWN, (200, result)]
    client = dsec.DSecClient(stub.url, "k")
    got = await client.sandbox("sb-1").run_shell("make", request_id="train-7-step-3")
    await client.close()
    assert got.stdout == "ok\n" and len(stub.requests) == 2
    assert stub.requests[1][2] == {"shell": "make", "requestId": "train-7-step-3"}

"""``client.fncall`` (docs/fncall.md): the asyncio client and its sync twin
against a scripted API (``httpx.MockTransport``), then against the real
cluster of ``conftest.py`` where its edge runs function calls."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest

import dsec
import dsec.sync
from dsec import FnCallItem, FnCallResult
from dsec._core import RetryPolicy

from .conftest import REPO, Cluster, _cgroup_parents, _dsec_command

SUM = "print(sum(map(int, input().split())))"


def result(stdout: str, **extra: Any) -> Dict[str, Any]:
    return {
        "exitCode": 0,
        "stdout": stdout,
        "stderr": "",
        "truncated": False,
        "outcome": "ok",
        "durationMs": 1.5,
        "edgeId": "edge-a",
        **extra,
    }


class FakeApi:
    """Answers the FnCall routes: a call's stdout is its stdin; a batch streams its
    lines last call first; a call whose stdin is ``fail`` is refused for now
    (``capacity_exhausted``), one whose stdin is ``bad`` is ``invalid_argument``."""

    def __init__(self) -> None:
        self.requests: List[Dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append({"path": request.url.path, "body": body, "accept": request.headers.get("accept")})
        if request.url.path == "/v1/fncall":
            if body["language"] == "cobol":
                return httpx.Response(
                    400, json={"error": {"code": "invalid_argument", "message": "no runtime", "field": "language"}}
                )
            return httpx.Response(200, json=result(body.get("stdin", "")))
        assert request.url.path == "/v1/fncall/batch"
        lines = []
        for index in reversed(range(len(body["calls"]))):
            stdin = body["calls"][index].get("stdin", "")
            if stdin == "fail":
                lines.append({"index": index, "error": {"code": "capacity_exhausted", "message": "pool full"}})
            elif stdin == "bad":
                lines.append({"index": index, "error": {"code": "invalid_argument", "message": "no runtime"}})
            else:
                lines.append({"index": index, "result": result(stdin)})
        content = "".join(json.dumps(line) + "\n" for line in lines)
        return httpx.Response(200, content=content, headers={"content-type": "application/x-ndjson"})


def scripted_client(api: FakeApi, max_retries: int) -> dsec.DSecClient:
    client = dsec.DSecClient(url="http://dsec.test", api_key="k", max_retries=max_retries)
    client._http.retry = RetryPolicy(max_retries=max_retries, base_delay=0.001, max_delay=0.002)
    return client


@pytest.fixture
async def scripted() -> Any:
    api = FakeApi()
    client = scripted_client(api, 3)
    await client._http.close()
    client._http._client = httpx.AsyncClient(base_url="http://dsec.test", transport=httpx.MockTransport(api))
    yield client, api
    await client.close()


async def test_run_sends_the_call_and_returns_its_result(scripted: Any) -> None:
    client, api = scripted
    r = await client.fncall.run("python", SUM, stdin="1 2\n", args=["-v"], timeout_ms=2000, edge_selector={"pool": "cpu"})
    assert isinstance(r, FnCallResult)
    assert (r.stdout, r.exit_code, r.outcome, r.duration_ms, r.edge_id, r.ok) == ("1 2\n", 0, "ok", 1.5, "edge-a", True)
    assert api.requests[0]["body"] == {
        "language": "python",
        "code": SUM,
        "stdin": "1 2\n",
        "args": ["-v"],
        "timeoutMs": 2000,
        "edgeSelector": {"pool": "cpu"},
    }
    with pytest.raises(dsec.InvalidArgument) as err:
        await client.fncall.run("cobol", "")
    assert err.value.field == "language"


async def test_map_yields_every_call_in_completion_order(scripted: Any) -> None:
    client, api = scripted
    calls = [{"language": "python", "code": SUM, "stdin": s, "timeout_ms": 500} for s in ("0", "1", "bad", "3")]
    items = [item async for item in client.fncall.map(calls, concurrency=3)]
    assert [i.index for i in items] == [3, 2, 1, 0]
    assert all(isinstance(i, FnCallItem) for i in items)
    assert isinstance(items[1].error, dsec.InvalidArgument) and items[1].result is None
    assert [i.result.stdout for i in items if i.result] == ["3", "1", "0"]
    (batch,) = api.requests
    assert batch["accept"] == "application/x-ndjson"
    assert batch["body"]["concurrency"] == 3
    # snake_case keys are sent as the API's camelCase.
    assert batch["body"]["calls"][0] == {"language": "python", "code": SUM, "stdin": "0", "timeoutMs": 500}


async def test_map_sends_again_calls_refused_for_now(scripted: Any) -> None:
    client, api = scripted
    calls = [{"language": "python", "code": SUM, "stdin": s} for s in ("0", "fail")]
    items = [item async for item in client.fncall.map(calls)]
    assert [i.index for i in items] == [0, 1]
    # Refused every time: after 3 resends the last refusal is the item's error.
    assert isinstance(items[1].error, dsec.CapacityExhausted)
    assert [[c["stdin"] for c in r["body"]["calls"]] for r in api.requests] == [["0", "fail"]] + [["fail"]] * 3


async def test_map_with_max_retries_0_sends_each_call_once() -> None:
    api = FakeApi()
    client = scripted_client(api, 0)
    await client._http.close()
    client._http._client = httpx.AsyncClient(base_url="http://dsec.test", transport=httpx.MockTransport(api))
    try:
        items = [item async for item in client.fncall.map([{"language": "python", "code": SUM, "stdin": "fail"}])]
        assert isinstance(items[0].error, dsec.CapacityExhausted)
        assert len(api.requests) == 1
    finally:
        await client.close()


async def test_map_splits_calls_over_1_mib_into_batches(scripted: Any) -> None:
    client, api = scripted
    big = "x" * (300 * 1024)
    calls = [{"language": "python", "code": big, "stdin": str(i)} for i in range(7)]
    seen = sorted([item.index async for item in client.fncall.map(calls)])
    assert seen == list(range(7))
    assert [len(r["body"]["calls"]) for r in api.requests] == [2, 2, 2, 1]


def test_the_sync_twin_runs_and_maps() -> None:
    api = FakeApi()
    client = dsec.sync.DSecClient(url="http://dsec.test", api_key="k", max_retries=0)
    client._http.close()
    client._http._client = httpx.Client(base_url="http://dsec.test", transport=httpx.MockTransport(api))
    try:
        assert client.fncall.run("python", SUM, stdin="5 6\n").stdout == "5 6\n"
        items = list(client.fncall.map([{"language": "python", "code": SUM, "stdin": s} for s in ("a", "b")]))
        assert [(i.index, i.result.stdout if i.result else None) for i in items] == [(1, "b"), (0, "a")]
    finally:
        client.close()


@pytest.fixture(scope="module")
def fncall_cluster() -> Iterator[Cluster]:
    """A ``dsec up`` of its own over the FnCall runtime images, built once into a
    store kept between runs (the edge's FnCall tests share it;
    ``DSEC_TEST_FNCALL_IMAGES`` moves it). Stopped with SIGTERM and
    ``--stop-sandboxes``: nothing it started is left."""
    images = Path(os.environ.get("DSEC_TEST_FNCALL_IMAGES", "/var/tmp/dsec-fncall-it"))
    work = Path(tempfile.mkdtemp(prefix="dsec-py-fncall-"))
    work.chmod(0o711)
    state_dir = work / "state"
    parents_before = set(_cgroup_parents())
    store = ["--image-store", str(images / "images")]
    prepared = subprocess.run(
        _dsec_command(state_dir, *store, "fncall", "prepare", "--cache-dir", str(images / "cache")),
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    if prepared.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        pytest.fail(f"dsec fncall prepare failed:\n{prepared.stderr}")
    # An operator's runtime from the config file (docs/fncall.md "Runtimes"), beside the defaults.
    config = work / "cluster.json"
    config.write_text(
        json.dumps(
            {
                "up": {
                    "fncall": {
                        "runtimes": [
                            {
                                "name": "sh",
                                "image": "fncall-base",
                                "mode": "exec",
                                "command": ["sh", "{entry}"],
                                "entry": "main.sh",
                                "defaultMemoryMb": 128,
                                "maxMemoryMb": 256,
                            }
                        ],
                        "warm": {"python": 1},
                    }
                }
            }
        )
    )
    up = subprocess.Popen(
        _dsec_command(
            state_dir, *store, "up", "--config", str(config), "--port", "0", "--stop-sandboxes", "--no-cgroup-favordynmods"
        ),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert up.stdout is not None
        url = ""
        for line in up.stdout:
            match = re.match(r"^ready (\S+)$", line.strip())
            if match:
                url = match.group(1)
                break
        if not url:
            pytest.fail("dsec up printed no `ready` line")
        # Keep reading so a chatty server never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in up.stdout or []], daemon=True).start()
        yield Cluster(url=url, admin_key=(state_dir / "admin.key").read_text().strip(), state_dir=state_dir)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        shutil.rmtree(work, ignore_errors=True)
        for parent in set(_cgroup_parents()) - parents_before:
            try:
                parent.rmdir()
            except OSError:
                pass


async def test_the_full_path(fncall_cluster: Cluster) -> None:
    """SDK → apiserver → edge → warm pool, asyncio and blocking."""
    async with dsec.DSecClient(fncall_cluster.url, fncall_cluster.admin_key) as client:
        r = await client.fncall.run("python", SUM, stdin="20 22\n", timeout_ms=10_000)
        assert (r.exit_code, r.outcome, r.stdout) == (0, "ok", "42\n"), r.stderr
        calls = [{"language": "python", "code": SUM, "stdin": f"{i} {i}\n"} for i in range(20)]
        items = [item async for item in client.fncall.map(calls, concurrency=8)]
        assert sorted(i.index for i in items) == list(range(20))
        for item in items:
            assert item.result is not None, item.error
            assert item.result.stdout == f"{2 * item.index}\n"
        failing = await client.fncall.run("python", "import sys; sys.exit(3)")
        assert (failing.exit_code, failing.outcome) == (3, "ok")
        # The config file's runtime.
        shell = await client.fncall.run("sh", 'echo "$((6 * 7))" "$(id -u)"')
        assert (shell.outcome, shell.stdout) == ("ok", "42 60000\n"), shell.stderr
    with dsec.sync.DSecClient(fncall_cluster.url, fncall_cluster.admin_key) as sync_client:
        assert sync_client.fncall.run("bash", 'read x; echo "$((x * 2))"', stdin="21\n").stdout == "42\n"

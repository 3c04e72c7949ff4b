"""Stable error codes as exceptions: from the server, from the transport, and
in sync with docs/errors.md."""

from __future__ import annotations

import re
import socket
from typing import Dict, Tuple

import pytest

import dsec
from dsec import DSecContainerRunArgs
from dsec.errors import ERROR_CLASSES, error_from_body

from .conftest import REPO, Cluster


def documented_codes() -> Dict[str, Tuple[int, bool]]:
    """The table of docs/errors.md: code → (HTTP status, retryable)."""
    table = {}
    for line in (REPO / "docs" / "errors.md").read_text().splitlines():
        row = re.match(r"^\| `([a-z_]+)` \| (\d+) \| (yes|no) \|", line)
        if row:
            table[row.group(1)] = (int(row.group(2)), row.group(3) == "yes")
    return table


def test_every_documented_code_has_its_exception_class() -> None:
    documented = documented_codes()
    assert len(documented) >= 17
    assert {code: (cls.status, cls.retryable) for code, cls in ERROR_CLASSES.items()} == documented
    for code, cls in ERROR_CLASSES.items():
        assert issubclass(cls, dsec.DSecError) and cls.code == code
        assert getattr(dsec, cls.__name__) is cls


def test_error_bodies_map_to_classes_and_keep_their_fields() -> None:
    err = error_from_body(
        {"error": {"code": "resource_exhausted", "message": "pids", "details": {"limit": "pids", "max": 64}}}, 429
    )
    assert type(err) is dsec.ResourceExhausted
    assert (err.code, err.message, err.retryable) == ("resource_exhausted", "pids", True)
    assert err.details == {"limit": "pids", "max": 64}
    # A code this SDK does not know yet still raises a class chosen by the status.
    newer = error_from_body({"error": {"code": "sandbox_gone", "message": "m", "field": "id"}}, 404)
    assert isinstance(newer, dsec.NotFound) and (newer.code, newer.field) == ("sandbox_gone", "id")
    # A body that is no error body (a proxy's page) still gives a DSecError.
    assert type(error_from_body(None, 502)) is dsec.Internal
    assert type(error_from_body("<html>", 503)) is dsec.Unavailable


async def test_unknown_sandbox_is_sandbox_not_found(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.SandboxNotFound) as err:
        await client.get_sandbox("sb-doesnotexist")
    assert isinstance(err.value, dsec.NotFound)
    assert (err.value.code, err.value.status, err.value.retryable) == ("sandbox_not_found", 404, False)
    assert "sb-doesnotexist" in err.value.message


async def test_an_invalid_field_is_invalid_argument_naming_it(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.InvalidArgument) as err:
        await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=1))
    assert (err.value.code, err.value.field) == ("invalid_argument", "memoryLimitMb")
    with pytest.raises(dsec.InvalidArgument) as env:
        await client.run_container(DSecContainerRunArgs(container_image="busybox", env={"1BAD": "x"}))
    assert env.value.field == "env.1BAD"


async def test_an_unknown_image_is_image_not_found(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.ImageNotFound):
        await client.run_container(DSecContainerRunArgs(container_image="no-such-image:v9"))


async def test_a_wrong_key_is_unauthenticated(cluster: Cluster) -> None:
    client = dsec.DSecClient(cluster.url, "dsec_not_a_key", max_retries=0)
    with pytest.raises(dsec.Unauthenticated):
        await client.list_sandboxes()
    await client.close()


async def test_a_server_that_does_not_listen_is_unavailable() -> None:
    # A port that was free a moment ago: nothing accepts on it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = dsec.DSecClient(f"http://127.0.0.1:{port}", "k", max_retries=1)
    with pytest.raises(dsec.Unavailable) as err:
        await client.open()
    assert err.value.retryable and "dsec up" in err.value.message
    await client.close()


def test_a_url_that_is_not_http_is_invalid_argument() -> None:
    with pytest.raises(dsec.InvalidArgument) as err:
        dsec.DSecClient("ftp://example.invalid", "k")
    assert err.value.field == "url"

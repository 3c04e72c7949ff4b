"""The paper's minimal session (section 2.1), run as printed."""

from __future__ import annotations

import pytest

import dsec
from dsec import DSecClient, DSecContainerRunArgs

from .conftest import Cluster


async def test_the_listing_runs_as_printed_with_settings_from_the_environment(dsec_env: Cluster) -> None:
    client = DSecClient()
    await client.open()
    args = DSecContainerRunArgs(
        container_image="busybox",
        memory_limit_mb=4096,
        cpu_cores_limit=4,
        ttl_running_stop=300,
        network_rules={"npm": False, "pypi": True},
        init_user="root",
    )
    sandbox = await client.run_container(args, timeout=120)
    result = await sandbox.run_shell("echo hello world")
    await sandbox.stop()

    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello world\n", "")
    assert result.ok and result.outcome == "exited"
    assert client.url == dsec_env.url
    assert client.whoami is not None and client.whoami.role == "admin"
    assert sandbox.info is not None
    spec = sandbox.info.spec
    assert (spec.image, spec.memory_limit_mb, spec.cpu_cores_limit, spec.ttl_seconds, spec.init_user) == (
        "busybox",
        4096,
        4,
        300,
        "root",
    )
    assert spec.network_rules == {"npm": False, "pypi": True}
    assert sandbox.info.state == "stopped"
    with pytest.raises(dsec.SandboxNotRunning):
        await sandbox.run_shell("true")
    await client.close()


async def test_a_missing_key_is_unauthenticated(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", cluster.url)
    monkeypatch.delenv("DSEC_API_KEY", raising=False)
    with pytest.raises(dsec.Unauthenticated) as err:
        async with DSecClient(max_retries=0):
            pass
    assert (err.value.code, err.value.status, err.value.retryable) == ("unauthenticated", 401, False)

"""Network policy, events, listing, images, projects and keys, edges."""

from __future__ import annotations

import pytest

import dsec
from dsec import DSecContainerRunArgs, Quota

from .conftest import Cluster, unique


async def test_network_rules_merge_by_name_and_lists_replace(client: dsec.DSecClient) -> None:
    args = DSecContainerRunArgs(container_image="busybox", network_rules={"npm": False, "pypi": True})
    async with await client.run_container(args) as box:
        info = await box.update_network_rules({"npm": True})
        assert info.spec.network_rules == {"npm": True, "pypi": True}
        info = await box.update_network_rules(allow=[{"domain": "*.example.org", "ports": [443]}])
        assert info.spec.network_allow == [{"domain": "*.example.org", "ports": [443]}]
        assert info.spec.network_rules == {"npm": True, "pypi": True}
        info = await box.update_network_rules(allow=[])
        assert not info.spec.network_allow
        with pytest.raises(dsec.InvalidArgument) as err:
            await box.update_network_rules(deny=[{"cidr": "not-a-cidr"}])
        assert err.value.field is not None and err.value.field.startswith("deny.0")


async def test_events_report_truncated_output_and_page_by_id(sandbox: dsec.Sandbox) -> None:
    result = await sandbox.run_shell("head -c 5000 /dev/zero | tr '\\0' a", max_output_bytes=100)
    assert result.truncated and result.stdout_bytes == 5000
    events = await sandbox.events()
    truncated = [e for e in events if e.kind == "output_truncated"]
    assert len(truncated) == 1
    assert truncated[0].sandbox_id == sandbox.id and truncated[0].count >= 1
    assert await sandbox.events(after_id=events[-1].id) == []


async def test_get_and_list_sandboxes(client: dsec.DSecClient, sandbox: dsec.Sandbox, job_label: str) -> None:
    got = await client.get_sandbox(sandbox.id)
    assert got.info is not None and got.info.id == sandbox.id and got.info.state == "running"
    assert got.info.memory_bytes is not None and got.info.memory_bytes > 0
    handle = client.sandbox(sandbox.id)
    assert handle.info is None and (await handle.run_shell("echo via-id")).stdout == "via-id\n"
    assert [s.id for s in await client.list_sandboxes(labels={"job": job_label})] == [sandbox.id]
    assert await client.list_sandboxes(labels={"job": job_label, "team": "none"}) == []
    assert sandbox.id in [s.id for s in await client.list_sandboxes()]


async def test_images_and_edges(client: dsec.DSecClient) -> None:
    assert "busybox:latest" in [layer.ref for layer in await client.list_images()]
    edges = await client.list_edges()
    assert len(edges) == 1 and edges[0].healthy and "container" in edges[0].backends


async def test_projects_and_keys(client: dsec.DSecClient, cluster: Cluster) -> None:
    name = unique("py-team")
    project = await client.create_project(name, quota=Quota(sandboxes=1, memory_mb=2048))
    assert project.name == name and project.quota.sandboxes == 1 and project.quota.memory_mb == 2048
    assert project.parent_id == client.whoami.project_id  # type: ignore[union-attr]
    assert project.id in [p.id for p in await client.list_projects()]

    created = await client.create_key(project.id, name="py-member", scopes=["images:run:busybox*"])
    assert (created.project_id, created.role, created.scopes) == (project.id, "member", ["images:run:busybox*"])
    async with dsec.DSecClient(cluster.url, created.key, max_retries=0) as member:
        assert member.whoami is not None and member.whoami.project_id == project.id
        assert member.whoami.scopes == ["images:run:busybox*"]
        # The project's quota holds one sandbox.
        async with await member.run_container(DSecContainerRunArgs(container_image="busybox")) as box:
            assert [s.id for s in await member.list_sandboxes()] == [box.id]
            with pytest.raises(dsec.QuotaExceeded):
                await member.run_container(DSecContainerRunArgs(container_image="busybox"))
        with pytest.raises(dsec.PermissionDenied):
            await member.create_project(unique("py-nested"))

    await client.delete_key(created.id)
    revoked = dsec.DSecClient(cluster.url, created.key)
    with pytest.raises(dsec.Unauthenticated):
        await revoked.open()
    await revoked.close()

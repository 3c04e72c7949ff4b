"""Volumes on a real ``dsec up`` (docs/volumes.md): the SDK's calls end to end,
the bytes shared by two sandboxes in turn, a delete refused while one mounts
the volume, names per project, and a sandbox filling it."""

from __future__ import annotations

import pytest

import dsec
from dsec import DSecContainerRunArgs, VolumeMount

from .conftest import unique


async def test_a_volume_outlives_sandboxes_and_is_refused_deletion_while_mounted(
    client: dsec.DSecClient, job_label: str
) -> None:
    name = unique("vol")
    made = await client.create_volume(name, size_mb=32)
    assert (made.name, made.size_mb, made.state) == (name, 32, "ready")
    assert name in [v.name for v in await client.list_volumes()]
    args = DSecContainerRunArgs(
        container_image="busybox",
        ttl_running_stop=600,
        labels={"job": job_label},
        volumes=[VolumeMount(name, "/data")],
    )
    first = await client.run_container(args)
    try:
        assert first.info is not None and first.info.edge_id == made.edge_id
        assert first.info.spec.volumes == [{"name": name, "path": "/data"}]
        wrote = await first.run_shell("echo kept > /data/f && chown 1000:1000 /data/f")
        assert wrote.ok, wrote.stderr
        with pytest.raises(dsec.VolumeInUse) as busy:
            await client.delete_volume(name)
        assert first.id in busy.value.details.get("sandboxes", [])
        assert (await client.get_volume(name)).mounted_by == [first.id]
        # Full: ENOSPC in the sandbox, and it stays usable.
        fill = await first.run_shell("dd if=/dev/zero of=/data/fill bs=1M count=64; rm /data/fill; echo ok")
        assert "No space left on device" in fill.stderr
        assert fill.stdout.endswith("ok\n")
    finally:
        await first.stop()
    second = await client.run_container(
        DSecContainerRunArgs(
            container_image="busybox",
            ttl_running_stop=600,
            labels={"job": job_label},
            volumes=[{"name": name, "path": "/mnt/other"}],
        )
    )
    try:
        read = await second.run_shell("cat /mnt/other/f && stat -c %u:%g /mnt/other/f")
        assert read.stdout == "kept\n1000:1000\n", read.stderr
    finally:
        await second.stop()
    await client.delete_volume(name)
    with pytest.raises(dsec.VolumeNotFound):
        await client.get_volume(name)


async def test_names_are_per_project_and_bad_input_is_refused(client: dsec.DSecClient) -> None:
    name = unique("vol")
    await client.create_volume(name, size_mb=16)
    try:
        other = await client.create_project(unique("proj"))
        with pytest.raises(dsec.VolumeNotFound):
            await client.get_volume(name, project_id=other.id)
        assert await client.list_volumes(project_id=other.id) == []
        with pytest.raises(dsec.VolumeNotFound) as missing:
            await client.run_container(
                DSecContainerRunArgs(
                    container_image="busybox", project_id=other.id, volumes=[VolumeMount(name, "/data")]
                )
            )
        assert missing.value.field == "volumes.0.name"
        with pytest.raises(dsec.InvalidArgument) as bad_path:
            await client.run_container(
                DSecContainerRunArgs(container_image="busybox", volumes=[VolumeMount(name, "/proc/x")])
            )
        assert bad_path.value.field == "volumes.0.path"
        for bad in ("a/b", "..", "x" * 64):
            with pytest.raises(dsec.InvalidArgument):
                await client.create_volume(bad, size_mb=16)
        with pytest.raises(dsec.Conflict):
            await client.create_volume(name, size_mb=16)
    finally:
        await client.delete_volume(name)

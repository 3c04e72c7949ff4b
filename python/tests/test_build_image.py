"""``build_image`` against a real ``dsec up``: a Dockerfile ``FROM scratch``
(nothing to pull: the tests reach no registry) that copies the host's static
busybox and a file in, built by buildah on the node, run in a sandbox of the
same project and not visible to another; a failing build raises the error it
failed with; the sync client does the same."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import dsec
import dsec.sync
from dsec import DSecContainerRunArgs

from .conftest import Cluster, unique

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
pytestmark = pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah on the node")


def _context(root: Path, dockerfile: str, files: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(dockerfile)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


def _scratch_context(root: Path, greeting: str) -> Path:
    ctx = _context(
        root,
        "FROM scratch\nCOPY busybox /bin/busybox\nCOPY data/hello.txt /hello.txt\n",
        {"data/hello.txt": greeting},
    )
    shutil.copy(BUSYBOX, ctx / "busybox")
    # A symlink in the context travels as a link and is never followed by the client.
    os.symlink("/etc/shadow", ctx / "not-followed")
    return ctx


async def test_build_image_runs_in_the_project_only(
    client: dsec.DSecClient, cluster: Cluster, tmp_path: Path
) -> None:
    # Two sibling projects: a child would see its ancestors' layers by design.
    keys = []
    for prefix in ("py-builder", "py-other"):
        project = await client.create_project(unique(prefix))
        keys.append((await client.create_key(project.id, role="admin")).key)
    async with dsec.DSecClient(url=cluster.url, api_key=keys[0]) as mine, dsec.DSecClient(
        url=cluster.url, api_key=keys[1]
    ) as theirs:
        name = unique("py-built")
        image = await mine.build_image(_scratch_context(tmp_path / "ctx", "hi from a build\n"), name=name, timeout=600)
        assert image == f"{name}:latest"
        assert image in [layer.ref for layer in await mine.list_images()]
        sandbox = await mine.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=128))
        try:
            result = await sandbox.exec(["/bin/busybox", "cat", "/hello.txt"])
            assert result.stdout == "hi from a build\n"
        finally:
            await sandbox.stop()
        # The other project neither sees nor runs it.
        assert image not in [layer.ref for layer in await theirs.list_images()]
        with pytest.raises(dsec.ImageNotFound):
            await theirs.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=128))


async def test_build_image_failures_raise_their_error(client: dsec.DSecClient, tmp_path: Path) -> None:
    # A RUN step in an image without a shell fails, naming the instruction and its line.
    ctx = _context(tmp_path / "fails", "FROM scratch\nCOPY a.txt /a.txt\nRUN /bin/false\n", {"a.txt": "a"})
    with pytest.raises(dsec.InvalidArgument) as failed:
        await client.build_image(ctx, name=unique("py-fails"), timeout=600)
    assert failed.value.details.get("reason") == "build_step_failed"
    assert failed.value.details.get("line") == 3
    # No Dockerfile in the context: refused at once.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x").write_text("x")
    with pytest.raises(dsec.InvalidArgument) as missing:
        await client.build_image(empty, name=unique("py-none"))
    assert missing.value.field == "dockerfile"
    with pytest.raises(dsec.InvalidArgument):
        await client.build_image(ctx, name="Not A Name")
    with pytest.raises(dsec.InvalidArgument):
        await client.build_image(tmp_path / "does-not-exist", name=unique("py-x"))


def test_sync_build_image(cluster: Cluster, tmp_path: Path) -> None:
    with dsec.sync.DSecClient(url=cluster.url, api_key=cluster.admin_key) as client:
        name = unique("py-sync-built")
        image = client.build_image(_scratch_context(tmp_path / "ctx", "sync\n"), name=name, timeout=600)
        assert image == f"{name}:latest"
        # The same context again is the stored layer (nothing rebuilt).
        assert client.build_image(_scratch_context(tmp_path / "ctx2", "sync\n"), name=name) == image

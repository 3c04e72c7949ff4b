"""Fixtures: one real ``dsec up`` for the whole test session.

The cluster runs from the repository's TypeScript sources (no build step), on
a fresh state dir with the busybox base image, on a free loopback port. It
is stopped with SIGTERM and ``--stop-sandboxes``, so nothing it started is
left; the state dir is removed.
"""

from __future__ import annotations

import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, List

import pytest

import dsec
from dsec import DSecContainerRunArgs

REPO = Path(__file__).resolve().parents[2]
#: Creating the state, building busybox and starting take a few seconds; the bound is for a hang.
READY_TIMEOUT_S = 180
#: The cgroup parent `dsec up` puts sandboxes under (packages/cluster, `cgroupParent` default).
CGROUP_PARENT = "dsec"


@dataclass(frozen=True)
class Cluster:
    url: str
    admin_key: str
    state_dir: Path


def _dsec_command(state_dir: Path, *args: str) -> List[str]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: the tests need `dsec up` from packages/cli")
    return [
        node,
        "--conditions=dsec-source",
        "--import",
        "tsx",
        "packages/cli/src/run.ts",
        "--state-dir",
        str(state_dir),
        *args,
    ]


def _cgroup_parents() -> List[Path]:
    return sorted(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="dsec-py-sdk-"))
    # 0711: sandboxes' mapped roots pass through it to their root filesystems.
    work.chmod(0o711)
    state_dir = work / "state"
    parents_before = set(_cgroup_parents())
    built = subprocess.run(
        _dsec_command(state_dir, "image", "build", "busybox", "--from-busybox", "--kind", "base"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT_S,
    )
    if built.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        pytest.fail(f"dsec image build failed:\n{built.stderr}")

    stderr_path = work / "up.stderr"
    with open(stderr_path, "wb") as stderr:
        up = subprocess.Popen(
            _dsec_command(
                state_dir, "up", "--port", "0", "--stop-sandboxes", "--no-cgroup-favordynmods"
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    lines: "queue.Queue[str]" = queue.Queue()

    def drain() -> None:
        # Keeps reading so a chatty server never blocks on a full pipe.
        assert up.stdout is not None
        for line in up.stdout:
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    try:
        url = ""
        while not url:
            try:
                line = lines.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"dsec up printed no `ready` line:\n{stderr_path.read_text()}")
            match = re.match(r"^ready (\S+)$", line.strip())
            url = match.group(1) if match else ""
        admin_key = (state_dir / "admin.key").read_text().strip()
        yield Cluster(url=url, admin_key=admin_key, state_dir=state_dir)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        leftover_mounts = [
            line for line in Path("/proc/mounts").read_text().splitlines() if str(work) in line
        ]
        if not leftover_mounts:
            shutil.rmtree(work, ignore_errors=True)
        # Only a parent this run made, and only once empty: rmdir of a cgroup
        # that holds children or processes fails, so another user's stays.
        for parent in set(_cgroup_parents()) - parents_before:
            try:
                parent.rmdir()
            except OSError:
                pass
        assert not leftover_mounts, f"dsec up left mounts behind: {leftover_mounts}"
        assert up.returncode == 0, f"dsec up exited {up.returncode}:\n{stderr_path.read_text()}"


@pytest.fixture
def dsec_env(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """``DSEC_URL`` and ``DSEC_API_KEY`` of the test cluster, as a user sets them."""
    monkeypatch.setenv("DSEC_URL", cluster.url)
    monkeypatch.setenv("DSEC_API_KEY", cluster.admin_key)
    return cluster


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[dsec.DSecClient]:
    c = dsec.DSecClient(cluster.url, cluster.admin_key)
    await c.open()
    yield c
    await c.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def job_label() -> str:
    """A label value no other test's sandboxes carry."""
    return unique("py")


@pytest.fixture
async def sandbox(client: dsec.DSecClient, job_label: str) -> AsyncIterator[dsec.Sandbox]:
    box = await client.run_container(
        DSecContainerRunArgs(container_image="busybox", ttl_running_stop=600, labels={"job": job_label})
    )
    yield box
    await box.stop()

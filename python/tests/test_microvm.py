"""``run_micro_vm``: a sandbox under its own guest kernel, with the same calls as a container."""

from __future__ import annotations

import os

import pytest

import dsec
from dsec import DSecContainerRunArgs

from .conftest import unique


async def test_run_micro_vm_boots_its_own_kernel(client: dsec.DSecClient) -> None:
    if not any("microvm" in e.backends for e in await client.list_edges()):
        pytest.skip("no edge of the test cluster offers microVMs (QEMU or the built kernel missing)")
    args = DSecContainerRunArgs(container_image="busybox", ttl_running_stop=600, labels={"job": unique("py-vm")})
    async with await client.run_micro_vm(args) as box:
        assert box.info is not None and box.info.spec.backend == "microvm"
        result = await box.run_shell("uname -r; cat /etc/hostname 2>/dev/null; echo ok > /tmp/f; cat /tmp/f")
        assert result.exit_code == 0, result.stderr
        release = result.stdout.splitlines()[0]
        # The guest's kernel (Debian's cloud kernel), not the host's.
        assert release and release != os.uname().release
        assert result.stdout.rstrip().endswith("ok")


async def test_run_micro_vm_takes_run_args(client: dsec.DSecClient) -> None:
    with pytest.raises(dsec.InvalidArgument) as err:
        await client.run_micro_vm({"container_image": "busybox"})  # type: ignore[arg-type]
    assert err.value.field == "args"

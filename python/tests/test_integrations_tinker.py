"""dsec.integrations.tinker: tinker-cookbook's SandboxInterface, contract then a real ``dsec up``.

The interface is ``tinker_cookbook/sandbox/sandbox_interface.py`` as
github:thinking-machines-lab/tinker-cookbook writes it at 9dfcc3a2cf44432d621a01005073dc6d76a1e87a.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from pathlib import Path
from typing import AsyncIterator

import pytest

import dsec
from dsec.integrations import _provider_common as common
from dsec.integrations import tinker as tp

from .conftest import Cluster

INTERFACE = {
    "send_heartbeat": "(self, timeout=30)",
    "run_command": "(self, command, workdir=None, timeout=60, max_output_bytes=None)",
    "read_file": "(self, path, max_bytes=None, timeout=60)",
    # The Protocol gives content no default; ModalSandbox (the reference implementation) gives "".
    "write_file": "(self, path, content='', executable=False, timeout=60)",
    "cleanup": "(self)",
}

def _shape(func: Any) -> str:
    """A signature as its source writes it, without annotations."""
    sig = inspect.signature(func)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", sorted(INTERFACE))
def test_methods_match_sandbox_interface(name: str) -> None:
    method = getattr(tp.DSecSandbox, name)
    assert _shape(method) == INTERFACE[name]
    assert inspect.iscoroutinefunction(method)
    assert isinstance(inspect.getattr_static(tp.DSecSandbox, "sandbox_id"), property)


def test_errors_and_result_match_the_cookbook() -> None:
    assert [b.__name__ for b in tp.SandboxError.__bases__] == ["TinkerCookbookError", "RuntimeError"]
    assert [b.__name__ for b in tp.SandboxTerminatedError.__bases__] == ["SandboxError"]
    result = tp.SandboxResult(stdout="o", stderr="e", exit_code=0)
    assert (result.stdout, result.stderr, result.exit_code, result.metrics) == ("o", "e", 0, {})
    if not tp.TINKER_COOKBOOK_INSTALLED:
        assert [f.name for f in dataclasses.fields(tp.SandboxResult)] == ["stdout", "stderr", "exit_code", "metrics"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.stdout = "x"  # type: ignore[misc]


def test_bad_arguments_are_refused_before_any_request() -> None:
    with pytest.raises(dsec.InvalidArgument):
        tp.DSecSandbox(None, None, timeout=0)  # type: ignore[arg-type]
    with pytest.raises(dsec.InvalidArgument):
        tp.DSecSandbox(None, None, max_stream_output_bytes=-1)  # type: ignore[arg-type]


# --- on a real `dsec up` ---------------------------------------------------------


@pytest.fixture
async def box(dsec_env: Cluster) -> AsyncIterator[tp.DSecSandbox]:
    sandbox = await tp.DSecSandbox.create(image="busybox", timeout=300, max_stream_output_bytes=4096)
    yield sandbox
    await sandbox.cleanup()


async def test_run_command_with_workdir_timeout_and_cap(box: tp.DSecSandbox) -> None:
    r = await box.run_command("pwd; echo e >&2; exit 7", workdir="/tmp")
    assert (r.stdout, r.stderr, r.exit_code, r.metrics["truncated"]) == ("/tmp\n", "e\n", 7, False)
    slow = await box.run_command("echo started; sleep 30", timeout=1)
    assert slow.exit_code == tp.FAILED_EXIT_CODE and slow.metrics["timed_out"] is True
    assert slow.stdout == "started\n" and "timed out after 1s" in slow.stderr
    big = await box.run_command("head -c 1000000 /dev/zero | tr '\\0' z")
    assert big.exit_code == 0 and big.metrics["truncated"] and len(big.stdout) <= 2 * 4096 + 256
    small = await box.run_command("head -c 100000 /dev/zero | tr '\\0' z", max_output_bytes=100)
    assert len(small.stdout) <= 2 * 100 + 256
    bad_cwd = await box.run_command("true", workdir="/no/such/dir")
    assert bad_cwd.exit_code != 0 and bad_cwd.stderr


async def test_files_with_limits_modes_and_errors(box: tp.DSecSandbox) -> None:
    w = await box.write_file("/work/sub/run.sh", "#!/bin/sh\necho ran\n", executable=True)
    assert w.exit_code == 0
    assert (await box.run_command("/work/sub/run.sh")).stdout == "ran\n"
    await box.write_file("/work/b.bin", b"\x00\xffab")
    assert (await box.read_file("/work/b.bin")).stdout == "\x00\ufffdab"
    head = await box.read_file("/work/sub/run.sh", max_bytes=9)
    assert (head.stdout, head.metrics["truncated"]) == ("#!/bin/sh", True)
    await box.run_command("head -c 50000000 /dev/zero > /huge")
    huge = await box.read_file("/huge")
    assert huge.metrics == {"bytes": 4096, "truncated": True}
    missing = await box.read_file("/nope")
    assert missing.exit_code == 1 and missing.stdout == ""
    for bad in (0, -3):
        with pytest.raises(dsec.InvalidArgument):
            await box.read_file("/work/b.bin", max_bytes=bad)


async def test_symlinks_and_dotdot_stay_in_the_sandbox(box: tp.DSecSandbox) -> None:
    await box.run_command("echo inside > /etc/only-here && ln -s / /tmp/root")
    assert (await box.read_file("/tmp/root/etc/only-here")).stdout == "inside\n"
    assert (await box.read_file("/../../etc/only-here")).stdout == "inside\n"
    await box.write_file("/tmp/../../../written", "w")
    assert (await box.run_command("cat /written")).stdout == "w"
    assert not Path("/written").exists()


async def test_user_applies_and_permissions_are_reported(dsec_env: Cluster) -> None:
    async with await tp.DSecSandbox.create(image="busybox", timeout=120, user="nobody") as box:
        assert (await box.run_command("id -u")).stdout == "65534\n"
        denied = await box.write_file("/root/x", "x")
        assert denied.exit_code == 1 and denied.stderr.startswith("/root/x: ")


async def test_heartbeat_extends_the_ttl_and_cleanup_never_leaks(dsec_env: Cluster, client: dsec.DSecClient) -> None:
    box = await tp.DSecSandbox.create(image="busybox", timeout=60, labels={"suite": "tinker"})
    sid = box.sandbox_id
    assert sid in common.live_sandboxes()
    before = (await client.get_sandbox(sid)).info
    assert before is not None and before.spec.labels["dsec.provider"] == "tinker"
    await box.send_heartbeat()
    after = (await client.get_sandbox(sid)).info
    assert after is not None and after.expires_at >= before.expires_at
    await box.cleanup()
    await box.cleanup()
    assert sid not in common.live_sandboxes()
    assert (await client.sandbox(sid).refresh()).state == "stopped"
    with pytest.raises(tp.SandboxTerminatedError):
        await box.send_heartbeat()
    with pytest.raises(tp.SandboxTerminatedError):
        await box.run_command("true")


async def test_a_sandbox_stopped_elsewhere_raises_terminated(dsec_env: Cluster, client: dsec.DSecClient) -> None:
    box = await tp.DSecSandbox.create(image="busybox", timeout=120)
    await client.sandbox(box.sandbox_id).stop()
    for call in (box.run_command("true"), box.read_file("/etc/passwd"), box.write_file("/x", "x")):
        with pytest.raises(tp.SandboxTerminatedError):
            await call
    await box.cleanup()


async def test_factory_and_create_failure(dsec_env: Cluster, tmp_path: Path) -> None:
    factory = tp.make_sandbox_factory(lambda env_dir: "busybox" if env_dir.name == "environment" else "x")
    box = await factory(tmp_path / "environment", 60)
    try:
        assert (await box.run_command("echo ok")).stdout == "ok\n"
    finally:
        await box.cleanup()
    with pytest.raises(tp.SandboxError) as caught:
        await tp.DSecSandbox.create(image="no-such-image-tinker")
    assert isinstance(caught.value.__cause__, dsec.ImageNotFound)
    assert common.live_sandboxes() == []


async def test_concurrent_commands_on_one_sandbox(box: tp.DSecSandbox) -> None:
    results = await asyncio.gather(*(box.run_command(f"echo {i}") for i in range(16)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]


async def test_the_example_runs(dsec_env: Cluster) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "tinker_sandbox.py"
    done = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: subprocess.run(
            [sys.executable, str(example), "--image", "busybox"], capture_output=True, text=True, timeout=300
        ),
    )
    assert done.returncode == 0, done.stderr
    assert "run_command: solved exit 0" in done.stdout


async def test_a_forked_child_never_stops_its_parents_sandboxes(box: tp.DSecSandbox) -> None:
    """The exit-time clean-up is per process: a worker forked from the trainer inherits the
    registry and the atexit hook, and exiting must not stop the trainer's sandboxes."""
    import os

    assert box.sandbox_id in common.live_sandboxes()
    pid = os.fork()
    if pid == 0:  # the child: what its atexit hook would do
        os._exit(0 if common.stop_leftovers() == [] and common.live_sandboxes() == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert box.sandbox_id in common.live_sandboxes()
    assert (await box.run_command("echo alive")).stdout == "alive\n"

"""dsec.integrations.verifiers: the sandbox client verifiers' SandboxEnv calls, contract then real ``dsec up``.

Signatures are prime-sandboxes' ``AsyncSandboxClient`` as github:PrimeIntellect-ai/prime writes it at
66fb4b704377aa56b0f580756c80f3bc824a797a (packages/prime-sandboxes/src/prime_sandboxes/sandbox.py),
restricted to the methods verifiers (github:PrimeIntellect-ai/verifiers at
a60a606ecc4d309247edf9ff92c3eabca362781f) calls on ``env.sandbox_client``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

import dsec
from dsec.integrations import _provider_common as common
from dsec.integrations import verifiers as vp

from .conftest import Cluster, unique

CLIENT_METHODS = {
    "create": "(self, request)",
    "get": "(self, sandbox_id)",
    "delete": "(self, sandbox_id)",
    "bulk_delete": "(self, sandbox_ids=None, labels=None, team_id=None, user_id=None, all_users=False)",
    "execute_command": "(self, sandbox_id, command, working_dir=None, env=None, timeout=None, user=None)",
    "start_background_job": "(self, sandbox_id, command, working_dir=None, env=None, user=None)",
    "get_background_job": "(self, sandbox_id, job, timeout=None)",
    "run_background_job": "(self, sandbox_id, command, timeout=900, working_dir=None, env=None, poll_interval=3)",
    "wait_for_creation": "(self, sandbox_id, max_attempts=60, stability_checks=1, image_build_timeout_seconds=3000)",
    "upload_file": "(self, sandbox_id, file_path, local_file_path, timeout=None)",
    "upload_bytes": "(self, sandbox_id, file_path, file_bytes, filename, timeout=None)",
    "download_file": "(self, sandbox_id, file_path, local_file_path, timeout=None)",
    "read_file": "(self, sandbox_id, file_path, timeout=None, offset=None, length=None)",
    "aclose": "(self)",
}
EXCEPTION_BASES = {
    "APIError": ("Exception",),
    "SandboxFileNotFoundError": ("APIError",),
    "SandboxFileTooLargeError": ("APIError",),
    "SandboxNotRunningError": ("RuntimeError",),
    "CommandTimeoutError": ("RuntimeError",),
    "UploadTimeoutError": ("RuntimeError",),
    "DownloadTimeoutError": ("RuntimeError",),
    "SandboxOOMError": ("SandboxNotRunningError",),
    "SandboxTimeoutError": ("SandboxNotRunningError",),
    "SandboxImagePullError": ("SandboxNotRunningError",),
}


def _shape(func: Any) -> str:
    """A signature as its source writes it, without annotations."""
    sig = inspect.signature(func)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", sorted(CLIENT_METHODS))
def test_client_methods_match_prime_sandboxes(name: str) -> None:
    method = getattr(vp.DSecSandboxClient, name)
    assert _shape(method) == CLIENT_METHODS[name]
    assert inspect.iscoroutinefunction(method)
    assert not inspect.iscoroutinefunction(vp.DSecSandboxClient.teardown)
    assert _shape(vp.DSecSandboxClient.teardown) == "(self, wait=True)"


@pytest.mark.parametrize("name", sorted(EXCEPTION_BASES))
def test_exceptions_have_prime_names_bases_and_messages(name: str) -> None:
    cls = getattr(vp, name)
    assert cls.__name__ == name
    assert tuple(b.__name__ for b in cls.__bases__) == EXCEPTION_BASES[name]
    assert str(vp.CommandTimeoutError("sb", "sleep 9", 5)) == "Command 'sleep 9' timed out after 5s in sandbox sb"
    assert str(vp.UploadTimeoutError("sb", "/f", 5)) == "Upload to '/f' timed out after 5s in sandbox sb"
    assert str(vp.DownloadTimeoutError("sb", "/f", 5)) == "Download from '/f' timed out after 5s in sandbox sb"
    err = vp.SandboxOOMError("sb", error_type="OOM_KILLED")
    assert (str(err), err.sandbox_id, err.error_type) == ("Sandbox sb failed (OOM_KILLED)", "sb", "OOM_KILLED")
    assert str(vp.SandboxNotRunningError("sb", status="TERMINATED")) == "Sandbox sb is not running (status=TERMINATED)"


def test_models_have_the_fields_verifiers_reads() -> None:
    req = vp.CreateSandboxRequest(name="n", docker_image="busybox")
    assert (req.start_command, req.cpu_cores, req.memory_gb, req.disk_size_gb, req.timeout_minutes, req.labels) == (
        "tail -f /dev/null", 1.0, 1.0, 5.0, 60, [],
    )
    assert req.model_copy() == req and req.model_copy() is not req
    with pytest.raises(ValueError):
        vp.CreateSandboxRequest(name="n", docker_image="x", gpu_count=1)
    status = vp.BackgroundJobStatus(job_id="j", completed=False)
    assert (status.exit_code, status.stdout, status.stdout_truncated) == (None, None, False)


def test_sandbox_env_needs_verifiers() -> None:
    if common.optional_module("verifiers") is None:
        with pytest.raises(ImportError, match="DSecSandboxClient"):
            vp.DSecSandboxEnv
    with pytest.raises(AttributeError):
        vp.NoSuchThing  # type: ignore[attr-defined]


# --- on a real `dsec up` ---------------------------------------------------------


@pytest.fixture
async def prime(dsec_env: Cluster) -> AsyncIterator[vp.DSecSandboxClient]:
    client = vp.DSecSandboxClient(max_read_bytes=4096, max_download_bytes=100_000)
    yield client
    await client.aclose()


@pytest.fixture
async def sid(prime: vp.DSecSandboxClient, job_label: str) -> str:
    box = await prime.create(
        vp.CreateSandboxRequest(
            name="verifiers test", docker_image="busybox", timeout_minutes=10, labels=["suite", f"job={job_label}"],
            environment_vars={"FROM_ENV": "e"}, memory_gb=0.5,
        )
    )
    assert box.status == "RUNNING"
    return str(box.id)


async def test_create_get_wait_and_delete(prime: vp.DSecSandboxClient, sid: str, client: dsec.DSecClient) -> None:
    await prime.wait_for_creation(sid)
    got = await prime.get(sid)
    seen = (got.id, got.name, got.status, got.memory_gb, got.timeout_minutes)
    assert seen == (sid, "verifiers-test", "RUNNING", 0.5, 10)
    assert "suite" in got.labels and sid in common.live_sandboxes()
    info = (await client.get_sandbox(sid)).info
    assert info is not None and info.spec.ttl_seconds == 600 and info.spec.labels["dsec.provider"] == "verifiers"
    assert (await prime.execute_command(sid, "echo $FROM_ENV")).stdout == "e\n"
    await prime.delete(sid)
    assert sid not in common.live_sandboxes()
    with pytest.raises(vp.SandboxNotRunningError):
        await prime.wait_for_creation(sid)
    with pytest.raises(vp.SandboxNotRunningError):
        await prime.execute_command(sid, "true")
    with pytest.raises(vp.APIError):
        await prime.get("sb-does-not-exist")


async def test_create_refuses_what_dsec_cannot_give(prime: vp.DSecSandboxClient) -> None:
    with pytest.raises(vp.SandboxImagePullError):
        await prime.create(vp.CreateSandboxRequest(name="x", docker_image="no-such-image-verifiers"))
    with pytest.raises(dsec.InvalidArgument):
        await prime.create(vp.CreateSandboxRequest(name="x", docker_image="busybox", labels=["../bad key"]))
    assert prime.active == {}


async def test_execute_command_with_cwd_env_user_and_timeout(prime: vp.DSecSandboxClient, sid: str) -> None:
    line = 'echo "$(pwd) $A $(id -u)"; echo e >&2; exit 3'
    r = await prime.execute_command(sid, line, working_dir="/tmp", env={"A": "a"}, user="nobody")
    assert (r.stdout, r.stderr, r.exit_code) == ("/tmp a 65534\n", "e\n", 3)
    with pytest.raises(vp.CommandTimeoutError, match=r"timed out after 1s"):
        await prime.execute_command(sid, "sleep 30", timeout=1)
    with pytest.raises(dsec.InvalidArgument):
        await prime.execute_command(sid, "true", timeout=-1)


async def test_output_is_capped_per_stream(dsec_env: Cluster) -> None:
    async with vp.DSecSandboxClient(max_output_bytes=2048) as capped:
        box = await capped.create(vp.CreateSandboxRequest(name="cap", docker_image="busybox", timeout_minutes=5))
        r = await capped.execute_command(box.id, "head -c 5000000 /dev/zero | tr '\\0' x")
        assert r.exit_code == 0 and len(r.stdout) <= 2 * 2048 + 256
        assert box.id in capped.active
    assert capped.active == {} and box.id not in common.live_sandboxes()


async def test_background_jobs(prime: vp.DSecSandboxClient, sid: str) -> None:
    job = await prime.start_background_job(sid, "sleep 0.3; echo done; echo err >&2; exit 5", working_dir="/tmp")
    assert job.sandbox_id == sid and job.stdout_log_file.startswith("dsec:commands/")
    status = await prime.get_background_job(sid, job)
    for _ in range(200):
        if status.completed:
            break
        await asyncio.sleep(0.05)
        status = await prime.get_background_job(sid, job)
    assert (status.completed, status.exit_code, status.stdout, status.stderr) == (True, 5, "done\n", "err\n")
    ran = await prime.run_background_job(sid, "pwd; echo $B", working_dir="/etc", env={"B": "b"})
    assert (ran.completed, ran.exit_code, ran.stdout) == (True, 0, "/etc\nb\n")
    with pytest.raises(vp.CommandTimeoutError):
        await prime.run_background_job(sid, "sleep 30", timeout=1)


async def test_files_upload_read_download_and_limits(prime: vp.DSecSandboxClient, sid: str, tmp_path: Path) -> None:
    local = tmp_path / "in.txt"
    local.write_text("hello world")
    up = await prime.upload_file(sid, "/data/deep/in.txt", str(local))
    assert (up.success, up.path, up.size) == (True, "/data/deep/in.txt", 11)
    with pytest.raises(FileNotFoundError):
        await prime.upload_file(sid, "/x", str(tmp_path / "missing"))
    await prime.upload_bytes(sid, "/data/b.bin", b"\x00\x01abc", "b.bin")
    whole = await prime.read_file(sid, "/data/deep/in.txt")
    seen = (whole.content, whole.size, whole.total_size, whole.offset, whole.truncated)
    assert seen == ("hello world", 11, 11, 0, False)
    window = await prime.read_file(sid, "/data/deep/in.txt", offset=6, length=3)
    assert (window.content, window.size, window.total_size, window.truncated) == ("wor", 3, 11, True)
    with pytest.raises(vp.SandboxFileNotFoundError):
        await prime.read_file(sid, "/nope")
    await prime.execute_command(sid, "head -c 20000000 /dev/zero > /big")
    with pytest.raises(vp.SandboxFileTooLargeError):
        await prime.read_file(sid, "/big")
    head = await prime.read_file(sid, "/big", length=10)
    assert head.size == 10 and head.truncated
    out = tmp_path / "out.txt"
    await prime.download_file(sid, "/data/deep/in.txt", str(out))
    assert out.read_text() == "hello world"
    with pytest.raises(vp.SandboxFileTooLargeError):
        await prime.download_file(sid, "/big", str(tmp_path / "big"))
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.txt"]  # no partial file left
    with pytest.raises(vp.SandboxFileNotFoundError):
        await prime.download_file(sid, "/nope", str(tmp_path / "n"))


async def test_paths_a_sandbox_made_stay_inside_it(prime: vp.DSecSandboxClient, sid: str, tmp_path: Path) -> None:
    await prime.execute_command(sid, "ln -s / /tmp/up && echo mine > /etc/mine && ln -s /etc/mine /tmp/link")
    assert (await prime.read_file(sid, "/tmp/up/etc/mine")).content == "mine\n"
    assert (await prime.read_file(sid, "/../../../../etc/mine")).content == "mine\n"
    out = tmp_path / "link"
    await prime.download_file(sid, "/tmp/link", str(out))
    assert out.read_text() == "mine\n" and not out.is_symlink()


async def test_bulk_delete_by_id_and_label(prime: vp.DSecSandboxClient, job_label: str) -> None:
    tag = unique("bulk")
    ids = []
    for i in range(3):
        labels = [f"bulk={tag}"]
        request = vp.CreateSandboxRequest(name=f"b{i}", docker_image="busybox", timeout_minutes=5, labels=labels)
        ids.append((await prime.create(request)).id)
    by_id = await prime.bulk_delete([ids[0], "sb-not-there"])
    assert by_id.succeeded == [ids[0]] and [f["sandbox_id"] for f in by_id.failed] == ["sb-not-there"]
    by_label = await prime.bulk_delete(labels=[f"bulk={tag}"])
    assert sorted(by_label.succeeded) == sorted(ids[1:])
    assert not set(ids) & set(common.live_sandboxes()) and prime.active == {}
    with pytest.raises(ValueError):
        await prime.bulk_delete()


async def test_teardown_stops_what_is_left_without_a_loop(dsec_env: Cluster, client: dsec.DSecClient) -> None:
    prime = vp.DSecSandboxClient()
    box = await prime.create(vp.CreateSandboxRequest(name="td", docker_image="busybox", timeout_minutes=5))
    await asyncio.get_running_loop().run_in_executor(None, prime.teardown)
    assert prime.active == {} and box.id not in common.live_sandboxes()
    assert (await client.sandbox(box.id).refresh()).state == "stopped"
    await prime.aclose()


async def test_the_example_runs(dsec_env: Cluster) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "verifiers_sandbox_env.py"
    done = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: subprocess.run(
            [sys.executable, str(example), "--image", "busybox"], capture_output=True, text=True, timeout=300
        ),
    )
    assert done.returncode == 0, done.stderr
    assert "background job: 0 42" in done.stdout


async def test_hostile_ids_stay_one_path_segment(prime: vp.DSecSandboxClient, sid: str) -> None:
    """IDs come from the caller's state dicts: one that looks like a path never reaches another route."""
    for bad in ("../../v1/keys", "sb-x/../../healthz", "%2e%2e", ""):
        with pytest.raises((vp.SandboxNotRunningError, vp.APIError)):
            await prime.execute_command(bad, "true")
        with pytest.raises((vp.SandboxNotRunningError, vp.APIError)):
            await prime.read_file(bad, "/etc/passwd")
    job = vp.BackgroundJob(job_id="../../../keys", sandbox_id=sid, stdout_log_file="", stderr_log_file="", exit_file="")
    with pytest.raises(vp.APIError):
        await prime.get_background_job(sid, job)
    assert (await prime.execute_command(sid, "echo still")).stdout == "still\n"


async def test_sandbox_env_glue_with_verifiers_teardown_protocol(
    dsec_env: Cluster, client: dsec.DSecClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSecSandboxEnv against a stand-in for verifiers.legacy with the pinned commit's protocol:
    ``SandboxEnv.__init__`` sets ``sandbox_client`` and ``active_sandboxes``; ``@vf.teardown`` marks
    handlers by attribute (decorators.py) and the environment runs them in a fresh loop at exit."""
    import sys
    import types

    fake = types.ModuleType("verifiers.legacy")

    def teardown(f: Any) -> Any:
        setattr(f, "teardown", True)
        return f

    class SandboxEnv:
        def __init__(self, **kwargs: Any) -> None:
            self.sandbox_client: Any = "prime's client"
            self.active_sandboxes: set = set()

    fake.teardown = teardown  # type: ignore[attr-defined]
    fake.SandboxEnv = SandboxEnv  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verifiers", types.ModuleType("verifiers"))
    monkeypatch.setitem(sys.modules, "verifiers.legacy", fake)

    env = vp.DSecSandboxEnv(dsec_image_map={"python:3.11-slim": "busybox"})
    assert isinstance(env, SandboxEnv) and isinstance(env.sandbox_client, vp.DSecSandboxClient)
    box = await env.sandbox_client.create(vp.CreateSandboxRequest(name="env", docker_image="python:3.11-slim"))
    env.active_sandboxes.add(box.id)
    handlers = [getattr(env, n) for n in dir(env) if getattr(getattr(env, n), "teardown", None) is True]
    assert sorted(h.__name__ for h in handlers) == ["teardown_sandbox_client", "teardown_sandboxes"]

    def at_exit() -> None:
        for handler in handlers:
            asyncio.run(handler())

    await asyncio.get_running_loop().run_in_executor(None, at_exit)
    assert env.active_sandboxes == set() and box.id not in common.live_sandboxes()
    assert (await client.sandbox(box.id).refresh()).state == "stopped"

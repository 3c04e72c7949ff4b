"""dsec.integrations.swerex: SWE-ReX's runtime/deployment contract, then the provider on a real ``dsec up``.

The expected interface below is SWE-ReX's as github:SWE-agent/SWE-ReX writes it at
5c995c365dfb1fd5bc56fda688be5d8538f9931f (src/swerex/runtime/abstract.py,
src/swerex/deployment/abstract.py, src/swerex/exceptions.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

import dsec
from dsec.integrations import _provider_common as common
from dsec.integrations import swerex as sx

from .conftest import Cluster

# method -> (signature as the pinned source writes it, without annotations; coroutine?)
RUNTIME_METHODS = {
    "is_alive": ("(self, *, timeout=None)", True),
    "create_session": ("(self, request)", True),
    "run_in_session": ("(self, action)", True),
    "close_session": ("(self, request)", True),
    "execute": ("(self, command)", True),
    "read_file": ("(self, request)", True),
    "write_file": ("(self, request)", True),
    "upload": ("(self, request)", True),
    "close": ("(self)", True),
}
DEPLOYMENT_METHODS = {
    "add_hook": ("(self, hook)", False),
    "is_alive": ("(self, *, timeout=None)", True),
    "start": ("(self, *args, **kwargs)", True),
    "stop": ("(self, *args, **kwargs)", True),
}
EXCEPTION_BASES = {
    "SessionNotInitializedError": ("SwerexException", "RuntimeError"),
    "NonZeroExitCodeError": ("SwerexException", "RuntimeError"),
    "BashIncorrectSyntaxError": ("SwerexException", "RuntimeError"),
    "CommandTimeoutError": ("SwerexException", "RuntimeError", "TimeoutError"),
    "NoExitCodeError": ("SwerexException", "RuntimeError"),
    "SessionExistsError": ("SwerexException", "ValueError"),
    "SessionDoesNotExistError": ("SwerexException", "ValueError"),
    "DeploymentNotStartedError": ("SwerexException", "RuntimeError"),
    "DeploymentStartupError": ("SwerexException", "RuntimeError"),
}
MODEL_FIELDS: Dict[str, Dict[str, Any]] = {
    "CreateBashSessionRequest": {
        "startup_source": [], "session": "default", "session_type": "bash", "startup_timeout": 1.0,
    },
    "BashAction": {
        "command": None, "session": "default", "timeout": None, "is_interactive_command": False,
        "is_interactive_quit": False, "check": "raise", "error_msg": "", "expect": [], "action_type": "bash",
    },
    "BashInterruptAction": {
        "session": "default", "timeout": 0.2, "n_retry": 3, "expect": [], "action_type": "bash_interrupt",
    },
    "BashObservation": {
        "output": "", "exit_code": None, "failure_reason": "", "expect_string": "", "session_type": "bash",
    },
    "CloseBashSessionRequest": {"session": "default", "session_type": "bash"},
    "Command": {
        "command": None, "timeout": None, "shell": False, "check": False, "error_msg": "",
        "env": None, "cwd": None, "merge_output_streams": False,
    },
    "CommandResponse": {"stdout": "", "stderr": "", "exit_code": None},
    "ReadFileRequest": {"path": None, "encoding": None, "errors": None},
    "WriteFileRequest": {"content": None, "path": None},
    "UploadRequest": {"source_path": None, "target_path": None},
    "IsAliveResponse": {"is_alive": None, "message": ""},
}


def _shape(func: Any) -> str:
    sig = inspect.signature(func)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def _defaults(model: Any) -> Dict[str, Any]:
    if dataclasses.is_dataclass(model):
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(model):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = None
        return out
    fields = model.model_fields.items()
    return {name: (None if f.is_required() else f.get_default(call_default_factory=True)) for name, f in fields}


@pytest.mark.parametrize("name", sorted(RUNTIME_METHODS))
def test_runtime_methods_match_the_pinned_abstract_runtime(name: str) -> None:
    params, is_coroutine = RUNTIME_METHODS[name]
    method = getattr(sx.DSecRuntime, name)
    assert _shape(method) == params
    assert inspect.iscoroutinefunction(method) is is_coroutine


@pytest.mark.parametrize("name", sorted(DEPLOYMENT_METHODS))
def test_deployment_methods_match_the_pinned_abstract_deployment(name: str) -> None:
    params, is_coroutine = DEPLOYMENT_METHODS[name]
    method = getattr(sx.DSecDeployment, name)
    assert _shape(method) == params
    assert inspect.iscoroutinefunction(method) is is_coroutine
    assert isinstance(inspect.getattr_static(sx.DSecDeployment, "runtime"), property)


@pytest.mark.parametrize("name", sorted(EXCEPTION_BASES))
def test_exceptions_have_swerex_names_and_bases(name: str) -> None:
    cls = getattr(sx, name)
    assert cls.__name__ == name
    assert tuple(b.__name__ for b in cls.__bases__) == EXCEPTION_BASES[name]
    assert issubclass(cls, sx.SwerexException)
    assert sx.DeploymentNotStartedError().args == ("Deployment not started",)
    err = sx.BashIncorrectSyntaxError("bad", extra_info={"bash_stderr": "x"})
    assert err.extra_info == {"bash_stderr": "x"} and sx.BashIncorrectSyntaxError("m").extra_info == {}


@pytest.mark.parametrize("name", sorted(MODEL_FIELDS))
def test_models_have_swerex_fields_and_defaults(name: str) -> None:
    assert _defaults(getattr(sx, name)) == MODEL_FIELDS[name]
    assert bool(sx.IsAliveResponse(is_alive=False)) is False and bool(sx.IsAliveResponse(is_alive=True))


def test_provider_imports_without_swerex_or_other_frameworks() -> None:
    assert sx.SWEREX_INSTALLED is (common.optional_module("swerex") is not None)
    assert issubclass(sx.FileTooLargeError, sx.SwerexException)


def test_bad_timeouts_and_caps_are_invalid_arguments() -> None:
    for bad in (0, -1, float("nan"), "5", True):
        with pytest.raises(dsec.InvalidArgument):
            common.command_timeout(bad)  # type: ignore[arg-type]
    assert common.command_timeout(None) == common.MAX_COMMAND_TIMEOUT_S
    assert common.command_timeout(10**9) == common.MAX_COMMAND_TIMEOUT_S
    with pytest.raises(dsec.InvalidArgument):
        common.output_cap(0, 10)
    assert common.output_cap(10**12, 10) == common.MAX_OUTPUT_BYTES
    with pytest.raises(dsec.InvalidArgument):
        sx.DSecDeployment("busybox", ttl=-5)


# --- on a real `dsec up` -------------------------------------------------------


async def _runtime(sandbox: dsec.Sandbox, **kwargs: Any) -> sx.DSecRuntime:
    runtime = sx.DSecRuntime(sandbox, **kwargs)
    await runtime.create_session(sx.CreateBashSessionRequest())
    return runtime


async def test_a_session_keeps_state_merges_output_and_applies_check(sandbox: dsec.Sandbox) -> None:
    runtime = await _runtime(sandbox)
    await runtime.run_in_session(sx.BashAction(command="cd /tmp && export SEEN=yes"))
    obs = await runtime.run_in_session(sx.BashAction(command='echo "$(pwd) $SEEN"; echo err >&2; echo out'))
    assert (obs.output, obs.exit_code, obs.failure_reason) == ("/tmp yes\nerr\nout\n", 0, "")

    with pytest.raises(sx.NonZeroExitCodeError, match=r"^why: Command 'exit_3\(\)"):
        await runtime.run_in_session(sx.BashAction(command="exit_3() { return 3; }; exit_3", error_msg="why"))
    silent = await runtime.run_in_session(sx.BashAction(command="false", check="silent"))
    assert silent.exit_code == 1
    ignored = await runtime.run_in_session(sx.BashAction(command="false", check="ignore"))
    assert ignored.exit_code is None
    multi = await runtime.run_in_session(sx.BashAction(command="echo a\necho b\ncat <<EOF\nc\nEOF"))
    assert multi.output == "a\nb\nc\n"
    empty = await runtime.run_in_session(sx.BashAction(command="# only a comment"))
    assert (empty.output, empty.exit_code) == ("", 0)
    await runtime.close()


async def test_a_syntax_error_raises_and_runs_nothing(sandbox: dsec.Sandbox) -> None:
    runtime = await _runtime(sandbox)
    with pytest.raises(sx.BashIncorrectSyntaxError) as caught:
        await runtime.run_in_session(sx.BashAction(command="touch /tmp/ran\nif then fi"))
    assert "syntax error" in caught.value.extra_info["bash_stderr"]
    assert not await sandbox.files.exists("/tmp/ran")
    # A command printing what looks like the marker is not a syntax error: the marker is per call.
    obs = await runtime.run_in_session(sx.BashAction(command="printf 'SWEREX_SYNTAX_0'"))
    assert obs.output == "SWEREX_SYNTAX_0"
    await runtime.close()


async def test_a_timeout_raises_command_timeout_and_the_session_lives_on(sandbox: dsec.Sandbox) -> None:
    runtime = await _runtime(sandbox)
    await runtime.run_in_session(sx.BashAction(command="KEEP=1"))
    with pytest.raises(sx.CommandTimeoutError) as caught:
        await runtime.run_in_session(sx.BashAction(command="sleep 30", timeout=0.5))
    assert isinstance(caught.value, TimeoutError)
    obs = await runtime.run_in_session(sx.BashAction(command="echo $KEEP"))
    assert obs.output == "1\n"
    await runtime.close()


async def test_session_names_exist_once_and_odd_names_are_mapped(sandbox: dsec.Sandbox) -> None:
    runtime = sx.DSecRuntime(sandbox)
    with pytest.raises(sx.SessionDoesNotExistError):
        await runtime.run_in_session(sx.BashAction(command="true", session="nope"))
    with pytest.raises(sx.SessionDoesNotExistError):
        await runtime.close_session(sx.CloseBashSessionRequest(session="nope"))
    for name in ("default", "../../etc", "a b/c", "x" * 200, "swerex-default"):
        await runtime.create_session(sx.CreateBashSessionRequest(session=name))
        with pytest.raises(sx.SessionExistsError):
            await runtime.create_session(sx.CreateBashSessionRequest(session=name))
        await runtime.run_in_session(sx.BashAction(command=f"V={len(name)}", session=name))
    outs = {}
    for n in runtime.sessions:
        outs[n] = (await runtime.run_in_session(sx.BashAction(command="echo $V", session=n))).output
    assert outs == {n: f"{len(n)}\n" for n in ("default", "../../etc", "a b/c", "x" * 200, "swerex-default")}
    remote = {s.name for s in await sandbox.list_sessions()}
    assert len(remote) == 5 and all(len(r) <= 64 and "/" not in r and " " not in r for r in remote)
    await runtime.close_session(sx.CloseBashSessionRequest(session="a b/c"))
    assert "a b/c" not in runtime.sessions
    await runtime.close()
    assert await sandbox.list_sessions() == []


async def test_startup_source_is_sourced(sandbox: dsec.Sandbox) -> None:
    await sandbox.files.write("/tmp/rc.sh", "export FROM_RC=rc\necho sourced\n")
    runtime = sx.DSecRuntime(sandbox)
    created = await runtime.create_session(
        sx.CreateBashSessionRequest(startup_source=["/tmp/rc.sh"], startup_timeout=30)
    )
    assert created.output == "sourced\n"
    assert (await runtime.run_in_session(sx.BashAction(command="echo $FROM_RC"))).output == "rc\n"
    await runtime.close()


async def test_interrupt_ends_a_running_call(sandbox: dsec.Sandbox) -> None:
    runtime = await _runtime(sandbox)
    running = asyncio.ensure_future(runtime.run_in_session(sx.BashAction(command="sleep 600", timeout=900)))
    for _ in range(500):
        if any(c.state == "running" and c.session == "default" for c in await sandbox.commands.list()):
            break
        await asyncio.sleep(0.02)
    obs = await runtime.run_in_session(sx.BashInterruptAction())
    assert obs.exit_code == 0 and obs.failure_reason == ""
    with pytest.raises(sx.NonZeroExitCodeError):
        await running
    assert (await runtime.run_in_session(sx.BashAction(command="echo alive"))).output == "alive\n"
    with pytest.raises(NotImplementedError):
        await runtime.run_in_session(sx.BashAction(command="gdb", is_interactive_command=True))
    await runtime.close()


async def test_execute_is_subprocess_run(sandbox: dsec.Sandbox) -> None:
    runtime = sx.DSecRuntime(sandbox)
    argv = ["sh", "-c", 'echo "$A $(pwd)"; echo e >&2; exit 4']
    r = await runtime.execute(sx.Command(command=argv, env={"A": "x"}, cwd="/tmp"))
    assert (r.stdout, r.stderr, r.exit_code) == ("x /tmp\n", "e\n", 4)
    shell = await runtime.execute(sx.Command(command="echo $((1+2)) | tr 3 z", shell=True))
    assert shell.stdout == "z\n"
    positional = await runtime.execute(sx.Command(command=['echo "$1-$2"', "a b", "c"], shell=True))
    assert positional.stdout == "a b-c\n"
    merged = await runtime.execute(sx.Command(command=["sh", "-c", "echo o; echo e >&2"], merge_output_streams=True))
    assert (merged.stdout, merged.stderr) == ("o\ne\n", "")
    merged_shell = await runtime.execute(
        sx.Command(command="echo o; echo e >&2", shell=True, merge_output_streams=True)
    )
    assert (merged_shell.stdout, merged_shell.stderr) == ("o\ne\n", "")
    with pytest.raises(sx.NonZeroExitCodeError, match="^ctx: Command"):
        await runtime.execute(sx.Command(command="exit 2", shell=True, check=True, error_msg="ctx"))
    with pytest.raises(sx.CommandTimeoutError):
        await runtime.execute(sx.Command(command=["sleep", "30"], timeout=0.5))
    with pytest.raises(ValueError):
        await runtime.execute(sx.Command(command=[]))
    # As subprocess.run: a string without shell=True is one program name, and a missing one is an OSError.
    with pytest.raises(FileNotFoundError):
        await runtime.execute(sx.Command(command="echo hi"))
    await sandbox.files.write("/tmp/noexec", "#!/bin/sh\n", mode=0o644)
    with pytest.raises(PermissionError):
        await runtime.execute(sx.Command(command=["/tmp/noexec"]))


async def test_execute_output_is_capped_and_user_applies(sandbox: dsec.Sandbox) -> None:
    runtime = sx.DSecRuntime(sandbox, max_output_bytes=4096)
    big = await runtime.execute(sx.Command(command="head -c 3000000 /dev/zero | tr '\\0' a", shell=True))
    assert big.exit_code == 0 and len(big.stdout) <= 2 * 4096 + 256
    nobody = sx.DSecRuntime(sandbox, user="nobody")
    who = await nobody.execute(sx.Command(command=["id", "-u"]))
    assert who.stdout.strip() == "65534"
    with pytest.raises(PermissionError):
        await nobody.write_file(sx.WriteFileRequest(content="x", path="/root/owned/by/root"))


async def test_files_read_write_limits_and_errors(sandbox: dsec.Sandbox) -> None:
    runtime = sx.DSecRuntime(sandbox, max_read_bytes=1000)
    await runtime.write_file(sx.WriteFileRequest(content="héllo\n", path="/tmp/new/dir/f.txt"))
    assert (await runtime.read_file(sx.ReadFileRequest(path="/tmp/new/dir/f.txt"))).content == "héllo\n"
    latin = await runtime.read_file(sx.ReadFileRequest(path="/tmp/new/dir/f.txt", encoding="latin-1"))
    assert latin.content == "héllo\n".encode().decode("latin-1")
    await sandbox.files.write("/tmp/bin", b"\xff\xfe ok")
    with pytest.raises(UnicodeDecodeError):
        await runtime.read_file(sx.ReadFileRequest(path="/tmp/bin"))
    assert (await runtime.read_file(sx.ReadFileRequest(path="/tmp/bin", errors="replace"))).content == "\ufffd\ufffd ok"
    with pytest.raises(FileNotFoundError):
        await runtime.read_file(sx.ReadFileRequest(path="/tmp/missing"))
    with pytest.raises(IsADirectoryError):
        await runtime.read_file(sx.ReadFileRequest(path="/etc"))
    await sandbox.run_shell("head -c 50000000 /dev/zero > /tmp/huge")
    with pytest.raises(sx.FileTooLargeError):
        await runtime.read_file(sx.ReadFileRequest(path="/tmp/huge"))


async def test_paths_resolve_inside_the_sandbox_only(sandbox: dsec.Sandbox) -> None:
    """A symlink or ``..`` the sandbox made leads to the sandbox's own files, never the host's."""
    runtime = sx.DSecRuntime(sandbox)
    await sandbox.run_shell("ln -s / /tmp/root && ln -s /etc/hostname /tmp/hn && echo sandbox-only > /etc/marker")
    inside = (await sandbox.run_shell("cat /etc/passwd")).stdout
    assert (await runtime.read_file(sx.ReadFileRequest(path="/tmp/root/etc/passwd"))).content == inside
    assert (await runtime.read_file(sx.ReadFileRequest(path="/../../../etc/marker"))).content == "sandbox-only\n"
    await runtime.write_file(sx.WriteFileRequest(content="w", path="/tmp/../../escape"))
    assert (await sandbox.run_shell("cat /escape")).stdout == "w"
    assert not Path("/escape").exists()


async def test_upload_copies_files_and_trees(sandbox: dsec.Sandbox, tmp_path: Path) -> None:
    runtime = sx.DSecRuntime(sandbox)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(tree / "sub" / "run.sh", 0o755)
    await runtime.upload(sx.UploadRequest(source_path=str(tree), target_path="/work/tree"))
    assert (await sandbox.run_shell("cat /work/tree/a.txt; /work/tree/sub/run.sh")).stdout == "arun\n"
    with pytest.raises(FileExistsError):
        await runtime.upload(sx.UploadRequest(source_path=str(tree), target_path="/work/tree"))
    await runtime.upload(sx.UploadRequest(source_path=str(tree / "a.txt"), target_path="/work"))
    assert (await sandbox.files.read("/work/a.txt")) == b"a"
    with pytest.raises(FileNotFoundError):
        await runtime.upload(sx.UploadRequest(source_path=str(tmp_path / "none"), target_path="/x"))


async def test_deployment_lifecycle_and_clean_up(dsec_env: Cluster, client: dsec.DSecClient) -> None:
    deployment = sx.DSecDeployment("busybox", ttl=600, labels={"t": "swerex"})
    with pytest.raises(sx.DeploymentNotStartedError):
        deployment.runtime
    with pytest.raises(sx.DeploymentNotStartedError):
        await deployment.is_alive()
    steps: List[str] = []

    class Hook:
        def on_custom_step(self, message: str) -> None:
            steps.append(message)

    deployment.add_hook(Hook())
    await deployment.start()
    sandbox_id = deployment.sandbox.id
    assert sandbox_id in common.live_sandboxes() and steps[0] == "Starting DSec sandbox"
    assert bool(await deployment.is_alive())
    info = await client.get_sandbox(sandbox_id)
    assert info.info is not None and info.info.spec.labels.get("dsec.provider") == "swerex"
    assert 0 < info.info.spec.ttl_seconds <= 600
    runtime = deployment.runtime
    await runtime.create_session(sx.CreateBashSessionRequest())
    assert (await runtime.run_in_session(sx.BashAction(command="echo hi"))).output == "hi\n"
    await deployment.stop()
    await deployment.stop()
    assert sandbox_id not in common.live_sandboxes()
    assert (await client.sandbox(sandbox_id).refresh()).state == "stopped"
    assert not bool(await runtime.is_alive())


async def test_deployment_start_failure_and_exit_time_clean_up(dsec_env: Cluster, client: dsec.DSecClient) -> None:
    with pytest.raises(sx.DeploymentStartupError) as caught:
        await sx.DSecDeployment("no-such-image-swerex").start()
    assert isinstance(caught.value.__cause__, dsec.ImageNotFound)
    leaked = sx.DSecDeployment("busybox", ttl=600)
    await leaked.start()
    sandbox_id = leaked.sandbox.id
    # What atexit does when a job dies without stop(): the blocking client stops what is left.
    stopped = await asyncio.get_running_loop().run_in_executor(None, common.stop_leftovers)
    assert sandbox_id in stopped and common.live_sandboxes() == []
    assert (await client.sandbox(sandbox_id).refresh()).state == "stopped"
    await leaked.stop()  # stopping after the sandbox is gone is fine


async def test_the_example_runs(dsec_env: Cluster) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "python" / "swerex_deployment.py"
    done = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: subprocess.run(
            [sys.executable, str(example), "--image", "busybox"], capture_output=True, text=True, timeout=300
        ),
    )
    assert done.returncode == 0, done.stderr
    assert "session: in /repo, step 1" in done.stdout


@pytest.mark.parametrize("module", ["swerex", "verifiers", "tinker"])
def test_each_provider_imports_without_the_others(module: str) -> None:
    import subprocess
    import sys

    others = {"swerex", "verifiers", "tinker"} - {module}
    code = (
        f"import sys, dsec.integrations.{module}\n"
        f"loaded = [m for m in {sorted(others)!r} if 'dsec.integrations.' + m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    cwd = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stderr


def test_deployment_config_builds_a_deployment_as_swerex_get_deployment_does() -> None:
    config = sx.DSecDeploymentConfig(image="busybox", ttl=60, labels={"a": "b"})
    assert config.type == "dsec"
    swerex_config = common.optional_module("swerex.deployment.config")
    if swerex_config is not None:
        deployment = swerex_config.get_deployment(config)
    else:
        deployment = config.get_deployment()
    assert isinstance(deployment, sx.DSecDeployment)
    with pytest.raises(sx.DeploymentNotStartedError):
        deployment.runtime

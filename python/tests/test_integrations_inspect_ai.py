"""``dsec.integrations.inspect_ai`` against inspect_ai's ``SandboxEnvironment`` contract.

The contract is the one UKGovernmentBEIS/inspect_ai writes at commit
499e6152e7b8fc8cbd8ac5283536572aa6e4ab17 (``util/_sandbox/environment.py``, ``limits.py``, and
the behaviours its ``self_check.py`` asserts): signatures, errors and limits, checked on a real
``dsec up`` (the session's ``cluster`` fixture) with the busybox image.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List

import pytest

import dsec
from dsec.integrations import inspect_ai as provider
from dsec.integrations.inspect_ai import (
    DSecSandboxConfig,
    DSecSandboxEnvironment,
    OutputLimitExceededError,
    SandboxUnavailableError,
    resolve_config,
)

from .conftest import Cluster, unique

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _config(cluster: Cluster, **extra: Any) -> DSecSandboxConfig:
    return DSecSandboxConfig(image="busybox", url=cluster.url, api_key=cluster.admin_key, ttl_seconds=600, **extra)


@pytest.fixture
async def env(cluster: Cluster) -> AsyncIterator[DSecSandboxEnvironment]:
    task = unique("task")
    config = _config(cluster)
    await DSecSandboxEnvironment.task_init(task, config)
    envs = await DSecSandboxEnvironment.sample_init(task, config, {})
    yield envs["default"]  # type: ignore[misc]
    await DSecSandboxEnvironment.sample_cleanup(task, config, dict(envs), False)
    await DSecSandboxEnvironment.task_cleanup(task, config, True)


# --- the interface as the pinned commit defines it ---------------------------


def test_signatures_match_inspect_ai() -> None:
    def params(fn: Any) -> List[tuple]:
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    kw = "POSITIONAL_OR_KEYWORD"
    assert params(DSecSandboxEnvironment.exec) == [
        ("self", kw, empty),
        ("cmd", kw, empty),
        ("input", kw, None),
        ("cwd", kw, None),
        ("env", kw, None),
        ("user", kw, None),
        ("timeout", kw, None),
        ("timeout_retry", kw, True),
        ("concurrency", kw, True),
    ]
    assert params(DSecSandboxEnvironment.write_file) == [
        ("self", kw, empty),
        ("file", kw, empty),
        ("contents", kw, empty),
    ]
    assert params(DSecSandboxEnvironment.read_file) == [("self", kw, empty), ("file", kw, empty), ("text", kw, True)]
    assert params(DSecSandboxEnvironment.connection) == [("self", kw, empty), ("user", "KEYWORD_ONLY", None)]
    assert [p[0] for p in params(DSecSandboxEnvironment.task_init)] == ["task_name", "config"]
    assert [p[0] for p in params(DSecSandboxEnvironment.sample_init)] == ["task_name", "config", "metadata"]
    assert [p[0] for p in params(DSecSandboxEnvironment.sample_cleanup)] == [
        "task_name",
        "config",
        "environments",
        "interrupted",
    ]
    assert [p[0] for p in params(DSecSandboxEnvironment.task_cleanup)] == ["task_name", "config", "cleanup"]
    assert [p[0] for p in params(DSecSandboxEnvironment.cli_cleanup)] == ["id"]
    for name in ("exec", "write_file", "read_file", "connection", "task_init", "sample_init", "sample_cleanup"):
        assert inspect.iscoroutinefunction(getattr(DSecSandboxEnvironment, name)), name
    assert DSecSandboxEnvironment.config_files() == []


def test_entry_point_names_the_module() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["entry-points"]["inspect_ai"] == {"dsec": "dsec.integrations.inspect_ai"}
    assert provider.SANDBOX_TYPE == "dsec"


def test_importable_on_its_own() -> None:
    # A fresh interpreter: importing this provider pulls in neither Harbor's provider nor any
    # framework that is not installed, and says whether inspect_ai was found.
    import subprocess

    probe = (
        "import sys, dsec.integrations.inspect_ai as p; "
        "assert 'dsec.integrations.harbor' not in sys.modules; "
        "print(p.HAVE_INSPECT, 'inspect_ai' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=PYPROJECT.parent, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == out[1]
    assert provider.HAVE_INSPECT == (out[0] == "True")


def test_limits_follow_inspects_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert provider.max_exec_output_size() == (10 * 1024**2, "10 MiB")
    assert provider.max_read_file_size() == (100 * 1024**2, "100 MiB")
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", "2048")
    assert provider.max_read_file_size() == (2048, "2 KiB")
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", "-1")
    with pytest.raises(ValueError, match="positive"):
        provider.max_read_file_size()
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", "lots")
    with pytest.raises(ValueError, match="integer"):
        provider.max_exec_output_size()


def test_output_limit_error_reads_as_inspects() -> None:
    err = OutputLimitExceededError("1 KiB", truncated_output="abc")
    assert str(err) == "The sandbox output stream limit of 1 KiB was exceeded."
    assert err.truncated_output == "abc" and err.limit_str == "1 KiB"


# --- configuration -----------------------------------------------------------


def test_config_is_hashable_and_comparable() -> None:
    # inspect's SandboxEnvironmentSpec is a frozen model: a config inside it gets hashed
    a = DSecSandboxConfig(image="busybox", env={"A": "1"}, network_rules={"pypi": True})
    b = DSecSandboxConfig(image="busybox", env={"A": "1"}, network_rules={"pypi": True})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert hash(DSecSandboxConfig(image="busybox", env={"A": "2"})) != hash(a)


def test_config_forms(tmp_path: Path) -> None:
    assert resolve_config(None).image == "debian"
    assert resolve_config({"image": "busybox", "memory_mb": 256}).memory_mb == 256
    cfg = tmp_path / "dsec.json"
    cfg.write_text(json.dumps({"image": "busybox", "env": {"A": "1"}}))
    assert resolve_config(str(cfg)).env == {"A": "1"}
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM busybox\n")
    assert resolve_config(str(dockerfile)).dockerfile == str(dockerfile.resolve())


@pytest.mark.parametrize(
    "bad",
    [
        {"imagee": "typo"},
        {"memory_mb": "lots"},
        "compose.yaml",
        "missing/Dockerfile",
        42,
    ],
)
def test_bad_config_is_invalid_argument(bad: Any) -> None:
    with pytest.raises(dsec.InvalidArgument) as info:
        resolve_config(bad)
    assert info.value.code == "invalid_argument" and info.value.field == "config"


def test_config_file_attacks(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (provider.MAX_CONFIG_FILE_BYTES + 1))
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    garbled = tmp_path / "garbled.json"
    garbled.write_bytes(b"\xff{")
    for path in (big, not_object, garbled, tmp_path / "absent.json"):
        with pytest.raises(dsec.InvalidArgument):
            resolve_config(str(path))


class _FakeBuilder:
    """A client with only what the Dockerfile path needs: records build_image calls."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []

    async def build_image(self, context_dir: str, *, name: str, dockerfile: str, timeout: float = 0) -> str:
        self.calls.append({"context": context_dir, "name": name, "dockerfile": dockerfile, "timeout": timeout})
        return name


async def test_dockerfile_config_builds_through_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.integrations import _provider_base as base

    (tmp_path / "Dockerfile").write_text("FROM busybox\nCOPY a /a\n")
    (tmp_path / "a").write_text("one")
    fake = _FakeBuilder()

    async def acquire(url: Any, key: Any) -> Any:
        return fake

    async def release(client: Any) -> None:
        return None

    monkeypatch.setattr(base, "acquire_client", acquire)
    monkeypatch.setattr(base, "release_client", release)
    config = resolve_config(str(tmp_path / "Dockerfile"))
    await DSecSandboxEnvironment.task_init("My Task/1", config)
    await DSecSandboxEnvironment.task_init("My Task/1", config)  # once per task and config
    assert len(fake.calls) == 1
    call = fake.calls[0]
    assert call["context"] == str(tmp_path) and call["dockerfile"] == "Dockerfile"
    assert call["name"].startswith("inspect-my-task-1-")
    (tmp_path / "a").write_text("two")  # another context: another image name
    await DSecSandboxEnvironment.task_init("other", config)
    assert fake.calls[1]["name"] != call["name"].replace("my-task-1", "other")
    for task in ("My Task/1", "other"):
        state = DSecSandboxEnvironment._tasks.pop((task, provider._config_key(config)))
        assert state.image.startswith("inspect-")


async def test_dockerfile_config_without_builder_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.integrations import _provider_base as base

    (tmp_path / "Dockerfile").write_text("FROM busybox\n")

    async def acquire(url: Any, key: Any) -> Any:
        return object()

    async def release(client: Any) -> None:
        return None

    monkeypatch.setattr(base, "acquire_client", acquire)
    monkeypatch.setattr(base, "release_client", release)
    with pytest.raises(dsec.InvalidArgument, match="build_image") as info:
        await DSecSandboxEnvironment.task_init("t", str(tmp_path / "Dockerfile"))
    assert info.value.field == "image"


# --- lifecycle on a real dsec up ----------------------------------------------


async def test_lifecycle_never_leaks_a_sandbox(cluster: Cluster) -> None:
    task = unique("task")
    config = _config(cluster)
    await DSecSandboxEnvironment.task_init(task, config)
    first = await DSecSandboxEnvironment.sample_init(task, config, {"k": "v"})
    second = await DSecSandboxEnvironment.sample_init(task, config, {})
    assert list(first) == ["default"]
    a, b = first["default"], second["default"]
    assert a.sandbox_id != b.sandbox_id
    async with dsec.DSecClient(cluster.url, cluster.admin_key) as client:
        labelled = await client.list_sandboxes(labels={"dsec-provider": "inspect_ai", "inspect-task": task})
        assert {s.id for s in labelled} == {a.sandbox_id, b.sandbox_id}
        await DSecSandboxEnvironment.sample_cleanup(task, config, dict(first), True)
        assert (await client.get_sandbox(a.sandbox_id)).info.state == "stopped"  # type: ignore[union-attr]
        # the second sample was never cleaned up: task_cleanup stops it
        await DSecSandboxEnvironment.task_cleanup(task, config, True)
        assert (await client.get_sandbox(b.sandbox_id)).info.state == "stopped"  # type: ignore[union-attr]
    with pytest.raises(SandboxUnavailableError):
        await b.exec(["true"])


async def test_concurrent_samples_share_one_task_state(cluster: Cluster) -> None:
    import asyncio

    task = unique("task")
    config = _config(cluster)
    # no task_init: the samples race to set the task up, and task_cleanup still finds them all
    results = await asyncio.gather(*(DSecSandboxEnvironment.sample_init(task, config, {}) for _ in range(3)))
    ids = {r["default"].sandbox_id for r in results}
    assert len(ids) == 3
    await DSecSandboxEnvironment.task_cleanup(task, config, True)
    async with dsec.DSecClient(cluster.url, cluster.admin_key) as client:
        for sandbox_id in ids:
            assert (await client.get_sandbox(sandbox_id)).info.state == "stopped"  # type: ignore[union-attr]


async def test_cli_cleanup_and_connection(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", cluster.url)
    monkeypatch.setenv("DSEC_API_KEY", cluster.admin_key)
    task = unique("task")
    config = _config(cluster)
    envs = await DSecSandboxEnvironment.sample_init(task, config, {})
    env = envs["default"]
    conn = await env.connection(user="root")
    assert conn.type == "dsec" and conn.command == f"dsec sandbox shell {env.sandbox_id} --user root"
    await DSecSandboxEnvironment.cli_cleanup(env.sandbox_id)
    async with dsec.DSecClient(cluster.url, cluster.admin_key) as client:
        assert (await client.get_sandbox(env.sandbox_id)).info.state == "stopped"  # type: ignore[union-attr]
    await DSecSandboxEnvironment.task_cleanup(task, config, True)


# --- exec ---------------------------------------------------------------------


async def test_exec_output_and_status(env: DSecSandboxEnvironment) -> None:
    r = await env.exec(["sh", "-c", "echo foo; echo bar; echo baz >&2; exit 70"])
    assert (r.stdout, r.stderr, r.returncode, r.success) == ("foo\nbar\n", "baz\n", 70, False)
    ok = await env.exec(["true"])
    assert ok.success and ok.returncode == 0
    text = "café résumé €100 中文 😀"
    octal = "".join(f"\\{b:03o}" for b in text.encode())
    assert (await env.exec(["sh", "-c", f"printf '{octal}'"])).stdout == text
    assert (await env.exec(["sh", "-c", f"printf '{octal}' >&2"])).stderr == text
    # dying of a signal fast is not a timeout
    assert (await env.exec(["sh", "-c", "kill -TERM $$"], timeout=30)).returncode == 143


async def test_exec_timeout_kills_the_tree(env: DSecSandboxEnvironment) -> None:
    marker = unique("mark")
    with pytest.raises(TimeoutError):
        await env.exec(["sh", "-c", f"sleep 30 # {marker}-child & sleep 30 # {marker}-parent"], timeout=1)
    with pytest.raises(TimeoutError):
        await env.exec(["sh", "-c", "sleep 30; :"], input="x", timeout=1)
    ps = await env.exec(["sh", "-c", f"ps | grep {marker} | grep -v grep"])
    assert ps.stdout.strip() == ""


async def test_exec_errors(env: DSecSandboxEnvironment) -> None:
    with pytest.raises(PermissionError):
        await env.exec(["/etc/passwd"])
    missing = await env.exec(["no-such-program"])
    assert not missing.success and "no-such-program" in missing.stderr
    nobody = await env.exec(["whoami"], user="nonexistent")
    assert not nobody.success and "nonexistent" in nobody.stderr
    no_dir = await env.exec(["ls"], cwd="/no/such/dir")
    assert not no_dir.success and "/no/such/dir" in no_dir.stderr
    with pytest.raises(ValueError):
        await env.exec([])
    with pytest.raises(ValueError):
        await env.exec("echo hi")  # type: ignore[arg-type]


async def test_exec_env_user_cwd(env: DSecSandboxEnvironment) -> None:
    r = await env.exec(["sh", "-c", 'echo "$A"; echo "$B"'], env={"A": "chonko zamboodle", "B": "$(x)"})
    assert r.stdout == "chonko zamboodle\n$(x)\n"
    assert (await env.exec(["whoami"], user="root")).stdout == "root\n"
    assert (await env.exec(["whoami"], user="1000", cwd="/tmp")).stdout.strip() == "user"
    # the workdir is root's home, which another user cannot enter: without a cwd the command
    # starts where the sandbox starts that user; with it, the command says it cannot
    assert (await env.exec(["whoami"], user="1000")).stdout.strip() == "user"
    denied = await env.exec(["whoami"], user="1000", cwd=".")
    assert not denied.success and "EACCES" in denied.stderr
    await env.write_file("here.txt", "x")
    assert "here.txt" in (await env.exec(["ls", "-1"])).stdout
    assert (await env.exec(["pwd"])).stdout.strip() == env.workdir
    await env.exec(["mkdir", "-p", "sub"])
    await env.write_file("sub/in-sub.txt", "x")
    assert (await env.exec(["ls"], cwd="sub")).stdout.strip() == "in-sub.txt"
    assert "busybox" in (await env.exec(["ls"], cwd="/bin")).stdout.split()


async def test_exec_input(env: DSecSandboxEnvironment) -> None:
    special = "$HOME `whoami` 'single' \"double\" \\backslash\nnewline\n"
    assert (await env.exec(["cat"], input=special)).stdout == special
    empty = await env.exec(["cat"], input="")
    assert empty.success and empty.stdout == ""
    payload = b"\xc3\x28\x00\xff\x01\x02bytes"
    assert (await env.exec(["sh", "-c", "cat > bin.out"], input=payload)).success
    assert await env.read_file("bin.out", text=False) == payload
    big = 8 * 1024 * 1024
    assert (await env.exec(["wc", "-c"], input="a" * big)).stdout.split()[0] == str(big)
    # a command that reads none of its stdin still answers
    assert (await env.exec(["true"], input="ignored" * 100_000)).success
    # argv travels in the request body, which the apiserver bounds at 1 MiB
    chunk = "x" * (64 * 1024)
    assert (await env.exec(["printf", "%s", *([chunk] * 12)])).stdout == chunk * 12
    with pytest.raises(dsec.PayloadTooLarge):
        await env.exec(["printf", "%s", *([chunk] * 17)])


async def test_exec_output_limit(env: DSecSandboxEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", "1024")
    with pytest.raises(OutputLimitExceededError) as info:
        await env.exec(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' a"])
    assert "limit of 1 KiB was exceeded" in str(info.value)
    assert info.value.truncated_output is not None and len(info.value.truncated_output) <= 1024
    assert (await env.exec(["sh", "-c", "head -c 1024 /dev/zero | tr '\\0' a"])).stdout == "a" * 1024


# --- files --------------------------------------------------------------------


async def test_files_round_trip(env: DSecSandboxEnvironment) -> None:
    await env.write_file("t.txt", "one\r\ntwo\n")
    assert await env.read_file("t.txt") == "one\r\ntwo\n"  # newlines kept as written
    await env.write_file("t.txt", "altered")
    assert await env.read_file("t.txt", text=True) == "altered"
    await env.write_file("b.bin", b"\xc3\x28")
    assert await env.read_file("b.bin", text=False) == b"\xc3\x28"
    await env.write_file("file with space.file", "")
    assert await env.read_file("file with space.file") == ""
    assert await env.read_file("file with space.file", text=False) == b""
    await env.write_file("/tmp/deep/er/x.txt", "parents made")
    assert await env.read_file("/tmp/deep/er/x.txt") == "parents made"
    await env.write_file("rel/dir/y.txt", "relative")
    assert (await env.exec(["cat", f"{env.workdir}/rel/dir/y.txt"])).stdout == "relative"
    big = bytes(range(256)) * 8192
    await env.write_file("big.bin", big)
    assert await env.read_file("big.bin", text=False) == big
    with pytest.raises(UnicodeDecodeError):
        await env.read_file("b.bin", text=True)


async def test_file_errors(env: DSecSandboxEnvironment) -> None:
    name = "https:/en.wikipedia.org/wiki/Bart%C5%82omiej"
    with pytest.raises(FileNotFoundError) as missing:
        await env.read_file(name)
    assert "wikipedia" in str(missing.value)
    with pytest.raises(IsADirectoryError) as is_dir:
        await env.read_file("/etc")
    assert "directory" in str(is_dir.value)
    await env.exec(["mkfifo", "/tmp/a-fifo"])  # reading a fifo would block: refused instead
    await env.exec(["ln", "-s", "/tmp/a-fifo", "/tmp/fifo-link"])
    await env.exec(["ln", "-s", "/etc", "/tmp/dir-link"])
    await env.exec(["ln", "-s", "/nowhere", "/tmp/dangling"])
    for special in ("/tmp/a-fifo", "/tmp/fifo-link"):
        with pytest.raises(OSError) as not_regular:
            await env.read_file(special)
        assert "not a regular file" in str(not_regular.value)
    with pytest.raises(IsADirectoryError):
        await env.read_file("/tmp/dir-link")
    with pytest.raises(FileNotFoundError):
        await env.read_file("/tmp/dangling")
    await env.write_file("/tmp/a-dir/file", "x")
    for contents in ("text", b"\xc3\x28"):
        with pytest.raises(IsADirectoryError) as write_dir:
            await env.write_file("/tmp/a-dir", contents)
        assert "directory" in str(write_dir.value)


async def test_file_permissions(cluster: Cluster) -> None:
    task = unique("task")
    config = _config(cluster, user="1000", workdir="/tmp/work")
    env = (await DSecSandboxEnvironment.sample_init(task, config, {}))["default"]
    try:
        assert (await env.exec(["whoami"])).stdout.strip() == "user"
        await env.write_file("mine.txt", "mine")
        await env.exec(["sh", "-c", "echo secret > /tmp/root-only; chmod 600 /tmp/root-only"], user="root")
        with pytest.raises(PermissionError) as read_denied:
            await env.read_file("/tmp/root-only")
        assert "root-only" in str(read_denied.value)
        await env.exec(["chmod", "a-w", "mine.txt"])  # a read-only file in a writable directory
        with pytest.raises(PermissionError) as read_only:
            await env.write_file("mine.txt", "changed")
        assert "mine.txt" in str(read_only.value)
        await env.exec(["chmod", "u+w", "mine.txt"])
        await env.write_file("mine.txt", "changed")
        assert await env.read_file("mine.txt") == "changed"
        await env.exec(["mkdir", "-p", "-m", "755", "/srv/ro"], user="root")
        with pytest.raises(PermissionError) as write_denied:
            await env.write_file("/srv/ro/f.txt", "nope")
        assert "f.txt" in str(write_denied.value)
    finally:
        await DSecSandboxEnvironment.sample_cleanup(task, config, {"default": env}, False)
        await DSecSandboxEnvironment.task_cleanup(task, config, True)


async def test_read_limit_bounds_the_transfer(env: DSecSandboxEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    await env.write_file("large.file", "a" * 2048)
    await env.exec(["ln", "-s", "large.file", "link.file"])
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", "1024")
    for name in ("large.file", "link.file"):  # a symlink's stat says nothing of the size
        with pytest.raises(OutputLimitExceededError) as info:
            await env.read_file(name)
        assert "limit of 1 KiB was exceeded" in str(info.value)
        assert info.value.truncated_output is None


async def test_paths_stay_in_the_sandbox(env: DSecSandboxEnvironment) -> None:
    inside = (await env.exec(["cat", "/etc/passwd"])).stdout
    assert await env.read_file("../../../../../../etc/passwd") == inside
    await env.exec(["ln", "-s", "/", "/tmp/root-link"])
    assert await env.read_file("/tmp/root-link/etc/passwd") == inside
    with pytest.raises(dsec.InvalidArgument):
        await env.read_file("nul\0byte")

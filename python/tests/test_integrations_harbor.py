"""``dsec.integrations.harbor:DSecEnvironment`` against Harbor's ``BaseEnvironment`` contract.

The contract is ``src/harbor/environments/base.py`` of LegoX/harbor at commit
73fd120e731217b38f31667932ea26a28cdd4fff (a fork of laude-institute/harbor, which could not be
fetched here) and the behaviour of its Docker environment (``bash -c``, ``RuntimeError`` on a
timeout, ``docker cp`` semantics for uploads). Commands and files run on a real ``dsec up``;
the Dockerfile build goes to a recording client (the builder API is another change's), the
sandbox it starts is real.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional

import pytest

import dsec
from dsec.integrations import _provider_base as base
from dsec.integrations import harbor as provider
from dsec.integrations.harbor import DSecEnvironment

from .conftest import Cluster, unique


@dataclass
class TaskEnv:
    """The fields of Harbor's task ``EnvironmentConfig`` the provider reads."""

    cpus: int = 1
    memory_mb: int = 256
    storage_mb: Optional[int] = None
    gpus: int = 0
    allow_internet: bool = False
    docker_image: Optional[str] = None
    build_timeout_sec: float = 600.0
    env: Dict[str, str] = field(default_factory=dict)


def _make(cluster: Cluster, tmp_path: Path, **kwargs: Any) -> DSecEnvironment:
    env_dir = tmp_path / "environment"
    env_dir.mkdir(exist_ok=True)
    task_env = kwargs.pop("task_env", None) or TaskEnv()
    kwargs.setdefault("image", "busybox")
    return DSecEnvironment(
        environment_dir=env_dir,
        environment_name="hello-world",
        session_id=unique("hello-world__trial"),
        trial_paths=None,
        task_env_config=task_env,
        url=cluster.url,
        api_key=cluster.admin_key,
        shell="sh",
        ttl_seconds=600,
        **kwargs,
    )


@pytest.fixture
async def env(cluster: Cluster, tmp_path: Path) -> AsyncIterator[DSecEnvironment]:
    e = _make(cluster, tmp_path, task_env=TaskEnv(env={"TASK_VAR": "from-task"}))
    await e.start(force_build=False)
    yield e
    await e.stop(delete=True)


# --- the interface as the pinned commit defines it ---------------------------


def test_signatures_match_harbor() -> None:
    def names(fn: Any) -> List[str]:
        return list(inspect.signature(fn).parameters)

    assert names(DSecEnvironment.__init__)[:6] == [
        "self",
        "environment_dir",
        "environment_name",
        "session_id",
        "trial_paths",
        "task_env_config",
    ]
    assert names(DSecEnvironment.exec) == ["self", "command", "cwd", "env", "timeout_sec", "user"]
    assert names(DSecEnvironment.start) == ["self", "force_build"]
    assert names(DSecEnvironment.stop) == ["self", "delete"]
    assert names(DSecEnvironment.upload_file) == ["self", "source_path", "target_path"]
    assert names(DSecEnvironment.upload_dir) == ["self", "source_dir", "target_dir"]
    assert names(DSecEnvironment.download_file) == ["self", "source_path", "target_path"]
    assert names(DSecEnvironment.download_dir) == ["self", "source_dir", "target_dir"]
    assert names(DSecEnvironment.is_dir) == ["self", "path", "user"]
    assert names(DSecEnvironment.is_file) == ["self", "path", "user"]
    for name in ("exec", "start", "stop", "upload_file", "upload_dir", "download_file", "download_dir"):
        assert inspect.iscoroutinefunction(getattr(DSecEnvironment, name)), name
    assert isinstance(inspect.getattr_static(DSecEnvironment, "type"), staticmethod)
    assert DSecEnvironment.type().value == "dsec"
    for prop in ("is_mounted", "supports_gpus", "can_disable_internet"):
        assert isinstance(inspect.getattr_static(DSecEnvironment, prop), property), prop


def test_import_path_resolves() -> None:
    import importlib

    module, _, cls = "dsec.integrations.harbor:DSecEnvironment".partition(":")
    assert getattr(importlib.import_module(module), cls) is DSecEnvironment
    import subprocess

    probe = (
        "import sys, dsec.integrations.harbor as p; "
        "assert 'dsec.integrations.inspect_ai' not in sys.modules; "
        "print(p.HAVE_HARBOR, 'harbor' in sys.modules)"
    )
    repo_python = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo_python, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == out[1] and provider.HAVE_HARBOR == (out[0] == "True")


def test_definition_and_kwargs_are_checked(tmp_path: Path) -> None:
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    common = dict(environment_dir=env_dir, environment_name="t", session_id="s", trial_paths=None)
    with pytest.raises(FileNotFoundError, match="Dockerfile"):
        DSecEnvironment(task_env_config=TaskEnv(), **common)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="GPU"):
        DSecEnvironment(task_env_config=TaskEnv(gpus=1), image="busybox", **common)  # type: ignore[arg-type]
    for bad in ({"ttl_seconds": 0}, {"max_output_bytes": 1 << 40}, {"shell": ""}):
        with pytest.raises(dsec.InvalidArgument):
            DSecEnvironment(task_env_config=TaskEnv(), image="busybox", **common, **bad)  # type: ignore[arg-type]
    # a task image or a Dockerfile is a definition too
    DSecEnvironment(task_env_config=TaskEnv(docker_image="debian:bookworm"), **common)  # type: ignore[arg-type]
    (env_dir / "Dockerfile").write_text("FROM busybox\n")
    assert DSecEnvironment(task_env_config=TaskEnv(), **common).is_mounted is False  # type: ignore[arg-type]


async def test_not_started_is_an_error(tmp_path: Path) -> None:
    e = DSecEnvironment(tmp_path, "t", "s", None, TaskEnv(), image="busybox")
    with pytest.raises(RuntimeError, match="not started"):
        await e.exec("true")
    await e.stop(delete=True)  # stopping what never started is fine


# --- the Dockerfile path, through a recording builder -------------------------


class RecordingClient:
    """A real client whose ``build_image`` records the call and answers ``busybox``."""

    def __init__(self, real: dsec.DSecClient) -> None:
        self._real = real
        self.builds: List[Dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def build_image(self, context_dir: str, *, name: str, dockerfile: str, timeout: Any = None) -> str:
        files = sorted(p.relative_to(context_dir).as_posix() for p in Path(context_dir).rglob("*"))
        dockerfile_text = (Path(context_dir) / dockerfile).read_text()
        self.builds.append(
            {"name": name, "dockerfile": dockerfile, "files": files, "text": dockerfile_text, "timeout": timeout}
        )
        return "busybox"


@pytest.fixture
async def recording(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RecordingClient]:
    real = dsec.DSecClient(cluster.url, cluster.admin_key)
    await real.open()
    rec = RecordingClient(real)

    async def acquire(url: Any, key: Any) -> Any:
        return rec

    async def release(client: Any) -> None:
        return None

    monkeypatch.setattr(base, "acquire_client", acquire)
    monkeypatch.setattr(base, "release_client", release)
    yield rec
    await real.close()


async def test_builds_the_task_dockerfile(cluster: Cluster, tmp_path: Path, recording: RecordingClient) -> None:
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    (env_dir / "Dockerfile").write_text("FROM debian:bookworm\nCOPY app.py /app/app.py\n")
    (env_dir / "app.py").write_text("print('hi')\n")
    e = DSecEnvironment(env_dir, "Hello World", unique("s"), None, TaskEnv(build_timeout_sec=123), shell="sh")
    await e.start(force_build=False)
    try:
        assert e.image == "busybox" and e.sandbox_id is not None
        (build,) = recording.builds
        assert build["name"].startswith("harbor-hello-world-") and build["dockerfile"] == "Dockerfile"
        assert build["files"] == ["Dockerfile", "app.py"] and build["timeout"] == 123
        assert (await e.exec("echo ok")).stdout == "ok\n"
    finally:
        await e.stop(delete=True)
    # the same context is the same image name; a changed one is another
    again = DSecEnvironment(env_dir, "Hello World", unique("s"), None, TaskEnv(), shell="sh")
    await again.start(force_build=True)
    await again.stop(delete=True)
    (env_dir / "app.py").write_text("print('changed')\n")
    changed = DSecEnvironment(env_dir, "Hello World", unique("s"), None, TaskEnv(), shell="sh")
    await changed.start(force_build=False)
    await changed.stop(delete=True)
    names = [b["name"] for b in recording.builds]
    assert names[0] == names[1] != names[2]


async def test_task_docker_image_is_built_as_from(cluster: Cluster, tmp_path: Path, recording: RecordingClient) -> None:
    e = DSecEnvironment(tmp_path, "img", unique("s"), None, TaskEnv(docker_image="ghcr.io/org/img:1"), shell="sh")
    await e.start(force_build=False)
    await e.stop(delete=True)
    assert recording.builds[0]["text"] == "FROM ghcr.io/org/img:1\n"
    bad = DSecEnvironment(tmp_path, "img", unique("s"), None, TaskEnv(docker_image="x\nRUN evil"), shell="sh")
    with pytest.raises(dsec.InvalidArgument):
        await bad.start(force_build=False)
    assert bad.sandbox_id is None


# --- lifecycle and commands on a real dsec up -----------------------------------


async def test_start_stop_never_leaks(cluster: Cluster, tmp_path: Path) -> None:
    e = _make(cluster, tmp_path, task_env=TaskEnv(cpus=1, memory_mb=300))
    await e.start(force_build=False)
    sandbox_id = e.sandbox_id
    assert sandbox_id is not None
    with pytest.raises(RuntimeError, match="already started"):
        await e.start(force_build=False)
    async with dsec.DSecClient(cluster.url, cluster.admin_key) as client:
        info = (await client.get_sandbox(sandbox_id)).info
        assert info is not None and info.spec.memory_limit_mb == 300
        mine = await client.list_sandboxes(labels={"dsec-provider": "harbor", "harbor-session": e.session_id})
        assert [s.id for s in mine] == [sandbox_id]
        for d in provider.LOGS_DIRS:
            assert await e.is_dir(d)
        await e.stop(delete=True)
        assert (await client.get_sandbox(sandbox_id)).info.state == "stopped"  # type: ignore[union-attr]
    await e.stop(delete=True)


async def test_exec(env: DSecEnvironment) -> None:
    r = await env.exec("echo out; echo err >&2; exit 3")
    assert (r.return_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert (await env.exec("true")).stdout is None  # empty output is None, as Harbor's Docker env
    assert (await env.exec('echo "$TASK_VAR $X"', env={"X": "per-exec"})).stdout == "from-task per-exec\n"
    assert (await env.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
    assert (await env.exec("whoami", user=1000)).stdout == "user\n"
    with env.with_default_user("1000") if hasattr(env, "with_default_user") else _default_user(env, "1000"):
        assert (await env.exec("whoami", cwd="/tmp")).stdout == "user\n"
    assert (await env.exec("whoami")).stdout == "root\n"
    with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
        await env.exec("sleep 30", timeout_sec=1)
    nobody = await env.exec("true", user="nonexistent")
    assert nobody.return_code != 0 and "nonexistent" in (nobody.stderr or "")
    no_dir = await env.exec("true", cwd="/no/such")
    assert no_dir.return_code != 0 and "/no/such" in (no_dir.stderr or "")


class _default_user:
    """``with_default_user`` for the plain class (Harbor's base has it in newer commits)."""

    def __init__(self, env: DSecEnvironment, user: str) -> None:
        self.env, self.user = env, user

    def __enter__(self) -> None:
        self.prev = self.env.default_user
        self.env.default_user = self.user

    def __exit__(self, *exc: object) -> None:
        self.env.default_user = self.prev


async def test_missing_shell_is_a_failed_result(cluster: Cluster, tmp_path: Path) -> None:
    e = _make(cluster, tmp_path)
    e._shell = "bash"  # busybox has no bash
    await e.start(force_build=False)
    try:
        r = await e.exec("echo hi")
        assert r.return_code == 127 and "bash" in (r.stderr or "")
    finally:
        await e.stop(delete=True)


# --- files ------------------------------------------------------------------------


async def test_upload_and_download(env: DSecEnvironment, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "tests" / "deep").mkdir(parents=True)
    (src / "tests" / "test.sh").write_text("#!/bin/sh\necho ok\n")
    (src / "tests" / "test.sh").chmod(0o755)
    (src / "tests" / "deep" / "data.bin").write_bytes(bytes(range(256)) * 100)
    (src / "top.txt").write_text("top")
    os.symlink("/etc/passwd", src / "link-out")  # not copied: the files API makes no links
    await env.upload_dir(src, "/work/in")
    assert (await env.exec("/work/in/tests/test.sh")).stdout == "ok\n"
    assert await env.is_file("/work/in/tests/deep/data.bin")
    assert not await env.is_file("/work/in/link-out")
    await env.upload_file(src / "top.txt", "/work/single/renamed.txt")
    await env.upload_file(src / "top.txt", "/work/single")  # into an existing directory
    assert (await env.exec("cat /work/single/renamed.txt /work/single/top.txt")).stdout == "toptop"
    out = tmp_path / "out"
    await env.download_dir("/work/in", out)
    assert (out / "tests" / "test.sh").read_text() == "#!/bin/sh\necho ok\n"
    assert (out / "tests" / "deep" / "data.bin").read_bytes() == bytes(range(256)) * 100
    assert not (out / "link-out").exists()
    await env.download_file("/work/single/top.txt", tmp_path / "one" / "two" / "top.txt")
    assert (tmp_path / "one" / "two" / "top.txt").read_text() == "top"
    with pytest.raises(FileNotFoundError):
        await env.download_dir("/no/such/dir", tmp_path / "x")
    await env.exec("mkfifo /work/fifo && ln -s /work/fifo /work/fifo-link")
    for special in ("/work/fifo", "/work/fifo-link", "/no/such/file"):  # never a blocking read
        with pytest.raises(FileNotFoundError):
            await env.download_file(special, tmp_path / "special")
    with pytest.raises(FileNotFoundError):
        await env.upload_file(tmp_path / "absent", "/work/x")


async def test_download_dir_never_follows_what_the_sandbox_made(env: DSecEnvironment, tmp_path: Path) -> None:
    # The sandbox writes links pointing at the host's paths, a fifo, and a directory named
    # like the host-side link planted below.
    await env.exec(
        "mkdir -p /logs/verifier/sub && echo reward > /logs/verifier/reward.txt"
        " && ln -s /etc /logs/verifier/etc-link && ln -s /etc/shadow /logs/verifier/shadow"
        " && mkfifo /logs/verifier/fifo && echo inside > /logs/verifier/sub/f.txt"
    )
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "verifier"
    target.mkdir()
    os.symlink(outside, target / "sub")  # a host-side link in the way is replaced, not followed
    await env.download_dir("/logs/verifier", target)
    assert (target / "reward.txt").read_text() == "reward\n"
    assert (target / "sub" / "f.txt").read_text() == "inside\n" and not (target / "sub").is_symlink()
    assert list(outside.iterdir()) == []
    for name in ("etc-link", "shadow", "fifo"):
        assert not os.path.lexists(target / name)


async def test_download_dir_is_bounded(env: DSecEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await env.exec("mkdir -p /many && cd /many && for i in 1 2 3 4 5 6; do echo $i > f$i; done")
    monkeypatch.setattr(base, "MAX_TREE_ENTRIES", 5)
    with pytest.raises(dsec.PayloadTooLarge):
        await env.download_dir("/many", tmp_path / "many")
    monkeypatch.setattr(base, "MAX_TREE_ENTRIES", 100)
    monkeypatch.setattr(base, "MAX_TREE_BYTES", 8)
    with pytest.raises(dsec.PayloadTooLarge):
        await env.download_dir("/many", tmp_path / "many2")
    await env.exec("mkdir -p /deep/a/b/c")
    monkeypatch.setattr(base, "MAX_TREE_DEPTH", 1)
    with pytest.raises(dsec.PayloadTooLarge):
        await env.download_dir("/deep", tmp_path / "deep")


# --- names and contexts a task author controls ------------------------------------


def test_names_a_task_picks_are_sanitised() -> None:
    import re

    value = re.compile(r"^[A-Za-z0-9._:/-]{0,63}$")
    for raw in ("hello-world__abc", "a" * 300, "../../etc\n;rm -rf /", "naïve task", ""):
        assert value.match(base.label_value(raw)), raw
    # long names keep a digest: two that share a prefix do not collide
    assert base.label_value("x" * 100 + "1") != base.label_value("x" * 100 + "2")
    assert base.label_value("plain-name") == "plain-name"
    image = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
    for raw in ("Hello World", "../../x", "UPPER/and/slashes", "-._", "é" * 80):
        name = base.image_name("harbor", raw, "0123456789abcdef")
        assert image.match(name) and len(name) <= 64 and name.endswith("-0123456789ab"), name


def test_context_digest_is_bounded_and_never_follows_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "Dockerfile").write_text("FROM busybox\n")
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_text("one")
    os.symlink(secret, tmp_path / "link")
    first = base.context_digest(tmp_path, "Dockerfile")
    secret.write_text("two")  # the link's target is not part of the context
    assert base.context_digest(tmp_path, "Dockerfile") == first
    (tmp_path / "link").unlink()
    os.symlink("/elsewhere", tmp_path / "link")  # the link's text is
    assert base.context_digest(tmp_path, "Dockerfile") != first
    secret.unlink()
    with pytest.raises(dsec.InvalidArgument, match="no Dockerfile"):
        base.context_digest(tmp_path, "Missing.Dockerfile")
    monkeypatch.setattr(base, "MAX_CONTEXT_FILES", 1)
    with pytest.raises(dsec.InvalidArgument, match="files"):
        base.context_digest(tmp_path, "Dockerfile")
    monkeypatch.setattr(base, "MAX_CONTEXT_FILES", 100)
    monkeypatch.setattr(base, "MAX_CONTEXT_BYTES", 4)
    with pytest.raises(dsec.InvalidArgument, match="larger"):
        base.context_digest(tmp_path, "Dockerfile")


async def test_hostile_session_and_environment_names(cluster: Cluster, tmp_path: Path) -> None:
    e = DSecEnvironment(
        tmp_path,
        "../../etc;" + "n" * 200,
        "s\n" + "x" * 300,
        None,
        TaskEnv(),
        url=cluster.url,
        api_key=cluster.admin_key,
        image="busybox",
        shell="sh",
        ttl_seconds=600,
    )
    await e.start(force_build=False)
    try:
        assert (await e.exec("echo ok")).stdout == "ok\n"
    finally:
        await e.stop(delete=True)

"""dsec.eval — SWE-style rollouts from an RL trainer, graded by their tests.

A trainer hands each task to its own agent (an async callback that acts on
a sandbox through a :class:`Rollout`) and gets a reward back::

    from dsec.eval import EvalRunner

    async def agent(rollout):
        source = await rollout.read_file("lib/calc.py")
        await rollout.edit_file("lib/calc.py", "a - b", "a + b")
        result = await rollout.shell("python3 -m pytest -q")
        return {"exit": result.exit_code}          # kept as ``agent_output``

    runner = EvalRunner("examples/swe-tasks/tasks.jsonl", labels={"job": "rl-step-7"})
    results = await runner.run_batch(agent, concurrency=8)
    rewards = {r.instance_id: r.reward for r in results}

The Python side stays a thin client of ``dsec eval`` (packages/eval): it
creates the sandbox from the layers ``dsec eval prepare`` reports, runs the
callback, and asks ``dsec eval grade`` for the reward. Grading (taking the
agent's work as a patch and applying it to a fresh sandbox of the task's
environment, without test files or files that steer the test runner;
applying ``test_patch`` from the repository at ``base_commit``, running
``test_command``, parsing pytest/TAP/unittest/go output, SWE-bench's
reward) exists once, in TypeScript, so a reward means the same whether the
batch ran from ``dsec eval run`` or from here. What is repeated here is
small: the request-ID scheme (so grading and the agent's steps share one
command log without collisions) and the file tools, which go through
commands with request IDs like the TypeScript agents' do.

``run_cli`` runs a whole batch with a built-in agent (``gold``, ``none``,
``http``) through ``dsec eval run`` and returns its result lines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import re
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence

from ._async import DSecClient, Sandbox
from .errors import DSecError, InvalidArgument
from .models import CommandResult, DSecContainerRunArgs

__all__ = [
    "EvalResult",
    "EvalRunner",
    "PreparedTask",
    "Rollout",
    "ToolError",
    "request_prefix",
    "run_cli",
]

#: Characters of a file the tools read or write (a command's stdin/stdout).
MAX_FILE_BYTES = 900 * 1024
_READ_CAP_BYTES = 16 * 1024 * 1024
_FILE_TIMEOUT = 60.0


class ToolError(Exception):
    """A tool call the sandbox refused for a reason the agent can act on
    (no such file, the old text is not unique). Platform failures stay
    :class:`dsec.DSecError`."""


def request_prefix(run_id: str, instance_id: str, attempt: int = 1) -> str:
    """``ev.<run>.<instance>.<attempt>``: the prefix of every request ID of one
    task's attempt, the same scheme as packages/eval's ``RequestIds``."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", instance_id)
    if clean != instance_id or len(clean) > 64:
        digest = hashlib.sha256(instance_id.encode()).hexdigest()[:10]
        clean = f"{clean[:52]}-{digest}"
    return f"ev.{run_id}.{clean}.{attempt}"


@dataclass(frozen=True)
class PreparedTask:
    """The layers a task's sandbox is made of (``dsec eval prepare --json``)."""

    instance_id: str
    image: str
    toolkits: List[str]
    workspace: str
    workdir: str


@dataclass
class EvalResult:
    """One rollout's outcome. ``reward`` is 1 or 0, or ``None`` when the
    harness failed (``error`` says why), which is not a 0."""

    instance_id: str
    reward: Optional[int]
    tests: Dict[str, str] = field(default_factory=dict)
    #: FAIL_TO_PASS / PASS_TO_PASS tests that did not pass.
    failing: List[str] = field(default_factory=list)
    tool_calls: int = 0
    sandbox_id: Optional[str] = None
    #: The fresh sandbox the tests ran in (``None`` for tasks graded in place).
    grading_sandbox_id: Optional[str] = None
    #: What the grader carried from the agent's sandbox: ``diff``, ``files``,
    #: ``leftOut`` (path, rule, reason), … as ``dsec eval grade`` reports it.
    agent_patch: Optional[Dict[str, Any]] = None
    #: ``setup``, ``agent``, ``grading`` and ``total``, in seconds.
    durations: Dict[str, float] = field(default_factory=dict)
    #: Whatever the agent callback returned.
    agent_output: Any = None
    error: Optional[Dict[str, str]] = None
    run_id: str = ""


class Rollout:
    """What an agent callback acts through: the task, its sandbox, and tools
    whose every command carries a request ID derived from (run, instance,
    step), so a retried call never runs twice."""

    def __init__(self, task: Mapping[str, Any], sandbox: Sandbox, prefix: str, workdir: str) -> None:
        #: The task line as the task file has it (``problem_statement``, …).
        self.task = dict(task)
        self.sandbox = sandbox
        self.workdir = workdir
        #: Tool calls made so far.
        self.tool_calls = 0
        self._prefix = prefix
        self._step = 0

    def _next(self, part: str = "") -> str:
        self.tool_calls += 1
        self._step += 1
        return self._rid(part)

    def _rid(self, part: str = "") -> str:
        return f"{self._prefix}:a{self._step}{'.' + part if part else ''}"

    def resolve(self, path: str) -> str:
        """``path`` in the sandbox: relative ones are under the repository."""
        return posixpath.normpath(posixpath.join(self.workdir, path))

    async def shell(self, line: str, *, timeout: float = 120.0) -> CommandResult:
        """Runs a line in the task's shell session (cwd and variables persist)."""
        rid = self._next()
        session = self.sandbox.session("agent", cwd=self.workdir)
        return await session.run(line, timeout=timeout, request_id=rid)

    async def read_file(self, path: str) -> Optional[str]:
        """A text file's content, ``None`` when it does not exist."""
        return await self._read(self.resolve(path), self._next())

    async def write_file(self, path: str, content: str, *, mode: Optional[int] = None) -> None:
        """Creates or replaces a file, making parent directories."""
        await self._write(self.resolve(path), content, mode, self._next())

    async def edit_file(self, path: str, old: str, new: str) -> None:
        """Replaces the one occurrence of ``old``; :class:`ToolError` unless there is exactly one."""
        read_id = self._next("read")
        abs_path = self.resolve(path)
        content = await self._read(abs_path, read_id)
        if content is None:
            raise ToolError(f"{path} does not exist")
        if old == "" or content.count(old) != 1:
            raise ToolError(f"the old text must occur exactly once in {path}")
        await self._write(abs_path, content.replace(old, new, 1), None, self._rid("write"))

    async def _read(self, abs_path: str, rid: str) -> Optional[str]:
        r = await self.sandbox.commands.run(
            '[ -e "$P" ] || exit 10; [ -d "$P" ] && exit 11; exec cat -- "$P"',
            env={"P": abs_path},
            request_id=rid,
            timeout=_FILE_TIMEOUT,
            max_output_bytes=_READ_CAP_BYTES,
        )
        if r.exit_code == 10:
            return None
        if r.exit_code != 0 or r.truncated:
            raise ToolError(f"cannot read {abs_path}: exit {r.exit_code}: {r.stderr.strip()}")
        return r.stdout

    async def _write(self, abs_path: str, content: str, mode: Optional[int], rid: str) -> None:
        if len(content.encode()) > MAX_FILE_BYTES:
            raise ToolError(f"{abs_path}: the tools write files up to {MAX_FILE_BYTES} bytes")
        chmod = "" if mode is None else f' && chmod {mode & 0o7777:o} "$P"'
        r = await self.sandbox.commands.run(
            f'mkdir -p -- "$(dirname -- "$P")" && cat > "$P"{chmod}',
            env={"P": abs_path},
            stdin=content,
            request_id=rid,
            timeout=_FILE_TIMEOUT,
        )
        if r.exit_code != 0:
            raise ToolError(f"cannot write {abs_path}: exit {r.exit_code}: {r.stderr.strip()}")


Agent = Callable[[Rollout], Awaitable[Any]]


def _default_command() -> List[str]:
    return shlex.split(os.environ.get("DSEC_CLI", "dsec"))


class EvalRunner:
    """Runs tasks of a task file with a Python agent callback.

    ``dsec_command`` is how to start the CLI (default ``$DSEC_CLI`` or
    ``dsec``); ``state_dir`` is the node's (for ``prepare``, which builds
    layers into the local image store). ``url``/``api_key`` default to
    ``DSEC_URL``/``DSEC_API_KEY``, for the client and the CLI alike.
    """

    def __init__(
        self,
        tasks_file: str,
        *,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        run_id: Optional[str] = None,
        dsec_command: Optional[Sequence[str]] = None,
        dsec_cwd: Optional[str] = None,
        state_dir: Optional[str] = None,
        memory_limit_mb: Optional[int] = None,
        cpu_cores_limit: Optional[float] = None,
        ttl_seconds: int = 4 * 3600,
        test_timeout: Optional[float] = None,
    ) -> None:
        self.tasks_file = os.path.abspath(tasks_file)
        self.url = url or os.environ.get("DSEC_URL")
        self.api_key = api_key or os.environ.get("DSEC_API_KEY")
        self.run_id = run_id or secrets.token_hex(6)
        self.labels = dict(labels) if labels else {"job": f"eval-{self.run_id}"}
        self._command = list(dsec_command) if dsec_command else _default_command()
        self._cwd = dsec_cwd
        self._state_dir = state_dir
        self._limits = (memory_limit_mb, cpu_cores_limit, ttl_seconds)
        self._test_timeout = test_timeout
        self._client = DSecClient(url=self.url, api_key=self.api_key)
        self._prepared: Optional[Dict[str, PreparedTask]] = None
        self._tasks: Dict[str, Dict[str, Any]] = {}
        self._attempts: Dict[str, int] = {}
        with open(self.tasks_file, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    task = json.loads(line)
                    self._tasks[task["instance_id"]] = task

    @property
    def instance_ids(self) -> List[str]:
        return list(self._tasks)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "EvalRunner":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def prepare(self) -> Dict[str, PreparedTask]:
        """Builds what the tasks need (``dsec eval prepare``; idempotent) and
        returns each task's layers."""
        if self._prepared is None:
            report = await self._cli("eval", "prepare", self.tasks_file)
            self._prepared = {t["instance_id"]: PreparedTask(**t) for t in report["tasks"]}
        return self._prepared

    async def run_task(self, instance_id: str, agent: Agent) -> EvalResult:
        """One rollout: a fresh sandbox, ``agent(rollout)``, grading, stop.
        Harness failures land in ``error`` (reward ``None``); an exception
        raised by the agent itself is recorded the same way."""
        started = time.monotonic()
        durations: Dict[str, float] = {}
        result = EvalResult(instance_id=instance_id, reward=None, run_id=self.run_id, durations=durations)
        prepared = (await self.prepare()).get(instance_id)
        if prepared is None:
            raise InvalidArgument(f"{self.tasks_file} has no task {instance_id}", field="instance_id")
        # Each rollout of a task in this run is a new attempt: its own sandbox and request IDs.
        attempt = self._attempts.get(instance_id, 0) + 1
        self._attempts[instance_id] = attempt
        prefix = request_prefix(self.run_id, instance_id, attempt)
        memory, cpus, ttl = self._limits
        sandbox: Optional[Sandbox] = None
        rollout: Optional[Rollout] = None
        try:
            sandbox = await self._client.run_container(
                DSecContainerRunArgs(
                    container_image=prepared.image,
                    toolkits=prepared.toolkits,
                    workspace=prepared.workspace,
                    memory_limit_mb=memory,
                    cpu_cores_limit=cpus,
                    ttl_running_stop=ttl,
                    labels={
                        **self.labels,
                        "instance_id": instance_id,
                        "eval_run": self.run_id,
                        "eval_attempt": str(attempt),
                    },
                    request_id=f"{prefix}:create",
                )
            )
            result.sandbox_id = sandbox.id
            durations["setup"] = time.monotonic() - started
            rollout = Rollout(self._tasks[instance_id], sandbox, prefix, prepared.workdir)
            t1 = time.monotonic()
            result.agent_output = await agent(rollout)
            durations["agent"] = time.monotonic() - t1
            t2 = time.monotonic()
            args = ["eval", "grade", self.tasks_file, "--instance", instance_id]
            args += ["--sandbox", sandbox.id, "--run-id", self.run_id, "--attempt", str(attempt)]
            if self._test_timeout is not None:
                args += ["--test-timeout-ms", str(int(self._test_timeout * 1000))]
            graded = await self._cli(*args)
            durations["grading"] = time.monotonic() - t2
            result.reward = int(graded["reward"])
            result.tests = dict(graded["tests"])
            result.failing = list(graded["failing"])
            result.grading_sandbox_id = graded.get("gradingSandboxId")
            result.agent_patch = graded.get("agentPatch")
        except (DSecError, ToolError, _CliError) as err:
            code = getattr(err, "code", None) or ("tool_error" if isinstance(err, ToolError) else "cli_error")
            result.error = {"code": str(code), "message": str(err)}
        except Exception as err:  # the agent's own failure: recorded, the batch goes on
            result.error = {"code": "agent_error", "message": f"{type(err).__name__}: {err}"}
        finally:
            if rollout is not None:
                result.tool_calls = rollout.tool_calls
            if sandbox is not None:
                try:
                    await sandbox.stop()
                except DSecError:
                    pass
            durations["total"] = time.monotonic() - started
        return result

    async def run_batch(
        self,
        agent: Agent,
        instance_ids: Optional[Sequence[str]] = None,
        *,
        concurrency: int = 4,
    ) -> List[EvalResult]:
        """Runs tasks (default all) with at most ``concurrency`` in flight;
        results in the order of ``instance_ids``."""
        ids = list(instance_ids) if instance_ids is not None else self.instance_ids
        await self.prepare()
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(instance_id: str) -> EvalResult:
            async with gate:
                return await self.run_task(instance_id, agent)

        return list(await asyncio.gather(*(one(i) for i in ids)))

    async def _cli(self, *args: str) -> Any:
        return await _run_cli_json(self._command, self._global_args(), list(args), self._env(), self._cwd)

    def _global_args(self) -> List[str]:
        return ["--state-dir", self._state_dir] if self._state_dir else []

    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        if self.url:
            env["DSEC_URL"] = self.url
        if self.api_key:
            env["DSEC_API_KEY"] = self.api_key
        return env


class _CliError(Exception):
    def __init__(self, message: str, code: str = "cli_error") -> None:
        super().__init__(message)
        self.code = code


async def _run_cli_json(
    command: Sequence[str], global_args: List[str], args: List[str], env: Mapping[str, str], cwd: Optional[str]
) -> Any:
    proc = await asyncio.create_subprocess_exec(
        *command,
        "--json",
        *global_args,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()
        match = re.search(r'"code":\s*"([a-z_]+)"', text)
        code = match.group(1) if match else "cli_error"
        raise _CliError(f"dsec {' '.join(args[:2])} exited {proc.returncode}: {text[-2000:]}", code)
    return json.loads(out.decode())


async def run_cli(
    tasks_file: str,
    *,
    agent: str = "gold",
    out: str = "results.jsonl",
    concurrency: int = 4,
    labels: Optional[Mapping[str, str]] = None,
    endpoint: Optional[str] = None,
    model: Optional[str] = None,
    resume: bool = False,
    dsec_command: Optional[Sequence[str]] = None,
    dsec_cwd: Optional[str] = None,
    state_dir: Optional[str] = None,
    url: Optional[str] = None,
    api_key: Optional[str] = None,
) -> List[Dict[str, Any]]:
    """A batch with a built-in agent (``gold``, ``none``, ``http``) through
    ``dsec eval run`` (journal, ``resume``, pause on SIGTERM included);
    returns the result lines of ``out`` as dicts."""
    args = ["eval", "run", os.path.abspath(tasks_file), "--agent", agent, "--out", os.path.abspath(out)]
    args += ["--concurrency", str(concurrency)]
    for k, v in (labels or {}).items():
        args += ["--label", f"{k}={v}"]
    if endpoint:
        args += ["--endpoint", endpoint]
    if model:
        args += ["--model", model]
    if resume:
        args.append("--resume")
    env = dict(os.environ)
    if url:
        env["DSEC_URL"] = url
    if api_key:
        env["DSEC_API_KEY"] = api_key
    global_args = ["--state-dir", state_dir] if state_dir else []
    command = list(dsec_command) if dsec_command else _default_command()
    await _run_cli_json(command, global_args, args, env, dsec_cwd)
    with open(os.path.abspath(out), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

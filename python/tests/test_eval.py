"""dsec.eval against a real ``dsec up``: a Python agent callback per task,
graded by ``dsec eval grade``, and a whole batch through ``dsec eval run``.

The task set is the shell fixture of packages/eval (busybox only): three
tasks over two repositories, each with a bug, a gold patch and TAP tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest

from dsec.eval import EvalRunner, Rollout, request_prefix, run_cli

from .conftest import REPO, Cluster


def _dsec_cli() -> List[str]:
    node = shutil.which("node")
    assert node is not None
    return [node, "--conditions=dsec-source", "--import", "tsx", str(REPO / "packages/cli/src/run.ts")]


@pytest.fixture(scope="module")
def task_set(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """Writes the fixture tasks; returns the task file and each task's fix."""
    dest = tmp_path_factory.mktemp("eval-tasks")
    script = (
        "const { makeShellTaskSet } = await import('@dsec/eval/testing');"
        f"const set = await makeShellTaskSet({json.dumps(str(dest))}, {{ image: 'busybox' }});"
        "process.stdout.write(JSON.stringify(set));"
    )
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, "--conditions=dsec-source", "--import", "tsx", "--input-type=module", "-e", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    task_set: Dict[str, Any] = json.loads(done.stdout)
    return task_set


def test_request_prefix_matches_the_typescript_scheme() -> None:
    assert request_prefix("abc123", "shcalc__add-1") == "ev.abc123.shcalc__add-1.1"
    long = request_prefix("r", "org/repo-" + "x" * 80, 2)
    assert long.startswith("ev.r.org_repo-") and long.endswith(".2")
    assert len(long) < 90


async def test_a_python_agent_per_task_gets_reward_1_and_doing_nothing_gets_0(
    cluster: Cluster, task_set: Dict[str, Any]
) -> None:
    fixes = {t["instance_id"]: t["edit"] for t in task_set["tasks"]}

    async def fixer(rollout: Rollout) -> Dict[str, Any]:
        edit = fixes[rollout.task["instance_id"]]
        before = await rollout.read_file(edit["path"])
        assert before is not None and edit["old"] in before
        await rollout.edit_file(edit["path"], edit["old"], edit["new"])
        run = await rollout.shell("sh tests/run.sh")
        return {"tests_exit": run.exit_code}

    async def idle(rollout: Rollout) -> None:
        assert await rollout.read_file("no/such/file") is None

    async with EvalRunner(
        task_set["tasksFile"],
        url=cluster.url,
        api_key=cluster.admin_key,
        labels={"job": "py-eval"},
        dsec_command=_dsec_cli(),
        dsec_cwd=str(REPO),
        state_dir=str(cluster.state_dir),
    ) as runner:
        solved = await runner.run_batch(fixer, concurrency=3)
        assert [r.reward for r in solved] == [1, 1, 1], [r.error for r in solved]
        for r in solved:
            assert r.error is None
            assert r.tool_calls == 3
            assert r.agent_output == {"tests_exit": 0}
            assert r.failing == []
            assert r.sandbox_id
        assert solved[0].tests == {"add_basic": "passed", "add_zero": "passed", "sub_basic": "passed"}

        untouched = await runner.run_batch(idle)
        assert [r.reward for r in untouched] == [0, 0, 0], [r.error for r in untouched]
        assert "add_basic" in untouched[0].failing

        # Every sandbox of the job was stopped after grading.
        live = await runner._client.list_sandboxes(labels={"job": "py-eval"})
        assert all(s.state == "stopped" for s in live)


async def test_run_cli_runs_a_batch_with_a_builtin_agent(
    cluster: Cluster, task_set: Dict[str, Any], tmp_path: Path
) -> None:
    results = await run_cli(
        task_set["tasksFile"],
        agent="gold",
        out=str(tmp_path / "gold.jsonl"),
        concurrency=3,
        dsec_command=_dsec_cli(),
        dsec_cwd=str(REPO),
        state_dir=str(cluster.state_dir),
        url=cluster.url,
        api_key=cluster.admin_key,
    )
    assert sorted((r["instance_id"], r["reward"], r["duplicateExecutions"]) for r in results) == [
        ("shcalc__add-1", 1, 0),
        ("shcalc__mul-2", 1, 0),
        ("strtool__upper-1", 1, 0),
    ]

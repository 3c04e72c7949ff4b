"""One Harbor trial's environment steps on DSec, through ``DSecEnvironment``.

Harbor itself loads the provider from a trial or job config (``environment.import_path:
dsec.integrations.harbor:DSecEnvironment``, see ``harbor_dsec_trial.yaml`` beside this file);
this script walks the same calls Harbor's trial makes for the ``oracle`` agent on a non-mounted
environment, so the provider can be tried without Harbor installed:

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    /usr/bin/python3 examples/python/harbor_trial.py examples/harbor-tasks/log-top-ips

``start`` builds the task's ``environment/Dockerfile`` with DSec's Dockerfile builder through
the API (``--image NAME`` uses a prebuilt DSec image instead); then ``solution/`` is uploaded
to ``/solution`` and run, ``tests/`` to ``/tests`` and run, ``/logs/verifier`` downloaded, and
the reward in ``reward.txt`` printed. The sandbox is stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec.integrations.harbor import DSecEnvironment  # noqa: E402


@dataclass
class TaskEnvironment:
    """The ``[environment]`` table of task.toml (what Harbor's EnvironmentConfig holds)."""

    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: Optional[int] = None
    gpus: int = 0
    allow_internet: bool = True
    docker_image: Optional[str] = None
    build_timeout_sec: float = 600.0
    env: Dict[str, str] = field(default_factory=dict)


async def trial(task_dir: Path, image: Optional[str], shell: str) -> float:
    config = tomllib.loads((task_dir / "task.toml").read_text())
    table = config.get("environment", {})
    known = TaskEnvironment.__dataclass_fields__
    task_env = TaskEnvironment(**{k: v for k, v in table.items() if k in known})
    agent_timeout = int(config.get("agent", {}).get("timeout_sec", 3600))
    verifier_timeout = int(config.get("verifier", {}).get("timeout_sec", 600))
    env = DSecEnvironment(
        environment_dir=task_dir / "environment",
        environment_name=task_dir.name,
        session_id=f"{task_dir.name}__example",
        trial_paths=None,
        task_env_config=task_env,
        image=image,
        shell=shell,
    )
    await env.start(force_build=False)
    print(f"sandbox {env.sandbox_id} of image {env.image}")
    try:
        await env.upload_dir(task_dir / "solution", "/solution")
        solved = await env.exec(f"{shell} /solution/solve.sh", timeout_sec=agent_timeout)
        print(f"solve.sh exited {solved.return_code}")
        await env.upload_dir(task_dir / "tests", "/tests")
        verified = await env.exec(f"{shell} /tests/test.sh", timeout_sec=verifier_timeout)
        print(verified.stdout or "", end="")
        with tempfile.TemporaryDirectory() as out:
            await env.download_dir("/logs/verifier", Path(out))
            reward_file = Path(out) / "reward.txt"
            return float(reward_file.read_text().strip()) if reward_file.is_file() else 0.0
    finally:
        await env.stop(delete=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task_dir", type=Path, help="a Harbor task directory")
    parser.add_argument("--image", help="a prebuilt DSec image (default: build environment/Dockerfile)")
    parser.add_argument("--shell", default="bash", help="shell of the image (default bash)")
    args = parser.parse_args()
    reward = asyncio.run(trial(args.task_dir, args.image, args.shell))
    print(f"reward {reward}")


if __name__ == "__main__":
    main()

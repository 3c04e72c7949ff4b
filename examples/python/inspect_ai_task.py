"""An inspect_ai task whose samples run in DSec sandboxes: ``sandbox="dsec"``.

With inspect_ai installed (and the ``dsec`` package installed, so inspect finds the provider
through its ``inspect_ai`` entry point)::

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    inspect eval examples/python/inspect_ai_task.py --model mockllm/model

Without inspect_ai, ``--direct`` drives the provider through the same calls inspect makes
(task_init, sample_init, exec, write_file/read_file, sample_cleanup, task_cleanup)::

    /usr/bin/python3 examples/python/inspect_ai_task.py --direct --image busybox
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec.integrations.inspect_ai import (  # noqa: E402
    HAVE_INSPECT,
    DSecSandboxConfig,
    DSecSandboxEnvironment,
)

if HAVE_INSPECT:
    from inspect_ai import Task, task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import bash
    from inspect_ai.util import SandboxEnvironmentSpec

    @task
    def hostname_in_sandbox() -> Task:
        """The model may call ``bash`` in a DSec sandbox of the Debian image."""
        return Task(
            dataset=[Sample(input="Run `uname -s` and answer with its output.", target="Linux")],
            solver=[use_tools(bash()), generate()],
            scorer=includes(),
            sandbox=SandboxEnvironmentSpec("dsec", DSecSandboxConfig(image="debian", memory_mb=512)),
        )


async def direct(image: str) -> None:
    config = DSecSandboxConfig(image=image, ttl_seconds=600)
    await DSecSandboxEnvironment.task_init("example", config)
    envs = await DSecSandboxEnvironment.sample_init("example", config, {})
    try:
        sandbox = envs["default"]
        await sandbox.write_file("hello.py", "print('hello from', __name__)\n")
        print((await sandbox.exec(["uname", "-s"])).stdout, end="")
        print(await sandbox.read_file("hello.py"), end="")
        print((await sandbox.connection()).command)
    finally:
        await DSecSandboxEnvironment.sample_cleanup("example", config, dict(envs), False)
        await DSecSandboxEnvironment.task_cleanup("example", config, True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direct", action="store_true", help="drive the provider without inspect_ai")
    parser.add_argument("--image", default="debian", help="DSec image for --direct")
    args = parser.parse_args()
    if not args.direct:
        parser.error("run this file with `inspect eval`, or pass --direct")
    asyncio.run(direct(args.image))

"""SWE-ReX on DSec: what SWE-agent does with a deployment, against ``dsec up``.

SWE-agent's one change is the deployment: ``DSecDeployment(image=...)`` where it had
``DockerDeployment(image=...)``. Without swerex installed the request models come from
``dsec.integrations.swerex`` (the same names and fields as swerex's).

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    /usr/bin/python3 examples/python/swerex_deployment.py --image busybox
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec.integrations.swerex import (  # noqa: E402
    BashAction,
    BashIncorrectSyntaxError,
    Command,
    CommandTimeoutError,
    CreateBashSessionRequest,
    DSecDeployment,
    ReadFileRequest,
    WriteFileRequest,
)


async def main(image: str) -> int:
    async with DSecDeployment(image=image, ttl=600) as deployment:
        runtime = deployment.runtime
        print("alive:", bool(await deployment.is_alive()))
        await runtime.create_session(CreateBashSessionRequest())
        await runtime.run_in_session(BashAction(command="mkdir -p /repo && cd /repo && export STEP=1"))
        obs = await runtime.run_in_session(BashAction(command='echo "in $(pwd), step $STEP"', timeout=30))
        print("session:", obs.output.strip(), "exit", obs.exit_code)
        try:
            await runtime.run_in_session(BashAction(command="if then"))
        except BashIncorrectSyntaxError:
            print("syntax error caught before anything ran")
        try:
            await runtime.run_in_session(BashAction(command="sleep 60", timeout=1))
        except CommandTimeoutError:
            still = await runtime.run_in_session(BashAction(command="echo $STEP"))
            print("timed out; the session lives on:", still.output.strip())
        await runtime.write_file(WriteFileRequest(path="/repo/hello.py", content="print('hi')\n"))
        print("file:", (await runtime.read_file(ReadFileRequest(path="/repo/hello.py"))).content.strip())
        done = await runtime.execute(Command(command=["ls", "/repo"], timeout=30, check=True))
        print("execute:", done.stdout.split())
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="busybox", help="a DSec image name")
    sys.exit(asyncio.run(main(parser.parse_args().image)))

"""verifiers' SandboxEnv on DSec: the calls its ``bash`` tool and rollouts make, against ``dsec up``.

In a verifiers environment the one change is the client::

    env = vf.SandboxEnv(docker_image="python:3.11-slim", ...)
    env.sandbox_client = DSecSandboxClient(image_map={"python:3.11-slim": "python311"})

(or ``DSecSandboxEnv`` where verifiers is installed). This script drives the client the same way
SandboxEnv does: create, wait_for_creation, execute_command with a per-command timeout, files,
a background job, delete.

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    /usr/bin/python3 examples/python/verifiers_sandbox_env.py --image busybox
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec.integrations.verifiers import CommandTimeoutError, CreateSandboxRequest, DSecSandboxClient  # noqa: E402


async def main(image: str) -> int:
    async with DSecSandboxClient(image_map={"python:3.11-slim": image}) as client:
        request = CreateSandboxRequest(name="sandbox-env", docker_image="python:3.11-slim", timeout_minutes=10)
        sandbox = await client.create(request)
        await client.wait_for_creation(sandbox.id)
        print("sandbox:", sandbox.id, sandbox.status)
        result = await client.execute_command(sandbox.id, "echo hello; uname -s", working_dir="/tmp", timeout=30)
        print("bash tool:", result.stdout.split(), "exit", result.exit_code)
        try:
            await client.execute_command(sandbox.id, "sleep 60", timeout=1)
        except CommandTimeoutError as err:
            print("timeout:", err)
        await client.upload_bytes(sandbox.id, "/workspace/answer.txt", b"42\n", "answer.txt")
        print("read_file:", (await client.read_file(sandbox.id, "/workspace/answer.txt")).content.strip())
        job = await client.run_background_job(sandbox.id, "cat /workspace/answer.txt", timeout=60)
        print("background job:", job.exit_code, job.stdout.strip())
        await client.delete(sandbox.id)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="busybox", help="the DSec image python:3.11-slim maps to")
    sys.exit(asyncio.run(main(parser.parse_args().image)))

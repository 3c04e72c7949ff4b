"""tinker-cookbook's SandboxInterface on DSec, as the harbor_rl recipe's tools use it, against ``dsec up``.

In the recipe the one change is the factory::

    sandbox_factory = make_sandbox_factory("python311")   # instead of default_sandbox_factory (Modal)

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    /usr/bin/python3 examples/python/tinker_sandbox.py --image busybox
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec.integrations.tinker import make_sandbox_factory  # noqa: E402


async def main(image: str) -> int:
    factory = make_sandbox_factory(image)
    sandbox = await factory(Path("environment"), 600)
    try:
        await sandbox.send_heartbeat()
        await sandbox.write_file("/workspace/solve.sh", "#!/bin/sh\necho solved\n", executable=True)
        result = await sandbox.run_command("/workspace/solve.sh", workdir="/workspace", timeout=30)
        print("run_command:", result.stdout.strip(), "exit", result.exit_code, result.metrics)
        slow = await sandbox.run_command("sleep 60", timeout=1)
        print("timeout:", slow.exit_code, slow.metrics.get("timed_out"))
        print("read_file:", (await sandbox.read_file("/workspace/solve.sh", max_bytes=9)).stdout)
    finally:
        await sandbox.cleanup()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="busybox", help="a DSec image name")
    sys.exit(asyncio.run(main(parser.parse_args().image)))

"""The blocking twin of the asyncio client: the same calls without ``await``::

    from dsec import DSecContainerRunArgs
    from dsec.sync import DSecClient

    with DSecClient() as client:
        with client.run_container(DSecContainerRunArgs(container_image="busybox")) as sandbox:
            print(sandbox.run_shell("echo hello world").stdout)

Its code is generated from the asyncio client (``python/tools/gen_sync.py``),
so both send the same requests. Iterating an ``OutputStream`` is a plain
``for`` loop here. Models and errors are those of ``dsec``.
"""

from ._sync import CommandHandle, Commands, DSecClient, Files, FnCalls, OutputStream, Sandbox, Session

__all__ = ["DSecClient", "Sandbox", "Commands", "CommandHandle", "OutputStream", "Session", "Files", "FnCalls"]

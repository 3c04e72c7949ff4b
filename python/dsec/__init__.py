"""dsec — the Python client of DSec (the paper's libdsec), asyncio first.

The paper's minimal session, with ``DSEC_URL`` and ``DSEC_API_KEY`` set::

    from dsec import DSecClient, DSecContainerRunArgs

    client = DSecClient()
    await client.open()
    args = DSecContainerRunArgs(
        container_image="busybox",
        memory_limit_mb=4096, cpu_cores_limit=4,
        ttl_running_stop=300,
        network_rules={"npm": False, "pypi": True},
        init_user="root",
    )
    sandbox = await client.run_container(args, timeout=120)
    result = await sandbox.run_shell("echo hello world")
    print(result.exit_code, result.stdout)   # 0 hello world
    await sandbox.stop()
    await client.close()

The same without asyncio: ``from dsec.sync import DSecClient`` and drop the
``await``. Durations are seconds. Every failure is a ``DSecError`` subclass
named after its stable code (``SandboxNotFound``, ``InvalidArgument`` …).
"""

from ._async import CommandHandle, Commands, DSecClient, Files, FnCalls, OutputStream, Sandbox, Session
from ._core import DEFAULT_URL
from ._version import __version__
from .errors import (
    ERROR_CLASSES,
    Aborted,
    CapacityExhausted,
    CommandNotFound,
    Conflict,
    DeadlineExceeded,
    DSecError,
    ImageNotFound,
    Internal,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    RateLimited,
    ResourceExhausted,
    SandboxNotFound,
    SandboxNotRunning,
    Unauthenticated,
    Unavailable,
    VolumeInUse,
    VolumeNotFound,
)
from .models import (
    CommandInfo,
    CommandResult,
    CreatedKey,
    DSecContainerRunArgs,
    EdgeStatus,
    FileInfo,
    FnCallItem,
    FnCallResult,
    Health,
    JobFailure,
    JobResult,
    JobSandbox,
    LayerInfo,
    NetworkTarget,
    OutputEvent,
    Project,
    Quota,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SessionInfo,
    SessionResult,
    SnapshotInfo,
    VolumeInfo,
    VolumeMount,
    Whoami,
)

__all__ = [
    "__version__",
    "DEFAULT_URL",
    # client
    "DSecClient",
    "Sandbox",
    "Commands",
    "CommandHandle",
    "OutputStream",
    "Session",
    "Files",
    "FnCalls",
    # requests and answers
    "DSecContainerRunArgs",
    "NetworkTarget",
    "CommandInfo",
    "CommandResult",
    "CreatedKey",
    "EdgeStatus",
    "FileInfo",
    "FnCallItem",
    "FnCallResult",
    "Health",
    "JobFailure",
    "JobResult",
    "JobSandbox",
    "LayerInfo",
    "OutputEvent",
    "Project",
    "Quota",
    "VolumeInfo",
    "VolumeMount",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSpec",
    "SessionInfo",
    "SessionResult",
    "SnapshotInfo",
    "Whoami",
    # errors
    "ERROR_CLASSES",
    "DSecError",
    "Aborted",
    "CapacityExhausted",
    "CommandNotFound",
    "Conflict",
    "DeadlineExceeded",
    "ImageNotFound",
    "VolumeNotFound",
    "VolumeInUse",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "QuotaExceeded",
    "RateLimited",
    "ResourceExhausted",
    "SandboxNotFound",
    "SandboxNotRunning",
    "Unauthenticated",
    "Unavailable",
]

"""prime-sandboxes' types that verifiers' ``SandboxEnv`` uses, for when ``prime_sandboxes`` is not installed.

Written from github:PrimeIntellect-ai/prime at 66fb4b704377aa56b0f580756c80f3bc824a797a
(``packages/prime-sandboxes/src/prime_sandboxes/{exceptions,models}.py``, ``core/client.py``):
the same class names, bases, constructor arguments and messages; the models as dataclasses with
the fields verifiers reads. When ``prime_sandboxes`` is importable, ``dsec.integrations.verifiers``
uses its classes instead, so verifiers' own ``except CommandTimeoutError`` clauses catch what the
DSec client raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Union

# --- exceptions ----------------------------------------------------------------


class APIError(Exception):
    """Base API exception"""


class SandboxFileNotFoundError(APIError):
    """Raised when a file is not found in the sandbox (404)."""


class SandboxFileTooLargeError(APIError):
    """Raised when a file exceeds the sandbox read size limit (413)."""


class SandboxNotRunningError(RuntimeError):
    """Raised when an operation requires a RUNNING sandbox but it is not running."""

    def __init__(
        self,
        sandbox_id: str,
        status: Optional[str] = None,
        error_type: Optional[str] = None,
        command: Optional[str] = None,
        message: Optional[str] = None,
    ):
        self.sandbox_id = sandbox_id
        self.status = status
        self.error_type = error_type
        self.command = command
        if message:
            msg = message
        elif error_type:
            msg = f"Sandbox {sandbox_id} failed ({error_type})"
        elif status:
            msg = f"Sandbox {sandbox_id} is not running (status={status})"
        else:
            msg = f"Sandbox {sandbox_id} is not running"
        super().__init__(msg)


class CommandTimeoutError(RuntimeError):
    """Raised when a command execution times out."""

    def __init__(self, sandbox_id: str, command: str, timeout: int):
        msg = f"Command '{command}' timed out after {timeout}s in sandbox {sandbox_id}"
        super().__init__(msg)


class UploadTimeoutError(RuntimeError):
    """Raised when a file upload times out."""

    def __init__(self, sandbox_id: str, file_path: str, timeout: int):
        msg = f"Upload to '{file_path}' timed out after {timeout}s in sandbox {sandbox_id}"
        super().__init__(msg)


class DownloadTimeoutError(RuntimeError):
    """Raised when a file download times out."""

    def __init__(self, sandbox_id: str, file_path: str, timeout: int):
        msg = f"Download from '{file_path}' timed out after {timeout}s in sandbox {sandbox_id}"
        super().__init__(msg)


class SandboxOOMError(SandboxNotRunningError):
    """Raised when sandbox fails due to out-of-memory."""


class SandboxTimeoutError(SandboxNotRunningError):
    """Raised when sandbox times out."""


class SandboxImagePullError(SandboxNotRunningError):
    """Raised when Docker image cannot be pulled."""


# --- models ----------------------------------------------------------------------


@dataclass
class CreateSandboxRequest:
    name: str
    docker_image: str
    start_command: Optional[Union[str, Any]] = "tail -f /dev/null"
    cpu_cores: float = 1.0
    memory_gb: float = 1.0
    disk_size_gb: float = 5.0
    gpu_count: int = 0
    gpu_type: Optional[str] = None
    vm: Optional[bool] = None
    network_allowlist: Optional[List[str]] = None
    network_denylist: Optional[List[str]] = None
    timeout_minutes: int = 60
    idle_timeout_minutes: Optional[int] = None
    environment_vars: Optional[Dict[str, str]] = None
    secrets: Optional[Dict[str, str]] = None
    labels: List[str] = field(default_factory=list)
    team_id: Optional[str] = None
    region: Optional[str] = None
    advanced_configs: Optional[Any] = None
    registry_credentials_id: Optional[str] = None
    guaranteed: bool = False
    idempotency_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.gpu_count > 0 and not self.gpu_type:
            raise ValueError("gpu_type is required when gpu_count is greater than 0")
        if self.gpu_count == 0 and self.gpu_type is not None:
            raise ValueError("gpu_type requires gpu_count greater than 0")

    def model_copy(self) -> "CreateSandboxRequest":
        """What ``SandboxEnv.get_sandbox_request`` calls on pydantic's model."""
        import copy

        return copy.deepcopy(self)


@dataclass
class Sandbox:
    id: str
    name: str
    docker_image: str
    status: str
    cpu_cores: float
    memory_gb: float
    disk_size_gb: float
    timeout_minutes: int
    created_at: datetime
    updated_at: datetime
    start_command: Optional[str] = None
    disk_mount_path: str = "/"
    gpu_count: int = 0
    vm: bool = False
    labels: List[str] = field(default_factory=list)
    environment_vars: Optional[Dict[str, Any]] = None
    started_at: Optional[datetime] = None
    terminated_at: Optional[datetime] = None
    termination_reason: Optional[str] = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None


@dataclass
class CommandResponse:
    stdout: str
    stderr: str
    exit_code: int


@dataclass
class BackgroundJob:
    job_id: str
    sandbox_id: str
    stdout_log_file: str
    stderr_log_file: str
    exit_file: str


@dataclass
class BackgroundJobStatus:
    job_id: str
    completed: bool
    exit_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False


@dataclass
class FileUploadResponse:
    success: bool
    path: str
    size: int
    timestamp: datetime


@dataclass
class ReadFileResponse:
    content: str
    size: int
    total_size: Optional[int] = None
    offset: Optional[int] = None
    truncated: Optional[bool] = None


@dataclass
class BulkDeleteSandboxResponse:
    succeeded: List[str]
    failed: List[Dict[str, str]]
    message: str

"""SWE-ReX's interface types, for when ``swerex`` is not installed.

Written from github:SWE-agent/SWE-ReX at 5c995c365dfb1fd5bc56fda688be5d8538f9931f
(``src/swerex/exceptions.py``, ``src/swerex/runtime/abstract.py``): the same class names, bases,
fields and defaults, as dataclasses instead of pydantic models. When ``swerex`` is importable,
``dsec.integrations.swerex`` uses swerex's own classes instead, so ``except
swerex.exceptions.CommandTimeoutError`` catches what the DSec runtime raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

# --- exceptions (src/swerex/exceptions.py) -----------------------------------


class SwerexException(Exception):
    """Any exception that is raised by SWE-Rex."""


class SessionNotInitializedError(SwerexException, RuntimeError):
    """Raised if we try to run a command in a shell that is not initialized."""


class NonZeroExitCodeError(SwerexException, RuntimeError):
    """Can be raised if we execute a command in the shell and it has a non-zero exit code."""


class BashIncorrectSyntaxError(SwerexException, RuntimeError):
    """Before running a bash command, we check for syntax errors."""

    def __init__(self, message: str, *, extra_info: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        if extra_info is None:
            extra_info = {}
        self.extra_info = extra_info


class CommandTimeoutError(SwerexException, RuntimeError, TimeoutError): ...


class NoExitCodeError(SwerexException, RuntimeError): ...


class SessionExistsError(SwerexException, ValueError): ...


class SessionDoesNotExistError(SwerexException, ValueError): ...


class DeploymentNotStartedError(SwerexException, RuntimeError):
    def __init__(self, message: str = "Deployment not started"):
        super().__init__(message)


class DeploymentStartupError(SwerexException, RuntimeError): ...


# --- requests and responses (src/swerex/runtime/abstract.py) -----------------


@dataclass
class IsAliveResponse:
    is_alive: bool
    message: str = ""

    def __bool__(self) -> bool:
        return self.is_alive


@dataclass
class CreateBashSessionRequest:
    startup_source: List[str] = field(default_factory=list)
    session: str = "default"
    session_type: str = "bash"
    startup_timeout: float = 1.0


@dataclass
class CreateBashSessionResponse:
    output: str = ""
    session_type: str = "bash"


@dataclass
class BashAction:
    command: str
    session: str = "default"
    timeout: Optional[float] = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: str = "raise"
    error_msg: str = ""
    expect: List[str] = field(default_factory=list)
    action_type: str = "bash"


@dataclass
class BashInterruptAction:
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: List[str] = field(default_factory=list)
    action_type: str = "bash_interrupt"


@dataclass
class BashObservation:
    output: str = ""
    exit_code: Optional[int] = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: str = "bash"


@dataclass
class CloseBashSessionRequest:
    session: str = "default"
    session_type: str = "bash"


@dataclass
class CloseBashSessionResponse:
    session_type: str = "bash"


@dataclass
class Command:
    command: Union[str, List[str]]
    timeout: Optional[float] = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: Optional[Dict[str, str]] = None
    cwd: Optional[str] = None
    merge_output_streams: bool = False


@dataclass
class CommandResponse:
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None


@dataclass
class ReadFileRequest:
    path: str
    encoding: Optional[str] = None
    errors: Optional[str] = None


@dataclass
class ReadFileResponse:
    content: str = ""


@dataclass
class WriteFileRequest:
    content: str
    path: str


@dataclass
class WriteFileResponse:
    pass


@dataclass
class UploadRequest:
    source_path: str
    target_path: str


@dataclass
class UploadResponse:
    pass


@dataclass
class CloseResponse:
    pass

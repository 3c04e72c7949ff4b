"""tinker-cookbook's sandbox types, for when ``tinker_cookbook`` is not installed.

Written from github:thinking-machines-lab/tinker-cookbook at 9dfcc3a2cf44432d621a01005073dc6d76a1e87a
(``tinker_cookbook/sandbox/sandbox_interface.py``, ``tinker_cookbook/exceptions.py``): the same
names, bases and fields; ``SandboxResult`` is a frozen dataclass where the cookbook uses ``chz``.
When ``tinker_cookbook`` is importable, ``dsec.integrations.tinker`` uses its classes instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


class TinkerCookbookError(Exception):
    """Base exception for all tinker-cookbook errors."""


class SandboxError(TinkerCookbookError, RuntimeError):
    """An error related to code-execution sandboxes."""


class SandboxTerminatedError(SandboxError):
    """Raised when a sandbox has been terminated or died unexpectedly."""


@dataclass(frozen=True)
class SandboxResult:
    """Result from a sandbox operation."""

    stdout: str
    stderr: str
    exit_code: int
    metrics: Dict[str, Any] = field(default_factory=dict)

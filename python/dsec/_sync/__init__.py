# GENERATED from dsec/_async/__init__.py by python/tools/gen_sync.py: do not edit.
"""The blocking client; ``dsec/_sync`` is generated from this package."""

from .client import DSecClient
from .commands import CommandHandle, Commands, OutputStream
from .files import Files
from .fncall import FnCalls
from .sandbox import Sandbox
from .session import Session

__all__ = ["DSecClient", "Sandbox", "Commands", "CommandHandle", "OutputStream", "Session", "Files", "FnCalls"]

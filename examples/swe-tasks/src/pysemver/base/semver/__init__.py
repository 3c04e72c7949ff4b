"""Semantic Versioning 2.0.0 versions."""

from .version import Version

__all__ = ["Version"]

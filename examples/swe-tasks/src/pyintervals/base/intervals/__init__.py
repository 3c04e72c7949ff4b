"""Half-open integer intervals: merging and measuring."""

from .core import Interval, merge, total_length

__all__ = ["Interval", "merge", "total_length"]

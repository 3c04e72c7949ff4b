"""Descriptive statistics for small lists of numbers."""

from .describe import StatisticsError, mean, median, mode

__all__ = ["StatisticsError", "mean", "median", "mode"]

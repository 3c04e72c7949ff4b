"""Reads .env files."""

from .parser import DotenvError, load, parse

__all__ = ["DotenvError", "load", "parse"]

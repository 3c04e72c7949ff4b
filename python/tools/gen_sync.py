#!/usr/bin/env python3
"""Generates dsec/_sync (the blocking client) from dsec/_async (the asyncio one).

The asyncio code is the one source: every call, its path, body, deadline and
retry rule is written there once. This script rewrites it token by token
(``async def`` → ``def``, ``await x`` → ``x``, ``httpx.AsyncClient`` →
``httpx.Client`` …), the technique httpcore calls unasync. Run it after
changing anything under dsec/_async; ``--check`` (run by the tests) fails when
dsec/_sync is not what it would write.

    /usr/bin/python3 python/tools/gen_sync.py [--check]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "dsec"
SOURCE = PACKAGE / "_async"
TARGET = PACKAGE / "_sync"

# Order matters: the generic AsyncGenerator[Y, None] before the plain names.
REWRITES: List[Tuple[str, str]] = [
    (r"\bAsyncGenerator\[(.+?), None\]", r"Generator[\1, None, None]"),
    (r"\basync def\b", "def"),
    (r"\basync for\b", "for"),
    (r"\basync with\b", "with"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bAsyncGenerator\b", "Generator"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\bAsyncIterable\b", "Iterable"),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bhttpx\.AsyncClient\b", "httpx.Client"),
    (r"\basync_connection_pool\b", "sync_connection_pool"),
    (r"\.aclose\(\)", ".close()"),
    (r"\.aread\(\)", ".read()"),
    (r"\.aiter_bytes\(\)", ".iter_bytes()"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"^import asyncio$", "import time"),
    (r"\b_async\b", "_sync"),
    (r"\basyncio\b", "blocking"),
]


def _dedupe_imports(text: str) -> str:
    """``from typing import Iterator, AsyncIterator`` holds a duplicate once rewritten."""

    def names(listed: str) -> List[str]:
        found = [n.strip() for n in listed.split(",") if n.strip()]
        return sorted(set(found))

    def one_line(match: "re.Match[str]") -> str:
        return "from typing import " + ", ".join(names(match.group(1)))

    def parenthesized(match: "re.Match[str]") -> str:
        return "from typing import (\n" + "".join(f"    {n},\n" for n in names(match.group(1))) + ")"

    text = re.sub(r"^from typing import \((.*?)\)", parenthesized, text, flags=re.M | re.S)
    return re.sub(r"^from typing import ([^(\n]+)$", one_line, text, flags=re.M)


def unasync(source: str, name: str) -> str:
    text = source
    for pattern, replacement in REWRITES:
        text = re.sub(pattern, replacement, text, flags=re.M)
    header = f"# GENERATED from dsec/_async/{name} by python/tools/gen_sync.py: do not edit.\n"
    return header + _dedupe_imports(text)


def generate() -> Dict[Path, str]:
    return {TARGET / src.name: unasync(src.read_text(), src.name) for src in sorted(SOURCE.glob("*.py"))}


def main(argv: List[str]) -> int:
    wanted = generate()
    if "--check" in argv:
        stale = [str(p) for p, text in wanted.items() if not p.exists() or p.read_text() != text]
        extra = [str(p) for p in TARGET.glob("*.py") if p not in wanted]
        if stale or extra:
            print("dsec/_sync is out of date; run python/tools/gen_sync.py:", *stale, *extra, sep="\n  ")
            return 1
        return 0
    TARGET.mkdir(exist_ok=True)
    for path in TARGET.glob("*.py"):
        if path not in wanted:
            path.unlink()
    for path, text in wanted.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Stateless function calls in warm pools (``client.fncall``; docs/fncall.md)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .._core import (
    FNCALL_DEFAULT_LIMIT,
    FNCALL_MAP_TIMEOUT,
    FNCALL_SLACK,
    RETRY_CODES,
    NdjsonLines,
    compact,
    fncall_batches,
    fncall_body,
    fncall_retry_after,
    or_default,
)
from ..errors import DSecError, Internal, error_from_body
from ..models import FnCallItem, FnCallResult, from_wire
from .transport import Transport

NDJSON = "application/x-ndjson"


class FnCalls:
    """Runs programs in warm pools: ``run`` one call, ``map`` many.

    Nothing one call leaves behind (files, processes, environment) is seen by
    another, so calls are resent freely on ``Unavailable``,
    ``CapacityExhausted`` and ``QuotaExceeded``::

        result = await client.fncall.run("python", "print(sum(map(int, input().split())))", stdin="1 2\\n")
        assert result.stdout == "3\\n"
        async for item in client.fncall.map(calls, concurrency=32):
            grade(item.index, item.result or item.error)
    """

    def __init__(self, http: Transport) -> None:
        self._http = http

    async def run(
        self,
        language: str,
        code: str,
        *,
        stdin: Optional[str] = None,
        files: Optional[Mapping[str, str]] = None,
        args: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout_ms: Optional[int] = None,
        memory_mb: Optional[int] = None,
        network: Optional[bool] = None,
        max_output_bytes: Optional[int] = None,
        gpu: Optional[Mapping[str, Any]] = None,
        edge_selector: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> FnCallResult:
        """Runs ``code`` with the runtime ``language`` and returns how it ended.

        ``timeout_ms`` is the call's own limit (default 10 s); ``timeout`` the
        client's deadline in seconds (default that limit + 60 s). Raises
        ``InvalidArgument`` (with ``field``), ``Unavailable`` when no edge runs
        function calls, ``QuotaExceeded`` past the calls-per-second quota.
        """
        body = compact(
            {
                "language": language,
                "code": code,
                "stdin": stdin,
                "files": dict(files) if files is not None else None,
                "args": list(args) if args is not None else None,
                "env": dict(env) if env is not None else None,
                "timeoutMs": timeout_ms,
                "memoryMb": memory_mb,
                "network": network,
                "maxOutputBytes": max_output_bytes,
                "gpu": dict(gpu) if gpu is not None else None,
                "edgeSelector": dict(edge_selector) if edge_selector is not None else None,
            }
        )
        limit = timeout_ms / 1000 if timeout_ms is not None else FNCALL_DEFAULT_LIMIT
        answer = await self._http.json(
            "POST", "/v1/fncall", body=body, timeout=or_default(timeout, limit + FNCALL_SLACK), retry_safe=True
        )
        return from_wire(FnCallResult, answer)

    async def map(
        self,
        calls: Sequence[Mapping[str, Any]],
        *,
        concurrency: int = 16,
        timeout: Optional[float] = None,
    ) -> AsyncGenerator[FnCallItem, None]:
        """Runs ``calls`` (mappings with ``run``'s arguments: ``language``,
        ``code``, ``stdin``, ``timeout_ms`` …) with at most ``concurrency`` in
        flight, and yields a ``FnCallItem`` per call as it finishes.

        Calls that do not fit one request (1 MiB) go in further batches, one
        after the other. Calls refused for now (``Unavailable``,
        ``CapacityExhausted``, ``QuotaExceeded``) and those of a batch whose
        stream broke are sent again as the client's retry policy says (up to
        ``max_retries`` times, default 3, with backoff; ``max_retries=0``:
        never); an item's error is the last one. Leaving the loop early aborts the calls still
        running. ``timeout`` is the deadline of each batch request in seconds.
        """
        bodies = [fncall_body(c) for c in calls]
        for batch in fncall_batches(bodies):
            pending = batch
            attempt = 0
            while pending:
                by_index = dict(pending)
                done: Set[int] = set()
                # Calls the platform refused for now (full, down, over quota): sent again after a wait.
                again: List[Tuple[int, Dict[str, Any]]] = []
                resend = attempt < self._http.retry.max_retries
                wait = self._http.retry.delay(attempt + 1)
                try:
                    async for item in self._batch(pending, concurrency, timeout):
                        done.add(item.index)
                        error = item.error
                        if isinstance(error, DSecError) and error.code in RETRY_CODES and resend:
                            again.append((item.index, by_index[item.index]))
                            wait = max(wait, fncall_retry_after(error))
                            continue
                        yield item
                    pending = again
                except DSecError as err:
                    pending = again + [(i, b) for i, b in pending if i not in done]
                    if not resend or err.code not in RETRY_CODES:
                        raise
                attempt += 1
                if pending:
                    await asyncio.sleep(wait)

    async def _batch(
        self,
        calls: List[Tuple[int, Dict[str, Any]]],
        concurrency: int,
        timeout: Optional[float],
    ) -> AsyncGenerator[FnCallItem, None]:
        lines = NdjsonLines()
        async with self._http.stream(
            "POST",
            "/v1/fncall/batch",
            body={"calls": [b for _, b in calls], "concurrency": concurrency},
            headers={"accept": NDJSON},
            timeout=or_default(timeout, FNCALL_MAP_TIMEOUT),
            retry_safe=True,
        ) as response:
            async for chunk in response.aiter_bytes():
                for line in lines.push(chunk):
                    yield _item(calls, line)
            for line in lines.end():
                yield _item(calls, line)


def _item(calls: List[Tuple[int, Dict[str, Any]]], line: Any) -> FnCallItem:
    position = line.get("index") if isinstance(line, dict) else None
    if not isinstance(position, int) or not 0 <= position < len(calls):
        raise Internal("fncall batch line without a known index")
    index = calls[position][0]
    if "error" in line:
        return FnCallItem(index=index, error=error_from_body({"error": line["error"]}, 500))
    return FnCallItem(index=index, result=from_wire(FnCallResult, line.get("result")))

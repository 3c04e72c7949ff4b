"""The HTTP transport: one pooled ``httpx`` client per ``DSecClient``.

Contract of every request:

- a 2xx answer gives its parsed JSON (``None`` for an empty body), or the
  open response for ``stream``;
- any other status raises the ``DSecError`` of its error body;
- a failure without an answer raises ``Unavailable`` (could not connect, the
  connection broke) or ``DeadlineExceeded`` (``timeout`` passed);
- a call that never reached the server, or is ``retry_safe`` (idempotent, or
  deduplicated by a request ID), is resent with backoff on ``unavailable``,
  ``capacity_exhausted``, ``quota_exceeded`` and ``rate_limited`` (``RetryPolicy``).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, Mapping, Optional, Tuple

import httpx

from .._core import (
    Params,
    RetryPolicy,
    async_connection_pool,
    decode_json,
    encode_request,
    http_timeout,
    lean_origin,
    raise_for_answer,
    transport_error,
)
from .._version import __version__
from ..errors import DSecError

#: What ``content`` may be for a streamed upload.
Content = Any


class Transport:
    def __init__(
        self,
        url: str,
        api_key: Optional[str],
        *,
        retry: RetryPolicy,
        max_connections: int,
    ) -> None:
        self.base_url = url
        self.retry = retry
        headers = {"user-agent": f"dsec-python/{__version__}"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._pool = async_connection_pool(max_connections)
        self._client = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            transport=self._pool,
            # Proxies from the environment would see the bearer key and
            # add a hop to every exec; DSec is reached directly.
            trust_env=False,
        )
        # JSON calls skip httpx (see ``async_connection_pool``) while the
        # client is this one (tests swap in a mock); None over https.
        self._own_client = self._client
        self._lean = lean_origin(url, headers)

    async def close(self) -> None:
        await self._client.aclose()

    async def json(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        params: Optional[Params] = None,
        body: Optional[Mapping[str, Any]] = None,
        retry_safe: bool = False,
    ) -> Any:
        lean = self._lean if self._client is self._own_client else None
        request = encode_request(lean, method, path, params, body) if lean is not None else b""
        attempt = 0
        while True:
            attempt += 1
            try:
                if lean is not None:
                    status, content = await self._pool.exchange(lean, request, method, f"{method} {path}", timeout)
                    raise_for_answer(status, content)
                    return decode_json(content, status)
                response = await self._client.request(
                    method, path, params=_query(params), json=body, timeout=http_timeout(timeout)
                )
                raise_for_answer(response.status_code, response.content)
                return decode_json(response.content, response.status_code)
            except httpx.HTTPError as err:
                error = transport_error(err, self.base_url, method, path)
                error.__cause__ = err
            except DSecError as err:
                error = err
            if not self.retry.should_retry(error, attempt, retry_safe):
                raise error
            await asyncio.sleep(self.retry.delay(attempt))

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        params: Optional[Params] = None,
        body: Optional[Mapping[str, Any]] = None,
        content: Content = None,
        headers: Optional[Dict[str, str]] = None,
        retry_safe: bool = False,
    ) -> AsyncIterator[httpx.Response]:
        """The open response of a 2xx answer, read by the caller; closed on exit.

        A ``content`` stream is sent once: only a failure before any byte
        left is retried then, whatever ``retry_safe`` says.
        """
        replayable = content is None or isinstance(content, (bytes, str))
        attempt = 0
        while True:
            attempt += 1
            request = self._client.build_request(
                method,
                path,
                params=_query(params),
                json=body,
                content=content,
                headers=headers,
                timeout=http_timeout(timeout),
            )
            try:
                response = await self._client.send(request, stream=True)
                if 200 <= response.status_code < 300:
                    break
                try:
                    raise_for_answer(response.status_code, await response.aread())
                finally:
                    await response.aclose()
            except httpx.HTTPError as err:
                error = transport_error(err, self.base_url, method, path)
                error.__cause__ = err
            except DSecError as err:
                error = err
            if not self.retry.should_retry(error, attempt, retry_safe and replayable):
                raise error
            await asyncio.sleep(self.retry.delay(attempt))
        try:
            yield response
        except httpx.HTTPError as err:
            raise transport_error(err, self.base_url, method, path) from err
        finally:
            await response.aclose()


def _query(params: Optional[Params]) -> Optional[Tuple[Tuple[str, str], ...]]:
    # A tuple, not the list: httpx's parameter type is invariant in lists.
    return tuple(params) if params else None

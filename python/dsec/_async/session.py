"""Named shell sessions: cwd, environment, variables and background jobs
persist across ``run`` calls (docs/adr/0004-shell-sessions.md)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .._core import COMMAND_DEADLINE_SLACK, DEFAULT_COMMAND_TIMEOUT, compact, ms, or_default, segment
from ..models import SessionResult
from .commands import OutputCallback, OutputStream, run_command
from .transport import Transport


class Session:
    """A named shell session in a sandbox, created on the server by its first
    ``run``; calls on one session run one at a time. ``shell``, ``user``,
    ``env`` and ``cwd`` apply when a call creates the session."""

    def __init__(
        self,
        http: Transport,
        sandbox_id: str,
        name: str,
        *,
        shell: Optional[str],
        user: Optional[str],
        env: Optional[Mapping[str, str]],
        cwd: Optional[str],
        default_timeout: float,
    ) -> None:
        self._http = http
        self.name = name
        self._path = f"/v1/sandboxes/{segment(sandbox_id)}/sessions/{segment(name)}"
        self._creation = compact(
            {"shell": shell, "user": user, "env": dict(env) if env is not None else None, "cwd": cwd}
        )
        self._timeout = default_timeout

    def _body(
        self,
        line: str,
        timeout: Optional[float],
        stdin: Optional[str],
        max_output_bytes: Optional[int],
        request_id: Optional[str],
    ) -> Dict[str, Any]:
        return compact(
            {
                "line": line,
                "stdin": stdin,
                "timeoutMs": ms(timeout),
                "maxOutputBytes": max_output_bytes,
                "requestId": request_id,
                **self._creation,
            }
        )

    async def run(
        self,
        line: str,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> SessionResult:
        """Types one line into the session's shell and waits for it. A
        ``timeout`` (seconds, default 60) kills the line's foreground job; the
        session lives on. Callbacks get the output as it comes."""
        return await run_command(
            self._http,
            f"{self._path}/run",
            self._body(line, timeout, stdin, max_output_bytes, request_id),
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            result_type=SessionResult,
        )

    def stream(
        self,
        line: str,
        *,
        timeout: Optional[float] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> OutputStream[SessionResult]:
        """Types one line; iterate the answer for its output as it comes."""
        return OutputStream(
            self._http,
            "POST",
            f"{self._path}/run",
            body=self._body(line, timeout, stdin, max_output_bytes, request_id),
            timeout=or_default(timeout, DEFAULT_COMMAND_TIMEOUT) + COMMAND_DEADLINE_SLACK,
            retry_safe=request_id is not None,
            result_type=SessionResult,
        )

    async def close(self, *, timeout: Optional[float] = None) -> None:
        """Kills the session's shell and everything it started; closing twice is fine."""
        await self._http.json("DELETE", self._path, timeout=or_default(timeout, self._timeout), retry_safe=True)

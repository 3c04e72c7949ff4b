# GENERATED from dsec/_async/sandbox.py by python/tools/gen_sync.py: do not edit.
"""A handle on one sandbox: commands, sessions, files, network policy,
events and lifecycle (pause, resume, TTL, snapshot, fork, stop)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .._core import DEFAULT_LIFECYCLE_TIMEOUT, compact, or_default, segment
from ..errors import InvalidArgument
from ..models import CommandResult, NetworkTarget, SandboxEvent, SandboxInfo, SessionInfo, SnapshotInfo, from_wire
from .commands import Commands, OutputCallback
from .files import Files
from .session import Session
from .transport import Transport

# A screendump of an emulated display takes a moment under TCG.
SCREENSHOT_TIMEOUT = 60.0


class Sandbox:
    """One sandbox. Holding the handle costs nothing on the server: the
    sandbox lives until ``stop()`` or its TTL. State persists across calls
    (files, installed packages, started services). As a context manager it
    stops the sandbox on exit::

        with client.run_container(args) as sandbox:
            print((sandbox.run_shell("uname -a")).stdout)
    """

    def __init__(self, http: Transport, sandbox_id: str, info: Optional[SandboxInfo], default_timeout: float) -> None:
        self._http = http
        self.id = sandbox_id
        #: Last known state; ``None`` for a handle made from an ID until ``refresh()``.
        self.info = info
        self._path = f"/v1/sandboxes/{segment(sandbox_id)}"
        self._timeout = default_timeout
        #: One-shot, streamed and background commands.
        self.commands = Commands(http, sandbox_id, default_timeout)
        #: Files inside the sandbox.
        self.files = Files(http, sandbox_id, default_timeout)

    def __repr__(self) -> str:
        state = self.info.state if self.info is not None else "?"
        return f"Sandbox(id={self.id!r}, state={state!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_shell(
        self,
        command: str,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> CommandResult:
        """Runs a shell line (the platform's shell, not the sandbox's
        ``/bin/sh``) and waits for it; see ``Commands.run``."""
        return self.commands.run(
            command,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )

    def exec(
        self,
        argv: Sequence[str],
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> CommandResult:
        """Runs a program with arguments, no shell involved; see ``Commands.run``."""
        if isinstance(argv, str):
            raise InvalidArgument("exec takes argv as a list; use run_shell for a shell line", field="argv")
        return self.commands.run(
            argv,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            request_id=request_id,
        )

    def session(
        self,
        name: str,
        *,
        shell: Optional[str] = None,
        user: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> Session:
        """A named shell session (created on the server by its first ``run``).
        ``shell`` is the sandbox's own shell (``/bin/bash``) instead of the
        platform's ``sh``."""
        return Session(
            self._http, self.id, name, shell=shell, user=user, env=env, cwd=cwd, default_timeout=self._timeout
        )

    def list_sessions(self, *, timeout: Optional[float] = None) -> List[SessionInfo]:
        answer = self._http.json(
            "GET", f"{self._path}/sessions", timeout=or_default(timeout, self._timeout), retry_safe=True
        )
        return [from_wire(SessionInfo, s) for s in answer["sessions"]]

    def refresh(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Re-reads the sandbox's state. Raises ``SandboxNotFound``."""
        answer = self._http.json("GET", self._path, timeout=or_default(timeout, self._timeout), retry_safe=True)
        self.info = from_wire(SandboxInfo, answer)
        return self.info

    def update_network_rules(
        self,
        network_rules: Optional[Mapping[str, bool]] = None,
        *,
        allow: Optional[Sequence[NetworkTarget]] = None,
        deny: Optional[Sequence[NetworkTarget]] = None,
        timeout: Optional[float] = None,
    ) -> SandboxInfo:
        """Changes the egress policy while the sandbox runs: ``network_rules``
        are merged by name (``{"npm": True}`` turns npm on and keeps the
        rest); ``allow`` and ``deny`` replace the explicit lists when given.
        New connections follow within seconds; open ones are not cut."""
        body = compact(
            {
                "networkRules": dict(network_rules) if network_rules is not None else None,
                "allow": [dict(t) for t in allow] if allow is not None else None,
                "deny": [dict(t) for t in deny] if deny is not None else None,
            }
        )
        # Applying the same patch twice gives the same policy.
        answer = self._http.json(
            "PATCH", f"{self._path}/network", body=body, timeout=or_default(timeout, self._timeout), retry_safe=True
        )
        self.info = from_wire(SandboxInfo, answer)
        return self.info

    def events(
        self, *, after_id: Optional[int] = None, limit: Optional[int] = None, timeout: Optional[float] = None
    ) -> List[SandboxEvent]:
        """Audit events (denied connections, refused DNS names, limits hit),
        oldest first; pass the last ``id`` seen as ``after_id`` to poll."""
        params = [(k, str(v)) for k, v in (("afterId", after_id), ("limit", limit)) if v is not None]
        answer = self._http.json(
            "GET", f"{self._path}/events", params=params, timeout=or_default(timeout, self._timeout), retry_safe=True
        )
        return [from_wire(SandboxEvent, e) for e in answer["events"]]

    def screenshot(self, *, timeout: Optional[float] = None) -> bytes:
        """A PNG of the sandbox's screen now. Only ``vm`` sandboxes have a
        display; others raise ``Unavailable``."""
        with self._http.stream(
            "GET", f"{self._path}/screenshot", timeout=or_default(timeout, SCREENSHOT_TIMEOUT), retry_safe=True
        ) as response:
            return b"".join([chunk for chunk in response.iter_bytes()])

    def input(
        self,
        events: Optional[Sequence[Mapping[str, Any]]] = None,
        *,
        text: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Keys and pointer events to the screen, in order: ``events`` such as
        ``{"type": "key", "key": "ret"}`` (QEMU key codes; without ``down`` a
        press and a release), ``{"type": "button", "button": "left"}``,
        ``{"type": "move", "x": 10, "y": 20}`` (pixels) or ``{"type": "moveBy",
        "dx": 5, "dy": 0}``; or ``text`` typed key by key on a US layout.
        Exactly one of the two. ``Unavailable`` for a sandbox without a display."""
        if (events is None) == (text is None):
            raise InvalidArgument("pass events or text, not both", field="events")
        body: Dict[str, Any] = {"text": text} if text is not None else {"events": [dict(e) for e in events or []]}
        count = len(text) if text is not None else len(body["events"])
        # Keys go in one by one with a short gap (the guest's queue is short): allow for it.
        self._http.json(
            "POST", f"{self._path}/input", body=body, timeout=or_default(timeout, self._timeout + 0.05 * count)
        )

    def pause(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Pauses the sandbox: its processes stop and its memory goes back to
        the host; files, processes and sessions are kept. A no-op when paused.
        The next command, session, file or port call resumes it by itself.
        Raises ``SandboxNotRunning`` when it stopped."""
        return self._lifecycle("pause", None, timeout)

    def resume(self, *, timeout: Optional[float] = None) -> SandboxInfo:
        """Resumes a paused sandbox; a no-op when running."""
        return self._lifecycle("resume", None, timeout)

    def set_timeout(self, seconds: float, *, timeout: Optional[float] = None) -> SandboxInfo:
        """The sandbox now stops ``seconds`` from now, later or sooner than
        before (rounded up to whole seconds, at most 7 days)."""
        if not seconds > 0:
            raise InvalidArgument("seconds must be positive", field="seconds")
        return self._lifecycle("timeout", {"seconds": math.ceil(seconds)}, timeout)

    def snapshot(
        self, name: str, *, scrub: Optional[Sequence[str]] = None, timeout: Optional[float] = None
    ) -> SnapshotInfo:
        """Captures the sandbox's filesystem (after a brief freeze, ``scrub``
        paths removed: absolute, a trailing ``/**`` takes a tree) as the image
        ``name`` (``name`` or ``name:version``); ``result.image`` is what
        ``DSecContainerRunArgs.container_image`` accepts. Raises ``Conflict``
        when the name is taken, ``PermissionDenied`` for a key without the
        ``sandboxes:snapshot`` scope."""
        body: Dict[str, Any] = {"name": name}
        if scrub is not None:
            body["scrub"] = list(scrub)
        answer = self._http.json(
            "POST", f"{self._path}/snapshot", body=body, timeout=or_default(timeout, DEFAULT_LIFECYCLE_TIMEOUT)
        )
        return from_wire(SnapshotInfo, answer)

    def fork(self, count: int, *, timeout: Optional[float] = None) -> List["Sandbox"]:
        """Starts ``count`` (1–64) sandboxes from this one's current
        filesystem, each with this one's spec. All or nothing: when one
        cannot be created none is left. The handles have no ``info`` until
        ``refresh()``."""
        answer = self._http.json(
            "POST",
            f"{self._path}/fork",
            body={"count": count},
            timeout=or_default(timeout, DEFAULT_LIFECYCLE_TIMEOUT),
        )
        return [Sandbox(self._http, sandbox_id, None, self._timeout) for sandbox_id in answer["ids"]]

    def stop(self, *, timeout: Optional[float] = None) -> None:
        """Stops the sandbox and frees its resources; stopping twice is fine."""
        self._http.json("DELETE", self._path, timeout=or_default(timeout, self._timeout), retry_safe=True)
        if self.info is not None:
            self.info = dataclasses.replace(self.info, state="stopped")

    def _lifecycle(self, action: str, body: Optional[Dict[str, Any]], timeout: Optional[float]) -> SandboxInfo:
        # Pause and resume are no-ops when repeated; a resent timeout sets the
        # same deadline give or take the first try's time: all safe to resend.
        answer = self._http.json(
            "POST", f"{self._path}/{action}", body=body, timeout=or_default(timeout, self._timeout), retry_safe=True
        )
        self.info = from_wire(SandboxInfo, answer)
        return self.info

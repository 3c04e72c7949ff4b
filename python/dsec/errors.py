"""The closed set of DSec errors, one exception class per stable code.

Mirrors ``packages/core/src/errors.ts`` and ``docs/errors.md`` (a test keeps
the three in sync). Match on the class or on ``code``, never on the message::

    try:
        await client.get_sandbox("sb-gone")
    except dsec.SandboxNotFound:
        ...
    except dsec.DSecError as err:
        if err.retryable:
            ...
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type


class DSecError(Exception):
    """Base of every error the SDK raises.

    ``code`` is one of the stable codes of docs/errors.md; ``field`` names the
    request field at fault (``invalid_argument`` and the not-found codes);
    ``details`` is structured context from the server; ``retryable`` says
    whether the same call may succeed later; ``status`` is the HTTP status.
    """

    code: str = "internal"
    status: int = 500
    retryable: bool = True

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        field: Optional[str] = None,
        details: Optional[Mapping[str, Any]] = None,
        status: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.field = field
        self.details: Dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.code}: {self.message}{where}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, field={self.field!r})"


class InvalidArgument(DSecError):
    """A request field is invalid; ``field`` names it."""

    code, status, retryable = "invalid_argument", 400, False


class Unauthenticated(DSecError):
    """Missing, malformed or revoked API key."""

    code, status, retryable = "unauthenticated", 401, False


class PermissionDenied(DSecError):
    """The caller may not do this."""

    code, status, retryable = "permission_denied", 403, False


class NotFound(DSecError):
    """No such route or resource; the base of the specific not-found errors."""

    code, status, retryable = "not_found", 404, False


class SandboxNotFound(NotFound):
    """No such sandbox (or not yours)."""

    code = "sandbox_not_found"


class ImageNotFound(NotFound):
    """No image or layer with that name."""

    code = "image_not_found"


class CommandNotFound(NotFound):
    """No command with that ID."""

    code = "command_not_found"


class VolumeNotFound(NotFound):
    """No volume of that name in the project (or not yours)."""

    code = "volume_not_found"


class Conflict(DSecError):
    """The resource already exists or changed."""

    code, status, retryable = "conflict", 409, False


class VolumeInUse(Conflict):
    """A sandbox mounts the volume (``details['sandboxes']``); stop it first."""

    code, status, retryable = "volume_in_use", 409, True


class SandboxNotRunning(DSecError):
    """The sandbox is not running (stopped or failed; ``details['state']`` says which)."""

    code, status, retryable = "sandbox_not_running", 409, False


class PayloadTooLarge(DSecError):
    """The request body is too large."""

    code, status, retryable = "payload_too_large", 413, False


class QuotaExceeded(DSecError):
    """A project quota would be exceeded; back off or free something."""

    code, status, retryable = "quota_exceeded", 429, True


class ResourceExhausted(DSecError):
    """The sandbox hit one of its own limits; ``details['limit']`` names it."""

    code, status, retryable = "resource_exhausted", 429, True


class RateLimited(DSecError):
    """Too many requests of one kind from this client; ``details['retryAfterMs']`` says when to retry."""

    code, status, retryable = "rate_limited", 429, True


class CapacityExhausted(DSecError):
    """No node has capacity for the sandbox now."""

    code, status, retryable = "capacity_exhausted", 503, True


class Unavailable(DSecError):
    """A component is down or the server cannot be reached; retry."""

    code, status, retryable = "unavailable", 503, True


class DeadlineExceeded(DSecError):
    """The operation ran past its deadline (the server's, or the call's ``timeout``)."""

    code, status, retryable = "deadline_exceeded", 504, True


class Aborted(DSecError):
    """The caller cancelled the operation."""

    code, status, retryable = "aborted", 499, True


class Internal(DSecError):
    """A bug or a host fault; see the server's logs."""

    code, status, retryable = "internal", 500, True


#: Every stable code and its exception class.
ERROR_CLASSES: Dict[str, Type[DSecError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        SandboxNotFound,
        ImageNotFound,
        CommandNotFound,
        VolumeNotFound,
        Conflict,
        SandboxNotRunning,
        VolumeInUse,
        PayloadTooLarge,
        QuotaExceeded,
        ResourceExhausted,
        RateLimited,
        CapacityExhausted,
        Unavailable,
        DeadlineExceeded,
        Aborted,
        Internal,
    )
}

# A server newer than this SDK may send a code it does not know: the status
# then picks the closest class, so `except NotFound` still works.
_BY_STATUS: Dict[int, Type[DSecError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: QuotaExceeded,
    499: Aborted,
    503: Unavailable,
    504: DeadlineExceeded,
}


def error_from_body(body: Any, status: int) -> DSecError:
    """The exception for an error answer ``{"error": {code, message, field?, details?}}``.

    A body that is not that shape (a proxy's HTML page, an empty body) still
    gives an error of the status's class, never a ``KeyError``.
    """
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        cls = _BY_STATUS.get(status, Internal if status >= 500 or status < 400 else DSecError)
        return cls(f"DSec answered HTTP {status}", status=status)
    code = str(err.get("code") or "internal")
    message = str(err.get("message") or code)
    field = err.get("field")
    details = err.get("details")
    known = ERROR_CLASSES.get(code)
    if known is not None:
        return known(
            message,
            field=field if isinstance(field, str) else None,
            details=details if isinstance(details, dict) else None,
        )
    return _BY_STATUS.get(status, Internal)(
        message,
        code=code,
        field=field if isinstance(field, str) else None,
        details=details if isinstance(details, dict) else None,
        status=status,
    )

"""What the framework providers (``dsec.integrations.inspect_ai``, ``.harbor``) share.

Private: the providers' public classes are the interface. Nothing here imports a framework.

- one ``DSecClient`` per (URL, key, event loop), opened on first use;
- image resolution: a prebuilt image name, or a Dockerfile context built through the API's
  Dockerfile builder (``client.build_image``), named by a digest of the context so the same
  context builds once;
- label values and paths made safe for the API (a name a task or tenant picks is sanitised,
  never passed through raw);
- sandbox-made directory trees copied to the host by listing them through the files API and
  writing only validated names under the caller's directory (the host never resolves a path
  the sandbox made, and never follows a link it made).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import posixpath
import re
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .. import DSecClient
from .._core import resolve_settings
from ..errors import DSecError, InvalidArgument, NotFound, SandboxNotFound, SandboxNotRunning, Unavailable
from ..models import FileInfo

#: The label every provider sandbox carries, with the framework's name as its value.
PROVIDER_LABEL = "dsec-provider"
#: Default TTL of a provider sandbox: the backstop when a framework never cleans up (seconds).
DEFAULT_TTL_SECONDS = 6 * 3600
#: Bounds on a build context hashed for an image name (a context is the caller's own files).
MAX_CONTEXT_FILES = 20_000
MAX_CONTEXT_BYTES = 2 * 1024**3
#: Bounds on a directory tree copied out of a sandbox (what a sandbox wrote: untrusted).
MAX_TREE_ENTRIES = 100_000
MAX_TREE_DEPTH = 64
MAX_TREE_BYTES = 4 * 1024**3

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._:/-]")
_IMAGE_NAME_BAD = re.compile(r"[^a-z0-9._-]")

#: Errors meaning the sandbox itself is gone or unreachable (not the command's fault).
SANDBOX_GONE = (SandboxNotFound, SandboxNotRunning, Unavailable)


def label_value(value: str) -> str:
    """``value`` as a DSec label value (``[A-Za-z0-9._:/-]``, at most 63 characters).

    Long values keep a digest of the whole so two different names never collide."""
    clean = _LABEL_VALUE_BAD.sub("-", value)
    if len(clean) <= 63 and clean == value:
        return clean
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{clean[:52]}-{digest}"


def image_name(prefix: str, name: str, digest: str) -> str:
    """A DSec image name for a built context: ``PREFIX-NAME-DIGEST12``, lowercase, bounded."""
    clean = _IMAGE_NAME_BAD.sub("-", name.lower()).strip("-._") or "env"
    return f"{prefix}-{clean[:40]}-{digest[:12]}"


def context_digest(context_dir: Path, dockerfile: str) -> str:
    """SHA-256 over a build context's names, modes, link texts and contents (bounded).

    Raises ``InvalidArgument`` for a context past ``MAX_CONTEXT_FILES`` / ``MAX_CONTEXT_BYTES``
    or without its Dockerfile."""
    root = Path(context_dir)
    if not (root / dockerfile).is_file():
        raise InvalidArgument(f"{root / dockerfile}: no Dockerfile in the build context", field="dockerfile")
    h = hashlib.sha256(f"dockerfile={dockerfile}\0".encode())
    count = 0
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            count += 1
            if count > MAX_CONTEXT_FILES:
                raise InvalidArgument(f"build context {root} has more than {MAX_CONTEXT_FILES} files", field="context")
            h.update(f"{rel}\0{st.st_mode:o}\0".encode("utf-8", "surrogateescape"))
            if stat_mod.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode("utf-8", "surrogateescape") + b"\0")
            elif stat_mod.S_ISREG(st.st_mode):
                total += st.st_size
                if total > MAX_CONTEXT_BYTES:
                    raise InvalidArgument(
                        f"build context {root} is larger than {MAX_CONTEXT_BYTES} bytes", field="context"
                    )
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()


@dataclass
class _ClientEntry:
    client: DSecClient
    users: int
    loop: asyncio.AbstractEventLoop


_clients: Dict[Tuple[str, Optional[str], int], _ClientEntry] = {}
_clients_lock: Dict[int, asyncio.Lock] = {}


async def acquire_client(url: Optional[str], api_key: Optional[str]) -> DSecClient:
    """A shared, opened client for (URL, key) on the running loop (``DSEC_URL`` /
    ``DSEC_API_KEY`` when not given). Pair with ``release_client``."""
    resolved_url, resolved_key = resolve_settings(url, api_key)
    loop = asyncio.get_running_loop()
    key = (resolved_url, resolved_key, id(loop))
    # Entries of loops that are gone (an id can be reused by a new loop) are dropped.
    for stale in [k for k, e in _clients.items() if e.loop.is_closed()]:
        del _clients[stale]
    for stale_id in [i for i in _clients_lock if i != id(loop) and not any(e.loop is loop for e in _clients.values())]:
        _clients_lock.pop(stale_id, None)
    lock = _clients_lock.setdefault(id(loop), asyncio.Lock())
    async with lock:
        entry = _clients.get(key)
        if entry is not None and entry.loop is loop:
            entry.users += 1
            return entry.client
        probe = DSecClient(resolved_url, resolved_key)
        try:
            await probe.open()
        except BaseException:
            await probe.close()
            raise
        _clients[key] = _ClientEntry(probe, 1, loop)
        return probe


async def release_client(client: DSecClient) -> None:
    """Drops one use of a client from ``acquire_client``; the last closes it."""
    for key, entry in list(_clients.items()):
        if entry.client is client:
            entry.users -= 1
            if entry.users <= 0:
                del _clients[key]
                await client.close()
            return
    await client.close()


async def build_context_image(
    client: Any,
    context_dir: Path,
    *,
    prefix: str,
    name: str,
    dockerfile: str = "Dockerfile",
    timeout: Optional[float] = None,
) -> str:
    """Builds a Dockerfile context with DSec's Dockerfile builder through the API
    (``client.build_image``) and returns the image name. The name carries a digest of the
    context, so an unchanged context is one image."""
    digest = await asyncio.get_running_loop().run_in_executor(None, context_digest, Path(context_dir), dockerfile)
    target = image_name(prefix, name, digest)
    build = getattr(client, "build_image", None)
    if build is None:
        raise InvalidArgument(
            "this dsec SDK has no build_image (the Dockerfile-builder API); pass a prebuilt image instead",
            field="image",
        )
    kwargs: Dict[str, Any] = {"name": target, "dockerfile": dockerfile}
    if timeout is not None:
        kwargs["timeout"] = timeout
    built = await build(str(context_dir), **kwargs)
    return str(built) if built else target


def resolve_path(workdir: str, path: str) -> str:
    """``path`` inside the sandbox, relative ones under ``workdir`` (a POSIX join; the server
    resolves it in the sandbox's own root, so ``..`` cannot leave it)."""
    if "\0" in path:
        raise InvalidArgument("a path cannot contain NUL", field="path")
    return posixpath.normpath(posixpath.join(workdir, path)) if path else workdir


async def stop_quietly(sandbox: Any) -> None:
    """Stops a sandbox; one already gone is fine."""
    try:
        await sandbox.stop()
    except (SandboxNotFound, SandboxNotRunning):
        pass


def _safe_component(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name and "\\" not in name


async def download_tree(files: Any, source_dir: str, target_dir: Path, *, user: Optional[str] = None) -> int:
    """Copies the directory ``source_dir`` of a sandbox into ``target_dir`` on the host.

    The tree is listed through the files API; only regular files and directories are copied
    (symlinks and special files are skipped: they are never followed, on either side), each
    name is checked to be one plain path component, and the walk is bounded
    (``MAX_TREE_ENTRIES``, ``MAX_TREE_DEPTH``, ``MAX_TREE_BYTES``: past one it raises
    ``PayloadTooLarge``). Returns the bytes copied."""
    from ..errors import PayloadTooLarge

    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    stack: List[Tuple[str, Path, int]] = [(source_dir.rstrip("/") or "/", target_dir, 0)]
    entries = 0
    total = 0
    while stack:
        remote, local, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise PayloadTooLarge(f"{remote}: deeper than {MAX_TREE_DEPTH} levels", field="source_dir")
        listing: List[FileInfo] = await files.list(remote, user=user)
        for entry in listing:
            entries += 1
            if entries > MAX_TREE_ENTRIES:
                raise PayloadTooLarge(f"{source_dir}: more than {MAX_TREE_ENTRIES} entries", field="source_dir")
            if not _safe_component(entry.name):
                continue
            child_remote = posixpath.join(remote, entry.name)
            child_local = local / entry.name
            if entry.type == "directory":
                if child_local.is_symlink() or (child_local.exists() and not child_local.is_dir()):
                    child_local.unlink()
                child_local.mkdir(exist_ok=True)
                stack.append((child_remote, child_local, depth + 1))
            elif entry.type == "file":
                total += entry.size
                if total > MAX_TREE_BYTES:
                    raise PayloadTooLarge(f"{source_dir}: more than {MAX_TREE_BYTES} bytes", field="source_dir")
                if child_local.is_dir() and not child_local.is_symlink():
                    raise IsADirectoryError(f"{child_local}: a directory is in the way of {child_remote}")
                await files.download(child_remote, child_local, user=user)
    return total


def is_gone(err: DSecError) -> bool:
    """The error says the sandbox is gone or unreachable."""
    return isinstance(err, SANDBOX_GONE) or (isinstance(err, NotFound) and err.field == "sandboxId")

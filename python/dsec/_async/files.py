"""Files inside a sandbox, resolved in the sandbox's own root (no symlink or
``..`` leaves it). Writes are atomic (a temp file renamed over the path);
contents stream both ways, so files of any size never sit whole in memory."""

from __future__ import annotations

import os
from typing import Any, AsyncIterable, AsyncIterator, Dict, List, Optional, Tuple, Union

from .._core import TRANSFER_TIMEOUT, compact, decode_json, or_default, segment
from ..errors import NotFound
from ..models import FileInfo, from_wire
from .transport import Transport

#: Bytes per chunk read from a local file for an upload.
UPLOAD_CHUNK_BYTES = 256 * 1024

#: What ``write`` accepts: text (UTF-8), bytes, or a stream of byte chunks.
FileContent = Union[str, bytes, bytearray, memoryview, AsyncIterable[bytes]]


class Files:
    """``sandbox.files``. Every call takes ``user``: who the operation runs as
    inside the sandbox (default the sandbox's ``init_user``). Raises
    ``NotFound``, ``PermissionDenied``, ``Conflict``, ``InvalidArgument``
    as the server says."""

    def __init__(self, http: Transport, sandbox_id: str, default_timeout: float) -> None:
        self._http = http
        self._path = f"/v1/sandboxes/{segment(sandbox_id)}/files"
        self._timeout = default_timeout

    async def read(self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None) -> bytes:
        """A file's contents."""
        chunks = [chunk async for chunk in self.read_stream(path, user=user, timeout=timeout)]
        return b"".join(chunks)

    async def read_text(
        self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None, encoding: str = "utf-8"
    ) -> str:
        """A file's contents as text."""
        return (await self.read(path, user=user, timeout=timeout)).decode(encoding)

    async def read_stream(
        self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None
    ) -> AsyncIterator[bytes]:
        """A file's contents as chunks, as they arrive (``NotFound`` & co. before the first)."""
        async with self._http.stream(
            "GET",
            self._path,
            params=_query(path=path, user=user),
            timeout=or_default(timeout, TRANSFER_TIMEOUT),
            retry_safe=True,
        ) as response:
            async for chunk in response.aiter_bytes():
                yield chunk

    async def write(
        self,
        path: str,
        data: FileContent,
        *,
        mode: Optional[int] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> FileInfo:
        """Replaces (or creates) a file atomically with ``data``. ``mode`` is
        the permission bits (``0o755``; default an existing file's, else 0o644)."""
        content = data.encode() if isinstance(data, str) else data
        if isinstance(content, (bytearray, memoryview)):
            content = bytes(content)
        async with self._http.stream(
            "PUT",
            self._path,
            params=_query(path=path, user=user, mode=None if mode is None else format(mode, "o")),
            content=content,
            headers={"content-type": "application/octet-stream"},
            timeout=or_default(timeout, TRANSFER_TIMEOUT),
            # Writing the same bytes twice leaves the same file.
            retry_safe=True,
        ) as response:
            return from_wire(FileInfo, decode_json(await response.aread(), response.status_code))

    async def upload(
        self,
        local_path: Union[str, "os.PathLike[str]"],
        remote_path: str,
        *,
        mode: Optional[int] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> FileInfo:
        """Uploads a local file of any size, streamed."""
        return await self.write(remote_path, _file_chunks(local_path), mode=mode, user=user, timeout=timeout)

    async def download(
        self,
        remote_path: str,
        local_path: Union[str, "os.PathLike[str]"],
        *,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> int:
        """Downloads a file to a local path, streamed into a temp file that is
        then renamed over it. Returns the number of bytes."""
        tmp = f"{os.fspath(local_path)}.dsec-part-{os.getpid()}"
        size = 0
        try:
            with open(tmp, "wb") as out:
                async for chunk in self.read_stream(remote_path, user=user, timeout=timeout):
                    out.write(chunk)
                    size += len(chunk)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size

    async def stat(self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None) -> FileInfo:
        """A file's metadata; does not follow a final symlink (``target`` says where it points)."""
        answer = await self._http.json(
            "GET",
            f"{self._path}/stat",
            params=_query(path=path, user=user),
            timeout=or_default(timeout, self._timeout),
            retry_safe=True,
        )
        return from_wire(FileInfo, answer)

    async def exists(self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        """Whether something is at ``path`` (a dangling symlink counts)."""
        try:
            await self.stat(path, user=user, timeout=timeout)
        except NotFound:
            return False
        return True

    async def list(self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None) -> List[FileInfo]:
        """A directory's entries, sorted by name."""
        answer = await self._http.json(
            "GET",
            f"{self._path}/list",
            params=_query(path=path, user=user),
            timeout=or_default(timeout, self._timeout),
            retry_safe=True,
        )
        return [from_wire(FileInfo, entry) for entry in answer["entries"]]

    async def mkdir(
        self,
        path: str,
        *,
        parents: bool = False,
        mode: Optional[int] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Creates a directory; ``parents`` makes missing parents too and accepts
        an existing directory. Raises ``Conflict`` when it exists otherwise."""
        await self._post("mkdir", {"path": path, "parents": parents or None, "mode": mode, "user": user}, timeout)

    async def remove(
        self, path: str, *, recursive: bool = False, user: Optional[str] = None, timeout: Optional[float] = None
    ) -> None:
        """Removes a file, a symlink, an empty directory, or with ``recursive`` a
        whole tree. A non-empty directory without ``recursive`` is ``Conflict``."""
        await self._post("remove", {"path": path, "recursive": recursive or None, "user": user}, timeout)

    async def rename(
        self,
        src: str,
        dst: str,
        *,
        overwrite: bool = False,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Renames (moves) a path; an existing ``dst`` is ``Conflict`` unless ``overwrite``."""
        body = {"from": src, "to": dst, "overwrite": overwrite or None, "user": user}
        await self._post("rename", body, timeout)

    async def _post(self, action: str, body: Dict[str, Any], timeout: Optional[float]) -> None:
        await self._http.json(
            "POST", f"{self._path}/{action}", body=compact(body), timeout=or_default(timeout, self._timeout)
        )


def _query(**params: Optional[str]) -> List[Tuple[str, str]]:
    return [(k, v) for k, v in params.items() if v is not None]


async def _file_chunks(path: Union[str, "os.PathLike[str]"]) -> AsyncIterator[bytes]:
    # Local disk reads are short and bounded by the chunk size: they run on
    # the event loop rather than pay a thread hop per chunk.
    with open(path, "rb") as f:
        while True:
            chunk = f.read(UPLOAD_CHUNK_BYTES)
            if not chunk:
                return
            yield chunk

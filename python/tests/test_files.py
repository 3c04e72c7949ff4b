"""Files: streamed reads and writes, metadata, directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import AsyncIterator

import pytest

import dsec

#: Big enough to take many chunks each way.
BIG_BYTES = 5 * 1024 * 1024 + 17


def pattern(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 2048  # 64 KiB


async def test_write_read_stat_list(sandbox: dsec.Sandbox) -> None:
    info = await sandbox.files.write("/tmp/a.txt", "héllo\n", mode=0o640)
    assert (info.name, info.path, info.type, info.size, info.mode) == ("a.txt", "/tmp/a.txt", "file", 7, 0o640)
    assert await sandbox.files.read("/tmp/a.txt") == "héllo\n".encode()
    assert await sandbox.files.read_text("/tmp/a.txt") == "héllo\n"
    await sandbox.files.write("/tmp/b.bin", bytes(range(256)))
    assert await sandbox.files.read("/tmp/b.bin") == bytes(range(256))

    stat = await sandbox.files.stat("/tmp/a.txt")
    assert stat.size == 7 and stat.uid == 0 and stat.mtime.tzinfo is not None
    names = [e.name for e in await sandbox.files.list("/tmp")]
    assert names == sorted(names) and {"a.txt", "b.bin"} <= set(names)
    assert await sandbox.files.exists("/tmp/a.txt")
    assert not await sandbox.files.exists("/tmp/nothing")
    # What the files API wrote, a command sees.
    assert (await sandbox.run_shell("cat /tmp/a.txt")).stdout == "héllo\n"


async def test_streamed_write_and_read_of_a_big_file(sandbox: dsec.Sandbox) -> None:
    chunks = [pattern(i) for i in range(BIG_BYTES // len(pattern(0)))]
    chunks.append(b"x" * (BIG_BYTES - sum(map(len, chunks))))

    async def produce() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    info = await sandbox.files.write("/tmp/big", produce())
    assert info.size == BIG_BYTES
    digest = hashlib.sha256()
    pieces = 0
    async for piece in sandbox.files.read_stream("/tmp/big"):
        digest.update(piece)
        pieces += 1
    assert digest.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert pieces > 1
    remote = await sandbox.run_shell("sha256sum /tmp/big")
    assert remote.stdout.split()[0] == digest.hexdigest()


async def test_upload_and_download(sandbox: dsec.Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(700_000))
    await sandbox.files.upload(local, "/tmp/up.bin", mode=0o755)
    assert (await sandbox.files.stat("/tmp/up.bin")).mode == 0o755
    back = tmp_path / "down.bin"
    assert await sandbox.files.download("/tmp/up.bin", back) == 700_000
    assert back.read_bytes() == local.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["down.bin", "up.bin"]


async def test_directories_rename_and_remove(sandbox: dsec.Sandbox) -> None:
    await sandbox.files.mkdir("/work/a/b", parents=True)
    await sandbox.files.mkdir("/work/a/b", parents=True)  # an existing directory is fine with parents
    with pytest.raises(dsec.Conflict):
        await sandbox.files.mkdir("/work/a")
    await sandbox.files.write("/work/a/b/f", "1")
    await sandbox.files.write("/work/g", "2")
    with pytest.raises(dsec.Conflict):
        await sandbox.files.rename("/work/g", "/work/a/b/f")
    await sandbox.files.rename("/work/g", "/work/a/b/f", overwrite=True)
    assert await sandbox.files.read_text("/work/a/b/f") == "2"
    with pytest.raises(dsec.Conflict):
        await sandbox.files.remove("/work/a")
    await sandbox.files.remove("/work/a", recursive=True)
    assert [e.name for e in await sandbox.files.list("/work")] == []


async def test_missing_files_are_not_found(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.NotFound) as err:
        await sandbox.files.read("/no/such/file")
    assert err.value.code == "not_found"
    with pytest.raises(dsec.NotFound):
        await sandbox.files.stat("/no/such/file")
    with pytest.raises(dsec.InvalidArgument):
        await sandbox.files.read("/tmp")  # a directory

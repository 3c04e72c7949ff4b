"""The display calls (issue 15) on the real edge: a container sandbox has no
screen, so both answer ``Unavailable``; the call's shape is checked before
any request. The full-VM path (a real screen) is tested end to end in
packages/edge-http/test/integration/vm-display.test.ts."""

from __future__ import annotations

import pytest

import dsec


async def test_a_container_has_no_display(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.Unavailable):
        await sandbox.screenshot()
    with pytest.raises(dsec.Unavailable):
        await sandbox.input(text="ls\n")
    with pytest.raises(dsec.Unavailable):
        await sandbox.input([{"type": "key", "key": "ret"}])


async def test_input_takes_events_or_text(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidArgument):
        await sandbox.input()
    with pytest.raises(dsec.InvalidArgument):
        await sandbox.input([{"type": "key", "key": "ret"}], text="x")
    with pytest.raises(dsec.InvalidArgument):
        await sandbox.input([{"type": "key", "key": "Bad Key"}])

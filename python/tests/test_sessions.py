"""Named shell sessions keep their state across calls."""

from __future__ import annotations

from typing import List

import dsec


async def test_cwd_and_variables_persist_across_calls(sandbox: dsec.Sandbox) -> None:
    session = sandbox.session("work", env={"START": "s"}, cwd="/tmp")
    first = await session.run("cd /etc && export SEEN=yes && X=1")
    assert (first.exit_code, first.session, first.shell_restarted, first.session_ended) == (0, "work", False, False)
    result = await session.run('echo "$(pwd) $SEEN $X $START"')
    assert result.stdout == "/etc yes 1 s\n"
    assert isinstance(result, dsec.SessionResult)

    # Another session does not share that state.
    other = await sandbox.session("other").run('echo "$(pwd) ${SEEN:-unset}"')
    assert other.stdout.endswith(" unset\n")

    infos = {s.name: s for s in await sandbox.list_sessions()}
    assert set(infos) == {"work", "other"}
    assert infos["work"].alive and infos["work"].calls == 2 and infos["work"].user == "root"

    await session.close()
    await session.close()  # closing twice is fine
    assert [s.name for s in await sandbox.list_sessions()] == ["other"]


async def test_a_session_line_streams_and_a_timeout_spares_the_session(sandbox: dsec.Sandbox) -> None:
    session = sandbox.session("s")
    await session.run("V=kept")
    out: List[str] = []
    streamed = await session.run("echo one; echo two >&2", on_stdout=out.append)
    assert "".join(out) == "one\n" and streamed.stderr == "two\n"

    events = []
    async with session.stream("echo three") as output:
        async for event in output:
            events.append(event)
    assert events == [dsec.OutputEvent("stdout", "three\n")]
    assert isinstance(output.result, dsec.SessionResult) and output.result.session == "s"

    timed_out = await session.run("sleep 30", timeout=0.5)
    assert timed_out.outcome == "timeout"
    assert (await session.run("echo $V")).stdout == "kept\n"


async def test_exit_ends_the_session_and_the_next_call_starts_a_new_one(sandbox: dsec.Sandbox) -> None:
    session = sandbox.session("ending")
    await session.run("Y=1")
    ended = await session.run("exit 4")
    assert ended.session_ended and ended.exit_code == 4
    fresh = await session.run('echo "${Y:-gone}"')
    assert fresh.stdout == "gone\n"

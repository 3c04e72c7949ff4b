"""Commands: one-shot, streamed (callbacks and iteration), background by ID."""

from __future__ import annotations

from typing import List

import pytest

import dsec
from dsec import OutputEvent


async def test_a_non_zero_exit_is_a_result_not_an_error(sandbox: dsec.Sandbox) -> None:
    result = await sandbox.run_shell("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.outcome, result.stdout, result.stderr) == (3, "exited", "out\n", "err\n")
    assert not result.ok
    assert result.command_id.startswith("cmd-")


async def test_exec_passes_argv_env_cwd_and_stdin_without_a_shell(sandbox: dsec.Sandbox) -> None:
    result = await sandbox.exec(
        ["sh", "-c", 'echo "$GREETING $(pwd)"; cat'], env={"GREETING": "hi"}, cwd="/tmp", stdin="from stdin"
    )
    assert result.stdout == "hi /tmp\nfrom stdin"
    # argv is passed as is: `$HOME` is an argument, not an expansion.
    assert (await sandbox.exec(["echo", "$HOME"])).stdout == "$HOME\n"
    with pytest.raises(dsec.InvalidArgument):
        await sandbox.exec("echo not argv")


async def test_callbacks_get_the_output_in_order_and_characters_whole(sandbox: dsec.Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    # The two bytes of "é" leave in two writes, so in two stream events.
    result = await sandbox.run_shell(
        r"printf 'a\303'; sleep 0.2; printf '\251b\n'; echo e1 >&2; echo c",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "aéb\nc\n"
    assert all("\ufffd" not in chunk for chunk in out)
    assert "".join(err) == "e1\n"
    assert result.stdout == "aéb\nc\n" and result.exit_code == 0


async def test_iterating_a_stream_yields_output_while_the_command_runs(sandbox: dsec.Sandbox) -> None:
    # The command waits for a file that the test writes only after it has
    # seen the first line: buffered output would never get there.
    script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second >&2"
    events: List[OutputEvent] = []
    async with sandbox.commands.stream(script, timeout=30) as output:
        async for event in output:
            events.append(event)
            if event.data == "first\n":
                await sandbox.files.write("/tmp/go", "")
    assert events == [OutputEvent("stdout", "first\n"), OutputEvent("stderr", "second\n")]
    assert output.result is not None and output.result.exit_code == 0
    with pytest.raises(RuntimeError):
        iter_again = output.__aiter__()
        await iter_again.__anext__()


async def test_a_command_past_its_timeout_is_killed(sandbox: dsec.Sandbox) -> None:
    result = await sandbox.run_shell("sleep 30", timeout=0.5)
    assert result.outcome == "timeout"


async def test_background_command_with_stdin_wait_and_replayed_output(sandbox: dsec.Sandbox) -> None:
    handle = await sandbox.commands.start("cat; echo done", stdin_open=True)
    assert handle.info is not None and handle.info.state == "running" and handle.info.background
    assert await handle.send_stdin("hello ") == 6
    assert await handle.send_stdin(b"world\n") == 6
    await handle.close_stdin()
    result = await handle.wait(timeout=20)
    assert (result.exit_code, result.stdout) == (0, "hello world\ndone\n")

    again = await sandbox.commands.get(handle.id)
    assert again.info is not None and again.info.state == "finished"
    assert again.info.result is not None and again.info.result.stdout == "hello world\ndone\n"
    chunks: List[str] = []
    replayed = await again.output(on_stdout=chunks.append)
    assert "".join(chunks) == "hello world\ndone\n" and replayed.exit_code == 0
    assert handle.id in [c.command_id for c in await sandbox.commands.list()]


async def test_a_killed_background_command_ends_killed(sandbox: dsec.Sandbox) -> None:
    handle = await sandbox.commands.start(["sleep", "300"])
    with pytest.raises(dsec.DeadlineExceeded):
        await handle.wait(timeout=0.2)
    await handle.kill()
    result = await handle.wait(timeout=20)
    assert result.outcome == "killed"


async def test_a_signal_reaches_the_process_group(sandbox: dsec.Sandbox) -> None:
    handle = await sandbox.commands.start(
        "trap 'echo got-term; exit 7' TERM; touch /tmp/trapped; while true; do sleep 0.05; done"
    )
    # The trap must be set before the signal arrives.
    waited = await sandbox.run_shell("while [ ! -e /tmp/trapped ]; do sleep 0.05; done", timeout=20)
    assert waited.outcome == "exited"
    await handle.signal("SIGTERM")
    result = await handle.wait(timeout=20)
    assert (result.exit_code, result.stdout) == (7, "got-term\n")


async def test_a_request_id_runs_a_command_once(sandbox: dsec.Sandbox) -> None:
    first = await sandbox.run_shell("echo x >> /tmp/once; cat /tmp/once", request_id="py-once-1")
    second = await sandbox.run_shell("echo x >> /tmp/once; cat /tmp/once", request_id="py-once-1")
    assert first.command_id == second.command_id
    assert second.stdout == "x\n"


async def test_unknown_command_is_command_not_found(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.CommandNotFound) as err:
        await sandbox.commands.get("cmd-doesnotexist")
    assert isinstance(err.value, dsec.NotFound) and err.value.status == 404

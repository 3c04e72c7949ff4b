"""Replacement for SWE-ReX's tests/conftest.py: the same fixtures, backed by DSec.

``remote_runtime`` is a DSecRuntime (through DSecDeployment) on a sandbox of $SWEREX_DSEC_IMAGE
at $DSEC_URL, instead of RemoteRuntime on a local swerex server. The test modules run unmodified.
"""

import os

import pytest

from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command, CreateBashSessionRequest

from dsec.integrations.swerex import DSecDeployment, SWEREX_INSTALLED

assert SWEREX_INSTALLED, "the provider must use swerex's own classes here"


@pytest.fixture
async def remote_runtime():
    deployment = DSecDeployment(
        os.environ["SWEREX_DSEC_IMAGE"], ttl=600, session_shell=os.environ.get("SWEREX_DSEC_SHELL", "/bin/bash")
    )
    await deployment.start()
    try:
        yield deployment.runtime
    finally:
        await deployment.stop()


@pytest.fixture
async def runtime_with_default_session(remote_runtime):
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        if "default" in remote_runtime.sessions:
            await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5

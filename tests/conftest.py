"""Shared fixtures: anyio backends (asyncio in debug mode, trio); the ``opd_stream``
logger's state restored after every test (the CLI's ``configure_logging`` changes it); the
isolated environment of the command tests (``cli_env``); an aiohttp ``session`` and SGLang's
``api_types`` module for the mock server tests. Shared helpers: ``support/``.

A suite started as a background job of a non-interactive shell (``cmd &``, ``nohup``)
inherits SIGINT ignored, and so would every process a test starts: the tests that press
Ctrl-C on a command or a host would wait in vain. The suite's process takes Python's own
handler back (a caught signal is the default again in a child), as a terminal gives it."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(autouse=True)
def _restore_opd_stream_logger() -> Iterator[None]:
    logger = logging.getLogger("opd_stream")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.level, logger.propagate = saved[1], saved[2]


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests of the commands (``pytestmark = pytest.mark.usefixtures("cli_env")``): no
    ``OPD_STREAM_*`` variable of the outer environment, the KL on the CPU, structlog's
    configuration restored afterwards (``support.cli.isolate_cli``)."""
    from support.cli import isolate_cli  # the command's modules load only where used

    yield from isolate_cli(monkeypatch)


@pytest.fixture
async def session() -> AsyncIterator[Any]:
    """An ``aiohttp.ClientSession`` for talking to the mock servers (asyncio tests)."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture(scope="module")
def api_types() -> ModuleType:
    """SGLang's contract module ``api_types.py`` (``support.sglang_api``; fails if missing)."""
    from support.sglang_api import load_sglang_api_types

    return load_sglang_api_types()

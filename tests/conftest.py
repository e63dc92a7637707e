"""Shared fixtures: anyio backends (asyncio in debug mode, trio); the ``opd_stream``
logger's state restored after every test (the CLI's ``configure_logging`` changes it); the
isolated environment of the command tests (``cli_env``). Shared helpers: ``support/``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest


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

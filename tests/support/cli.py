"""Running the ``opd-stream`` command (and ``python -m`` entry points) from a test.

* :func:`run_cli`: ``opd_stream.cli._main.main(argv)`` in-process, in a worker thread (the
  command runs its own event loop; the test's loop keeps serving the mock servers). Bind the
  leading words with :func:`functools.partial`, e.g.
  ``partial(run_cli, "--log-level", "warning", "score")``.
* :func:`run_module`: ``python -m MODULE ARGS`` as a subprocess from the checkout's root
  (so ``bench`` and this checkout's ``opd_stream`` are the ones imported), with
  :func:`subprocess_env`.
* :func:`subprocess_env`: the test process's environment without any ``OPD_STREAM_*``
  variable, this checkout first on ``PYTHONPATH``, plus ``extra``.
* :func:`isolate_cli`: the body of the ``cli_env`` fixture (``tests/conftest.py``): no
  ``OPD_STREAM_*`` variable of the outer environment, the KL on the CPU, and structlog's
  configuration (which ``main`` changes) restored afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import structlog

from opd_stream.cli._main import main

__all__ = (
    "CONSOLE_SCRIPT",
    "ROOT",
    "isolate_cli",
    "run_cli",
    "run_module",
    "subprocess_env",
)

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root (``tests/`` and ``bench/`` lie below it)."""

CONSOLE_SCRIPT = Path(sys.executable).with_name("opd-stream")
"""The installed console script, next to the interpreter running the tests."""


async def run_cli(*argv: str) -> int:
    """``opd-stream ARGV`` in-process, in a worker thread; its exit code."""
    code: int = await anyio.to_thread.run_sync(main, list(argv))
    return code


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment, no ``OPD_STREAM_*`` variable, ``ROOT`` first on
    ``PYTHONPATH``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPD_STREAM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_module(
    module: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` from ``ROOT`` (output captured as text, no check)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
        env=subprocess_env() if env is None else env,
    )


def isolate_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ``OPD_STREAM_*`` variable of the outer environment, ``OPD_STREAM_KL_DEVICE=cpu``;
    structlog's configuration restored after the test (``main()`` configures it)."""
    for var in list(os.environ):
        if var.startswith("OPD_STREAM_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("OPD_STREAM_KL_DEVICE", "cpu")
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)

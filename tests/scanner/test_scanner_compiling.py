"""The process that compiles the kernels apart (``opd_stream.scanner._loader``): one at a
time per process, never dropped while it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opd_stream.scanner import _loader


def test_a_compile_still_running_after_a_settle_is_waited_for_not_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a command settled (stopped waiting) while the compiling process ran; the next stream
    # of the process waits for that one: a second would only queue on its lock, and the
    # first's Popen would be dropped while it runs ("subprocess ... is still running")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started: list[object] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> object:
        started.append(args)
        return real_popen(*args, **kwargs)  # type: ignore[call-overload]

    try:
        monkeypatch.setattr(_loader, "_compiling", running)
        monkeypatch.setattr(_loader.subprocess, "Popen", popen)
        _loader._exiting.set()  # (the wait stops at once: a settle)
        try:
            assert _loader._compile_elsewhere() is False
        finally:
            _loader._exiting.clear()
        assert started == [] and _loader._compiling is running
    finally:
        running.kill()
        running.wait()


def test_a_compile_that_has_ended_is_started_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    started: list[object] = []

    class Fake:
        pid = -1
        returncode = 0

    def popen(*args: object, **kwargs: object) -> object:
        started.append(args)
        return Fake()

    monkeypatch.setattr(_loader, "_compiling", ended)
    monkeypatch.setattr(_loader.subprocess, "Popen", popen)
    assert _loader._compile_elsewhere() is True
    assert len(started) == 1 and isinstance(_loader._compiling, Fake)

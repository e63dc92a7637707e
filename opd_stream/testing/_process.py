"""Stopping a server subprocess started by the testing tools (mock servers, sglang-router)."""

from __future__ import annotations

import subprocess

__all__ = ("stop_process",)


def stop_process(proc: subprocess.Popen[bytes], *, terminate: bool = True) -> None:
    """Stop ``proc`` if it still runs (SIGTERM, or SIGKILL when ``terminate`` is False; a
    process that outlives 10 s is killed), reap it, and close its stdout pipe."""
    if proc.poll() is None:
        if terminate:
            proc.terminate()
        else:
            proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()

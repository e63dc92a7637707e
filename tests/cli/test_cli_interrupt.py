"""A command's Ctrl-C wakes its event loop wherever the signal lands (``cli/_wakeup.py``).

Each case runs a script in a process of its own: signal handlers and the wakeup fd are
the process's. The signal is sent to a thread other than the main one, while the loop
sleeps on a 600 s timer; without the wakeup fd the command would sleep that long (checked
by hand: a plain ``anyio.run`` of the same coroutine does).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = """
import signal, socket, sys, threading, time
import anyio
from opd_stream.cli._main import _run

a, b = socket.socketpair()  # a wakeup fd of the script's own, for the cases that set one
b.setblocking(False)
own = b.fileno()
"""


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "host.py"
    path.write_text(_PRELUDE + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,  # a hang is a failure; never reached when it works
        check=False,
    )


def test_a_ctrl_c_that_lands_in_another_thread_interrupts_a_sleeping_command(
    tmp_path: Path,
) -> None:
    proc = _script(
        tmp_path,
        """
        def kick():
            time.sleep(0.2)  # the loop is asleep by now (or soon: either way it must wake)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this thread's

        async def command(_):
            threading.Thread(target=kick).start()
            await anyio.sleep(600)
            return 0

        sys.exit(_run("x", command, None))
        """,
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "opd-stream x: interrupted\n"


def test_the_command_leaves_no_wakeup_fd_behind(tmp_path: Path) -> None:
    proc = _script(
        tmp_path,
        """
        async def command(_):
            return 0

        assert _run("x", command, None) == 0
        print(signal.set_wakeup_fd(-1))
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "-1\n"


def test_a_wakeup_fd_set_before_is_left_to_its_owner(tmp_path: Path) -> None:
    proc = _script(
        tmp_path,
        """
        signal.set_wakeup_fd(own)

        async def command(_):
            print(signal.set_wakeup_fd(own) == own)  # still the owner's inside
            return 0

        assert _run("x", command, None) == 0
        print(signal.set_wakeup_fd(-1) == own)  # and after
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_a_wakeup_fd_set_during_the_command_is_left_to_whoever_set_it(tmp_path: Path) -> None:
    proc = _script(
        tmp_path,
        """
        async def command(_):
            signal.set_wakeup_fd(own)  # e.g. a signal handler the command added
            return 0

        assert _run("x", command, None) == 0
        print(signal.set_wakeup_fd(-1) == own)
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]

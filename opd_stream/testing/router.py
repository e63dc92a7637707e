"""sglang-router (PyPI ``sglang-router``, SGLang's Rust load balancer) as a local subprocess,
for tests and benchmarks of fleets behind a router.

::

    with SGLangRouter([worker_a, worker_b]) as url:   # round robin, on 127.0.0.1
        ...

The router runs as ``python -m sglang_router.launch_router`` on 127.0.0.1 with its metrics
server on its own free port (the default 29000 would clash between routers), and with
``HF_HUB_OFFLINE=1`` so that it never looks for a tokenizer on a model hub (mock workers
should 404 their info endpoints: ``MockOptions(info_endpoints=False)``). Nothing leaves
127.0.0.1. The package is optional: :class:`RouterUnavailable` says so when it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from collections.abc import Sequence

from ._process import stop_process

__all__ = ("RouterUnavailable", "SGLangRouter")


class RouterUnavailable(RuntimeError):
    """sglang-router is not installed, or the router did not start."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SGLangRouter:
    """A router in front of ``workers`` (base URLs) while the ``with`` block runs.

    Args:
        workers: the worker base URLs it starts with.
        policy: the router's ``--policy`` (``round_robin`` spreads ``input_ids``-only
            requests; the router's default ``cache_aware`` sends them all to one worker).
        startup_timeout_s: how long to wait for its ``/health``.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        policy: str = "round_robin",
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.workers = list(workers)
        self.policy = policy
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        if importlib.util.find_spec("sglang_router") is None:
            raise RouterUnavailable(
                "sglang-router is not installed (pip install sglang-router==0.3.2)"
            )
        port = _free_port()
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "NO_PROXY": "*",
        }
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *self.workers,
            "--policy",
            self.policy,
            "--log-level",
            "warn",
            "--prometheus-port",
            str(_free_port()),
        ]
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        return self.url

    def _wait_healthy(self) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RouterUnavailable(
                    f"sglang-router exited with {proc.returncode}: {out[-2000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        raise RouterUnavailable(
            f"sglang-router did not answer /health within {self.startup_timeout_s} s"
        )

    @property
    def pid(self) -> int | None:
        """The router process's id while it runs (benchmarks leave its CPU out)."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

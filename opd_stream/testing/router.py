"""SGLang's gateways as local subprocesses, for tests and benchmarks of fleets behind one:
smg (PyPI ``smg``, :class:`SMGGateway`) and the older sglang-router 0.3.2 (PyPI
``sglang-router``, :class:`SGLangRouter`)::

    with SGLangRouter([worker_a, worker_b]) as url:   # round robin, on 127.0.0.1
        ...

Each runs as ``python -m <package>.launch_router`` on 127.0.0.1, its metrics server on a
free port of its own, with ``HF_HUB_OFFLINE=1`` (mock workers for sglang-router should 404
their info endpoints: ``MockOptions(info_endpoints=False)``; smg needs them). Nothing leaves
127.0.0.1. The packages are optional: :class:`RouterUnavailable` says when one is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO

from ._process import stop_process

__all__ = ("RouterUnavailable", "SGLangRouter", "SMGGateway")


class RouterUnavailable(RuntimeError):
    """The gateway (smg or sglang-router) is not installed, or did not start."""


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
        extra_args: more command-line flags.
    """

    #: the module run with ``python -m``, the package it needs, and how messages name it
    module = "sglang_router.launch_router"
    package = "sglang_router"
    name = "sglang-router"
    install = "pip install sglang-router==0.3.2"

    def __init__(
        self,
        workers: Sequence[str],
        *,
        policy: str = "round_robin",
        startup_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workers = list(workers)
        self.policy = policy
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args)
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def _argv(self, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            self.module,
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
            *self._metrics_args(),
            *self.extra_args,
        ]

    def _metrics_args(self) -> list[str]:
        """Its metrics listener on loopback, on a free port (unless the extra arguments
        place it): by default the gateway would listen on every interface."""
        if "--prometheus-port" in self.extra_args:
            return []
        return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]

    def __enter__(self) -> str:
        if importlib.util.find_spec(self.package) is None:
            raise RouterUnavailable(f"{self.name} is not installed ({self.install})")
        port = _free_port()
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "NO_PROXY": "*",
        }
        # its log goes to a file: a pipe nobody reads would stall it once full
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            self._argv(port), stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self.url

    def _output(self) -> str:
        log = self._log
        if log is None:
            return ""
        log.seek(0)
        return log.read()[-2000:].decode(errors="replace")

    def _wait_ready(self) -> None:
        self._wait_until(lambda: _get(self.url + "/health") is not None, "answer /health")

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RouterUnavailable(
                    f"{self.name} exited with {proc.returncode}: {self._output()}"
                )
            if ready():
                return
            time.sleep(0.1)
        raise RouterUnavailable(
            f"{self.name} did not {what} within {self.startup_timeout_s} s: {self._output()}"
        )

    @property
    def pid(self) -> int | None:
        """The router process's id while it runs (benchmarks leave its CPU out)."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc)
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()


class SMGGateway(SGLangRouter):
    """smg (PyPI ``smg``, SGLang's model gateway, sglang-router's successor) in front of
    ``workers`` while the ``with`` block runs; ready once it lists every worker healthy.

    smg registers a worker only after reading its ``/server_info`` (or ``/v1/models``,
    ``/version``): mock workers keep their info endpoints on, whose ``model_path`` is a
    local path (no model hub is asked).

    Args:
        workers: the worker base URLs it starts with (empty: none; add some later through
            ``POST /workers``).
        policy: smg's ``--policy`` (its default ``cache_aware``; ``manual`` pins each
            ``X-SMG-Routing-Key`` to a worker).
        enable_rl: ``--enable-rl``: mounts ``/v1/rl/workers`` (and the RL control plane).
        startup_timeout_s, extra_args: as for :class:`SGLangRouter`.
    """

    module = "smg.launch_router"
    package = "smg"
    name = "smg"
    install = "pip install smg==1.13.0"

    def __init__(
        self,
        workers: Sequence[str],
        *,
        policy: str = "round_robin",
        enable_rl: bool = False,
        startup_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        # smg waits out in-flight requests for 5 s when told to stop (SIGTERM), even with
        # none in flight; the ``with`` block has ended, so it stops at once
        extra = ["--shutdown-grace-period-secs", "0", *extra_args]
        if enable_rl:
            extra.insert(0, "--enable-rl")
        super().__init__(
            workers, policy=policy, startup_timeout_s=startup_timeout_s, extra_args=extra
        )

    def _wait_ready(self) -> None:
        super()._wait_ready()
        want = set(self.workers)

        def registered() -> bool:
            body = _get(self.url + "/workers")
            if body is None:
                return False
            listed = json.loads(body).get("workers", [])
            return want <= {w.get("url") for w in listed if w.get("is_healthy")}

        self._wait_until(registered, "list every worker healthy")


def _get(url: str) -> bytes | None:
    """The body of a 200 answer to ``GET url``, or ``None``."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            body: bytes = resp.read()
            return body if resp.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None

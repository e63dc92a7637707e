"""Starting mock servers: in-process replicas (:func:`serve_mock`) or a real subprocess
(:class:`MockProcess`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from .._process import stop_process
from ._app import MockServer
from ._bytemodel import ByteModel
from ._model import Role
from ._options import CLI_VOCAB_SIZE, MockOptions
from ._stats import MockStats

__all__ = ("MockCluster", "MockProcess", "options_to_argv", "serve_mock")


class MockCluster:
    """Replicas of one logical mock server (same role and seed), started by :func:`serve_mock`."""

    def __init__(self, servers: list[MockServer]) -> None:
        self.servers = servers

    @property
    def urls(self) -> list[str]:
        """Base URLs of the replicas, e.g. ``["http://127.0.0.1:40123"]``."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """The first replica's URL."""
        return self.servers[0].url

    @property
    def stats(self) -> list[MockStats]:
        """Live :class:`MockStats` of each replica."""
        return [s.stats for s in self.servers]

    @property
    def model(self) -> Any:
        """The (shared) :class:`MockModel` of the replicas."""
        return self.servers[0].model

    def set_options(self, index: int | None = None, **changes: Any) -> None:
        """Change options of one replica (``index``) or of all (``None``)."""
        targets = self.servers if index is None else [self.servers[index]]
        for s in targets:
            s.set_options(**changes)

    async def stop(self, index: int) -> None:
        """Stop replica ``index`` (its port refuses connections until :meth:`start`)."""
        await self.servers[index].stop()

    async def start(self, index: int) -> str:
        """Start replica ``index`` again on its port."""
        return await self.servers[index].start()

    async def restart(self, index: int) -> str:
        """Stop and start replica ``index`` on the same port."""
        return await self.servers[index].restart()


@asynccontextmanager
async def serve_mock(
    role: Role = "teacher",
    seed: int = 0,
    *,
    replicas: int = 1,
    options: MockOptions | None = None,
    host: str = "127.0.0.1",
    byte_model: ByteModel | None = None,
) -> AsyncIterator[MockCluster]:
    """Run ``replicas`` mock servers in this event loop (asyncio only) on free ports.

    Example::

        async with serve_mock(role="teacher", seed=1, replicas=2) as server:
            server.urls          # ["http://127.0.0.1:PORT1", "http://127.0.0.1:PORT2"]
            server.stats[0].generate_requests
            server.set_options(fault_http_503=0.5)

    ``byte_model``: the replicas answer sampled-token logprobs from this model over bytes
    (:class:`ByteModel`, for teachers with another tokenizer).
    """
    servers = [
        MockServer(role, seed, options, host=host, replica_index=i, byte_model=byte_model)
        for i in range(replicas)
    ]
    try:
        for s in servers:
            await s.start()
        yield MockCluster(servers)
    finally:
        for s in servers:
            await s.stop()


def options_to_argv(options: MockOptions) -> list[str]:
    """CLI flags reproducing the fields of ``options`` that differ from the command's
    defaults (``--vocab-size``'s is :data:`CLI_VOCAB_SIZE`, not ``MockOptions``'); any
    subclass of :class:`MockOptions` (the vLLM mock's) works the same way."""
    argv: list[str] = []
    default = msgspec.structs.replace(type(options)(), vocab_size=CLI_VOCAB_SIZE)
    for name in options.__struct_fields__:
        value = getattr(options, name)
        if value == getattr(default, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        elif value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv


class MockProcess:
    """The CLI (``python -m opd_stream.testing.mock_sglang``) as a real subprocess.

    :meth:`start` blocks until the ``listening on http://HOST:PORT`` line arrives (or raises).
    After :meth:`kill`, :meth:`start` relaunches on the same port. Usable as a (sync) context
    manager.

    Args:
        role, seed, options: as for :func:`serve_mock`.
        port: 0 picks a free port on the first start.
        per_position: shorthand for ``options.per_position``.
        extra_args: more CLI flags.
        startup_timeout: seconds to wait for the ``listening on`` line.
    """

    def __init__(
        self,
        role: Role = "teacher",
        seed: int = 0,
        *,
        options: MockOptions | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
    ) -> None:
        self.role: Role = role
        self.seed = seed
        self.options = options if options is not None else MockOptions()
        self.host = host
        self.port = port
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def argv(self) -> list[str]:
        """The command line of the subprocess."""
        return [
            sys.executable,
            "-m",
            "opd_stream.testing.mock_sglang",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--role",
            self.role,
            "--seed",
            str(self.seed),
            *options_to_argv(self.options),
            *self.extra_args,
        ]

    def start(self) -> str:
        """Launch and wait for readiness; returns the base URL."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        self.proc = proc
        line: list[bytes] = []

        def read() -> None:
            assert proc.stdout is not None
            line.append(proc.stdout.readline())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(self.startup_timeout)
        text = line[0].decode().strip() if line else ""
        if not text.startswith("listening on "):
            self.kill()
            raise RuntimeError(
                f"mock SGLang subprocess did not report readiness within "
                f"{self.startup_timeout} s (first line: {text[:200]!r})"
            )
        self.url = text[len("listening on ") :]
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    def kill(self) -> None:
        """SIGKILL the subprocess (connections are reset) and reap it."""
        self._end(terminate=False)

    def terminate(self) -> None:
        """SIGTERM the subprocess and reap it."""
        self._end(terminate=True)

    def restart(self) -> str:
        """Kill, then start again on the same port."""
        self.kill()
        return self.start()

    def _end(self, *, terminate: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, terminate=terminate)

    def __enter__(self) -> MockProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

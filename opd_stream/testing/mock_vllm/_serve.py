"""Starting mock vLLM servers: in-process replicas (:func:`serve_vllm_mock`) or the CLI as a
subprocess (:class:`VllmMockProcess`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..mock_sglang import ByteModel, MockCluster, MockOptions, MockProcess, Role
from ._app import VllmMockServer

__all__ = ("VllmMockProcess", "serve_vllm_mock")


@asynccontextmanager
async def serve_vllm_mock(
    role: Role = "teacher",
    seed: int = 0,
    *,
    replicas: int = 1,
    options: MockOptions | None = None,
    scale_out: bool = True,
    host: str = "127.0.0.1",
    byte_model: ByteModel | None = None,
) -> AsyncIterator[MockCluster]:
    """Run ``replicas`` mock vLLM servers in this event loop (asyncio only) on free ports.

    The same role, seed, options and tokens give the same values as the SGLang mock
    (:func:`~opd_stream.testing.mock_sglang.serve_mock`). ``options``: a
    :class:`VllmMockOptions` (or a plain :class:`MockOptions`: vLLM's flags take their
    defaults, ``--max-logprobs`` 20). ``scale_out=False``: a server started without
    ``--enable-scale-out`` (``/inference/v1/generate`` answers 403; ``/v1/completions``
    serves).

    Example::

        async with serve_vllm_mock(role="teacher", seed=1, replicas=2) as server:
            server.urls  # ["http://127.0.0.1:PORT1", "http://127.0.0.1:PORT2"]
            server.set_options(max_logprobs=5, fault_http_503=0.5)
    """
    servers = [
        VllmMockServer(
            role,
            seed,
            options,
            scale_out=scale_out,
            host=host,
            replica_index=i,
            byte_model=byte_model,
        )
        for i in range(replicas)
    ]
    try:
        for s in servers:
            await s.start()
        yield MockCluster(servers)  # type: ignore[arg-type]
    finally:
        for s in servers:
            await s.stop()


class VllmMockProcess(MockProcess):
    """The CLI (``python -m opd_stream.testing.mock_vllm``) as a real subprocess (see
    :class:`~opd_stream.testing.mock_sglang.MockProcess`; ``scale_out=False`` adds
    ``--no-scale-out``)."""

    def __init__(self, *args: Any, scale_out: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale_out = scale_out

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("opd_stream.testing.mock_sglang")] = "opd_stream.testing.mock_vllm"
        return argv if self.scale_out else [*argv, "--no-scale-out"]

"""Starting mock vLLM servers: in-process replicas (:func:`serve_vllm_mock`) or the CLI as a
subprocess (:class:`VllmMockProcess`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ..mock_sglang import ByteModel, MockCluster, MockOptions, MockProcess, Role
from ..mock_sglang._options import CLI_VOCAB_SIZE
from ._app import VllmMockServer, vllm_options
from ._options import VllmMockOptions

__all__ = ("VllmMockProcess", "serve_vllm_mock", "vllm_options_to_argv")


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


def vllm_options_to_argv(options: MockOptions) -> list[str]:
    """CLI flags reproducing the fields of ``options`` that differ from the command's
    defaults."""
    import msgspec

    opts = vllm_options(options)
    default = msgspec.structs.replace(VllmMockOptions(), vocab_size=CLI_VOCAB_SIZE)
    argv: list[str] = []
    for name in opts.__struct_fields__:
        value = getattr(opts, name)
        if value == getattr(default, name) or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


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
        # Replace the SGLang option flags by the vLLM ones (a superset).
        head = argv[: argv.index("--seed") + 2]
        extra: Sequence[str] = self.extra_args
        tail = vllm_options_to_argv(self.options)
        return [*head, *tail, *([] if self.scale_out else ["--no-scale-out"]), *extra]

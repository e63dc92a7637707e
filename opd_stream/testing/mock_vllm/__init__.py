"""A mock vLLM 0.34.0 server for tests, demos and benchmarks (independent of opd_stream's
client code; written from vLLM's own source).

* :func:`serve_vllm_mock`: in-process replicas (asyncio), yielding the SGLang mock's
  :class:`~opd_stream.testing.mock_sglang.MockCluster`.
* :class:`VllmMockProcess`: ``python -m opd_stream.testing.mock_vllm`` as a subprocess.
* :class:`VllmMockOptions`: the SGLang mock's :class:`MockOptions` plus vLLM's flags.

Endpoints: ``POST /inference/v1/generate`` (scale-out), ``POST /v1/completions``,
``GET /health``, ``GET /v1/models``, ``GET /version``, and ``/mock/*``. The same model,
seed and tokens give float32-identical values to the SGLang mock's.
"""

from __future__ import annotations

from ._app import VLLM_VERSION, VllmMockServer
from ._errors import SCALE_OUT_DISABLED
from ._options import VllmMockOptions
from ._serve import VllmMockProcess, serve_vllm_mock

__all__ = (
    "SCALE_OUT_DISABLED",
    "VLLM_VERSION",
    "VllmMockOptions",
    "VllmMockProcess",
    "VllmMockServer",
    "serve_vllm_mock",
)

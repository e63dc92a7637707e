"""A mock SGLang server for tests, demos and benchmarks (independent of opd_stream's client).

* :class:`MockModel`: the closed-form synthetic LM (also a numpy reference for other tests).
* :class:`ByteModel`: a closed-form LM over bytes, for teachers with another tokenizer.
* :func:`serve_mock`: in-process replicas (asyncio), yielding a :class:`MockCluster`.
* :class:`MockProcess`: the CLI ``python -m opd_stream.testing.mock_sglang`` as a subprocess.
* :class:`MockOptions`, :class:`MockStats`: runtime options (faults, latency, capacity) and
  counters.
"""

from __future__ import annotations

from ._app import MockServer
from ._bytemodel import ByteModel
from ._model import HeadRows, MockModel, Role
from ._options import FAULT_KINDS, FaultKind, MockOptions
from ._serve import MockCluster, MockProcess, options_to_argv, serve_mock
from ._stats import MockStats

__all__ = (
    "FAULT_KINDS",
    "ByteModel",
    "FaultKind",
    "HeadRows",
    "MockCluster",
    "MockModel",
    "MockOptions",
    "MockProcess",
    "MockServer",
    "MockStats",
    "Role",
    "options_to_argv",
    "serve_mock",
)

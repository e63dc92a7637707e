"""opd_stream: streaming, backpressured teacher scoring for on-policy distillation.

Feed student rollouts (:class:`Sample`) into an :class:`OPDStream`; it asks SGLang teacher
(and student) servers for token logprobs and yields per-token distillation signals
(:class:`ScoredSample`) or a :class:`SampleFailure` saying why, each input exactly once.

The top level holds what an application needs: the stream, its configuration, the sample
and result types, the error tree, the stats types and the transports (``MockTransport``
for tests). Building blocks live in documented submodules: :mod:`opd_stream.wire` (SGLang
payloads and answers), :mod:`opd_stream.kl` (the KL math, on your own arrays),
:mod:`opd_stream.testing` (mock SGLang servers, an in-process transport, sglang-router),
:mod:`opd_stream.integrations` (Miles, verl).

Inside, one room (subpackage) per part of the work; every room and module, and what each
holds: ``docs/internals.md``, "Module map".

Importing the package is cheap: each name is loaded from its module on first use (so the
``opd-stream`` command starts, and answers Ctrl-C, before any of them is loaded). It does
not import torch; an :class:`OPDStream` does as it is entered, in a worker thread (creating
one imports nothing heavy).
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:  # the names, for type checkers and readers; loaded lazily (__getattr__)
    __version__: str
    from ._errors import (
        CapabilityError,
        ConfigError,
        ConnectionFailed,
        DeadlineExceeded,
        InvalidSampleError,
        MalformedResponseError,
        MisalignedResponseError,
        MissingLogprobError,
        OPDStreamError,
        ProtocolError,
        ResponseTooLarge,
        RoutingError,
        ServerAbortError,
        ServerError,
        ServerHTTPError,
        WeightVersionChanged,
    )
    from ._logging import configure_logging
    from ._sample import Candidates, Sample, SampleFailure, ScoredSample, TokenAlignment
    from ._stats import ChannelStats, KLStageStats, StreamStats
    from ._stream import OPDStream, Results
    from .config._settings import Secret, StreamConfig
    from .fleet._ensemble import Ensemble
    from .fleet._probe import ProbeReport, ReplicaProbe
    from .fleet._records import EndpointStats, FleetState
    from .transport._budget import BudgetLease
    from .transport._native import AsyncioTransport
    from .transport._transports import (
        AiohttpTransport,
        MockTransport,
        Request,
        Response,
        Transport,
    )

_MODULES: dict[str, tuple[str, ...]] = {
    ".config._settings": ("Secret", "StreamConfig"),
    ".fleet._ensemble": ("Ensemble",),
    "._errors": (
        "CapabilityError",
        "ConfigError",
        "ConnectionFailed",
        "DeadlineExceeded",
        "InvalidSampleError",
        "MalformedResponseError",
        "MisalignedResponseError",
        "MissingLogprobError",
        "OPDStreamError",
        "ProtocolError",
        "ResponseTooLarge",
        "RoutingError",
        "ServerAbortError",
        "ServerError",
        "ServerHTTPError",
        "WeightVersionChanged",
    ),
    "._logging": ("configure_logging",),
    ".fleet._probe": ("ProbeReport", "ReplicaProbe"),
    "._sample": ("Candidates", "Sample", "SampleFailure", "ScoredSample", "TokenAlignment"),
    "._stats": ("ChannelStats", "KLStageStats", "StreamStats"),
    ".fleet._records": ("EndpointStats", "FleetState"),
    "._stream": ("OPDStream", "Results"),
    ".transport._budget": ("BudgetLease",),
    ".transport._native": ("AsyncioTransport",),
    ".transport._transports": (
        "AiohttpTransport",
        "MockTransport",
        "Request",
        "Response",
        "Transport",
    ),
}
_SOURCE = {name: module for module, names in _MODULES.items() for name in names}


def _version() -> str:
    import importlib.metadata

    try:  # the one place the version lives is pyproject.toml
        return importlib.metadata.version("opd-stream")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover  (never installed)
        return "0+unknown"


def __getattr__(name: str) -> _typing.Any:
    """A public name (``__version__`` included), loaded on first use, then a plain
    attribute."""
    if name == "__version__":
        value: _typing.Any = _version()
    else:
        module = _SOURCE.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCE, "__version__"})


__all__ = [
    "__version__",
    "AiohttpTransport",
    "AsyncioTransport",
    "BudgetLease",
    "Candidates",
    "CapabilityError",
    "ChannelStats",
    "ConfigError",
    "configure_logging",
    "ConnectionFailed",
    "DeadlineExceeded",
    "EndpointStats",
    "Ensemble",
    "FleetState",
    "InvalidSampleError",
    "KLStageStats",
    "MalformedResponseError",
    "MisalignedResponseError",
    "MissingLogprobError",
    "MockTransport",
    "OPDStream",
    "OPDStreamError",
    "ProbeReport",
    "ProtocolError",
    "ReplicaProbe",
    "Request",
    "Response",
    "ResponseTooLarge",
    "Results",
    "RoutingError",
    "Sample",
    "SampleFailure",
    "ScoredSample",
    "Secret",
    "ServerAbortError",
    "ServerError",
    "ServerHTTPError",
    "StreamConfig",
    "StreamStats",
    "TokenAlignment",
    "Transport",
    "WeightVersionChanged",
]

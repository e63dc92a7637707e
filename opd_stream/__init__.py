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

Importing the package does not import torch; :class:`OPDStream` does when it is created.
"""

from __future__ import annotations

import importlib.metadata as _metadata

from ._config import Secret, StreamConfig
from ._ensemble import Ensemble
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
)
from ._logging import configure_logging
from ._sample import Candidates, Sample, SampleFailure, ScoredSample
from ._stats import ChannelStats, EndpointStats, FleetState, KLStageStats, StreamStats
from ._stream import OPDStream, Results
from ._transport import AiohttpTransport, MockTransport, Response, Transport

try:  # the one place the version lives is pyproject.toml
    __version__ = _metadata.version("opd-stream")
except _metadata.PackageNotFoundError:  # pragma: no cover  (a source tree that was never installed)
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "AiohttpTransport",
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
    "ProtocolError",
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
    "Transport",
]

"""opd_stream: streaming, backpressured teacher scoring for on-policy distillation.

Feed student rollouts (:class:`Sample`) into an :class:`OPDStream`; it asks SGLang teacher
(and student) servers for token logprobs and yields per-token distillation signals
(:class:`ScoredSample`) or a :class:`SampleFailure` saying why, each input exactly once.

Importing the package does not import torch: the KL functions and their tensor types
(:func:`topk_reverse_kl`, :func:`sampled_reverse_kl`, :class:`TopKBatch`,
:class:`TopKResult`) load it on first access, and :class:`OPDStream` when it is created.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import typing as _typing

from ._config import Secret, StreamConfig, render_config_table, resolve_kl_device
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
from ._kltypes import LOGPROB_FLOOR, STRATEGIES, WEIGHT_MODES, Strategy, WeightMode
from ._logging import configure_logging
from ._retry import RetryPolicy
from ._router import TeacherRouter, normalize_server_url, parse_teacher_urls
from ._sample import Candidates, Sample, SampleFailure, ScoredSample
from ._stats import ChannelStats, EndpointStats, KLStageStats, StreamStats
from ._stream import OPDStream, Results
from ._transport import AiohttpTransport, MockTransport, Response, Transport
from ._wire import ScoreRequest, ScoreRows, build_score_payload, decode_score_response

if _typing.TYPE_CHECKING:
    from ._kl import TopKBatch, TopKResult, sampled_reverse_kl, topk_reverse_kl

try:  # the one place the version lives is pyproject.toml
    __version__ = _metadata.version("opd-stream")
except _metadata.PackageNotFoundError:  # pragma: no cover  (a source tree that was never installed)
    __version__ = "0+unknown"

# Names that need torch: loaded on first access (PEP 562), so `import opd_stream` does not.
_TORCH_NAMES = frozenset({"TopKBatch", "TopKResult", "sampled_reverse_kl", "topk_reverse_kl"})

if not _typing.TYPE_CHECKING:  # (type checkers see the imports above, and no catch-all)

    def __getattr__(name: str) -> _typing.Any:
        if name in _TORCH_NAMES:
            from . import _kl

            value = getattr(_kl, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | _TORCH_NAMES)


__all__ = [
    "__version__",
    "AiohttpTransport",
    "build_score_payload",
    "Candidates",
    "CapabilityError",
    "ChannelStats",
    "ConfigError",
    "configure_logging",
    "ConnectionFailed",
    "DeadlineExceeded",
    "decode_score_response",
    "EndpointStats",
    "InvalidSampleError",
    "KLStageStats",
    "LOGPROB_FLOOR",
    "MalformedResponseError",
    "MisalignedResponseError",
    "MissingLogprobError",
    "MockTransport",
    "normalize_server_url",
    "OPDStream",
    "OPDStreamError",
    "parse_teacher_urls",
    "ProtocolError",
    "render_config_table",
    "resolve_kl_device",
    "Response",
    "ResponseTooLarge",
    "Results",
    "RetryPolicy",
    "RoutingError",
    "Sample",
    "sampled_reverse_kl",
    "SampleFailure",
    "ScoredSample",
    "ScoreRequest",
    "ScoreRows",
    "Secret",
    "ServerAbortError",
    "ServerError",
    "ServerHTTPError",
    "STRATEGIES",
    "Strategy",
    "StreamConfig",
    "StreamStats",
    "TeacherRouter",
    "topk_reverse_kl",
    "TopKBatch",
    "TopKResult",
    "Transport",
    "WEIGHT_MODES",
    "WeightMode",
]

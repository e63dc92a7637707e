"""opd_stream: streaming, backpressured teacher scoring for on-policy distillation.

Feed student rollouts (:class:`Sample`) into an :class:`OPDStream`; it asks SGLang teacher
(and student) servers for token logprobs and yields per-token distillation signals
(:class:`ScoredSample`) or a :class:`SampleFailure` saying why, each input exactly once.
"""

from __future__ import annotations

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
from ._kl import (
    LOGPROB_FLOOR,
    STRATEGIES,
    WEIGHT_MODES,
    Strategy,
    TopKBatch,
    TopKResult,
    WeightMode,
    sampled_reverse_kl,
    topk_reverse_kl,
)
from ._logging import configure_logging
from ._retry import RetryPolicy
from ._router import TeacherRouter, normalize_server_url, parse_teacher_urls
from ._sample import Candidates, Sample, SampleFailure, ScoredSample
from ._stats import ChannelStats, EndpointStats, StreamStats
from ._stream import OPDStream, Results
from ._transport import AiohttpTransport, MockTransport, Response, Transport
from ._wire import ScoreRequest, ScoreRows, build_score_payload, decode_score_response

__version__ = "0.1.0"

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

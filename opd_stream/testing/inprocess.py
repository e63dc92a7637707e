"""The mock SGLang protocol without sockets: a :class:`~opd_stream.MockTransport` handler.

``InProcessSGLang`` answers ``/generate`` with the same request parsing, validation and
answer building as the aiohttp mock server (``mock_sglang``), but synchronously and
in-process, so pipeline logic can be tested on any anyio backend (trio included) and with
deterministic fault scripts. ``mock_transport`` routes base URLs to such servers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np

from ..transport._transports import MockTransport, Response
from .mock_sglang._answer import build_item_response
from .mock_sglang._bytemodel import ByteModel
from .mock_sglang._errors import RequestError
from .mock_sglang._model import MockModel, Role
from .mock_sglang._request import parse_generate_request
from .mock_sglang._signal import SignalState

__all__ = ("Fault", "InProcessSGLang", "mock_transport")

_encoder = msgspec.json.Encoder()

#: A fault script: called with the request number (1-based) of one server; returns a
#: ``Response`` to send instead of the real answer, or None to answer normally.
Fault = Callable[[int, bytes], Response | None]


class InProcessSGLang:
    """One mock SGLang server, answered in-process.

    Args:
        role: ``teacher`` or ``student`` (different models over the same candidates).
        seed: the model seed.
        per_position: ``patched`` honours ``token_ids_logprob_positions``; ``unpatched``
            silently ignores it, like every released SGLang.
        vocab_size: the model's vocabulary.
        fault: optional fault script (see :data:`Fault`).
        weight_versions: the ``meta_info.weight_version`` of each item answered, the last
            repeated (empty: ``"default"``); ``logprob_offset``, ``warm_drift``: as the
            aiohttp mock's options (:class:`~opd_stream.testing.mock_sglang.MockOptions`).
        byte_model: when set, the sampled tokens' logprobs come from this model over bytes
            (see :class:`~.mock_sglang.ByteModel`).
    """

    def __init__(
        self,
        role: Role = "teacher",
        seed: int = 0,
        *,
        per_position: Literal["patched", "unpatched"] = "patched",
        vocab_size: int = 151936,
        context_length: int = 1 << 20,
        fault: Fault | None = None,
        weight_versions: Sequence[str] = (),
        logprob_offset: float = 0.0,
        warm_drift: float = 0.0,
        byte_model: ByteModel | None = None,
    ) -> None:
        self.model = MockModel(role=role, seed=seed, vocab_size=vocab_size)
        self.byte_model = byte_model
        self.per_position = per_position
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.fault = fault
        self.requests = 0
        self.bodies: list[bytes] = []
        self._rng = np.random.default_rng(seed)
        self.weight_versions = tuple(weight_versions)
        self.logprob_offset = logprob_offset
        self.warm_drift = warm_drift
        self._signal = SignalState()

    def handle(self, method: str, path: str, body: bytes) -> Response:
        """Answer one HTTP request (``path`` is the part after the base URL)."""
        if path in ("/health", "/health_generate"):
            return Response(200, b"")
        if path != "/generate" or method not in ("POST", "PUT"):
            return Response(404, b'{"detail":"Not Found"}')
        self.requests += 1
        self.bodies.append(body)
        if self.fault is not None:
            injected = self.fault(self.requests, body)
            if injected is not None:
                return injected
        try:
            spec = parse_generate_request(
                body,
                vocab_size=self.vocab_size,
                context_length=self.context_length,
                per_position=self.per_position,
            )
        except RequestError as exc:
            return Response(exc.status, exc.body)
        objs = [
            build_item_response(
                self.model,
                item,
                rng=self._rng,
                weight_version=self._signal.weight_version("default", self.weight_versions),
                flat_input=spec.flat_input,
                flat_output=spec.flat_output,
                b64=spec.b64,
                shift=self._signal.shift(item, self.logprob_offset, self.warm_drift),
                byte_model=self.byte_model,
            )
            for item in spec.items
        ]
        return Response(200, _encoder.encode(objs if spec.is_batch else objs[0]))


def mock_transport(servers: Mapping[str, InProcessSGLang]) -> MockTransport:
    """A :class:`MockTransport` sending each request to the server whose base URL prefixes it."""
    bases = sorted(servers, key=len, reverse=True)

    def handler(method: str, url: str, body: bytes) -> Response:
        for base in bases:
            if url.startswith(base):
                return servers[base].handle(method, url[len(base) :].split("?")[0], body)
        return Response(502, b'{"error": {"message": "no such server"}}')

    return MockTransport(handler)

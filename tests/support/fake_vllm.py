"""A tiny fake vLLM 0.34.0 server for fleet tests (a :class:`MockTransport` handler).

Written from vLLM 0.34.0's own source (``sampling_params.py``, the scale-out and completions
routers), independently of ``opd_stream.wire``: it parses bodies with ``json`` and writes
the answers as vLLM does (``np.save`` + base64 for ``prompt_token_id_logprobs``;
prompt-logprob dicts keyed by id, -inf as -9999.0). Its values come from the SGLang mock's
model (:class:`~opd_stream.testing.inprocess.InProcessSGLang`'s), so the same tokens give
the same float32 numbers as an SGLang mock of that role and seed.

``scale_out``: ``/inference/v1/generate`` answers (else 403, vLLM's words); ``completions``:
``/v1/completions`` answers (else 404); ``/generate`` always answers 404 (vLLM has none).
``max_logprobs``: the server's ``--max-logprobs`` (a 400 in vLLM's words beyond it).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import anyio
import numpy as np

from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.transport._transports import Response

__all__ = ("FakeVLLM", "route")

DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return Response(status, json.dumps(body).encode())


def _npy_b64(values: np.ndarray) -> str:
    with io.BytesIO() as buf:
        np.save(buf, values, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


def _f(x: float) -> float:
    return -9999.0 if x == -np.inf else float(np.float32(x))


class FakeVLLM:
    def __init__(
        self,
        role: str = "teacher",
        seed: int = 1,
        *,
        scale_out: bool = True,
        completions: bool = True,
        max_logprobs: int = 20,
        checkpoints: int = 0,
    ) -> None:
        self.model = InProcessSGLang(role, seed).model  # type: ignore[arg-type]
        self.scale_out = scale_out
        self.completions = completions
        self.max_logprobs = max_logprobs
        self.checkpoints = checkpoints  # turns given to the loop before each answer
        self.paths: list[str] = []
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, method: str, path: str, body: bytes) -> Response:
        for _ in range(self.checkpoints):
            await anyio.lowlevel.checkpoint()
        self.paths.append(path)
        if path in ("/health", "/health_generate"):
            return Response(200, b"")
        if method != "POST":
            return Response(404, b'{"detail":"Not Found"}')
        if path == "/inference/v1/generate":
            if not self.scale_out:
                return _error(403, DISABLED)
            self.bodies.append(json.loads(body))
            return self._scale_out(self.bodies[-1])
        if path == "/v1/completions" and self.completions:
            self.bodies.append(json.loads(body))
            return self._completions(self.bodies[-1])
        return Response(404, b'{"detail":"Not Found"}')

    def _row(self, tokens: np.ndarray, j: int, k: int) -> dict[str, Any]:
        """Position ``j``'s dict: the actual token, then the top-k."""
        actual = int(tokens[j])
        lp = float(self.model.logprobs(tokens, [j], [[actual]])[0, 0])
        ids, lps = self.model.topk(tokens, [j], k) if k > 0 else (np.zeros((1, 0)), None)
        row = {str(actual): {"logprob": _f(lp), "rank": 1, "decoded_token": None}}
        for i in range(ids.shape[1]):
            assert lps is not None
            row[str(int(ids[0, i]))] = {
                "logprob": _f(float(lps[0, i])),
                "rank": i + 1,
                "decoded_token": None,
            }
        return row

    def _too_many(self, what: str, n: int) -> Response | None:
        if self.max_logprobs >= 0 and n > self.max_logprobs:
            return _error(
                400,
                f"Requested {n} token ids per row in {what}, which is greater than max "
                f"allowed: {self.max_logprobs}. Set max_logprobs (--max-logprobs) to at "
                f"least {n}.",
            )
        return None

    def _scale_out(self, body: dict[str, Any]) -> Response:
        tokens = np.asarray(body["token_ids"], dtype=np.int64)
        sp = body["sampling_params"]
        s = int(sp.get("prompt_logprob_start", 0))
        ids = np.asarray(sp["prompt_logprob_token_ids"], dtype=np.int64)
        k = int(sp.get("prompt_logprobs") or 0)
        refused = self._too_many("prompt_logprob_token_ids", ids.shape[1])
        if refused is None and k > self.max_logprobs >= 0:
            refused = _error(
                400,
                f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                f"{self.max_logprobs}",
            )
        if refused is not None:
            return refused
        length = tokens.shape[0]
        rows = length - 1 - s
        assert ids.shape[0] == rows, (ids.shape, rows)
        positions = np.arange(s + 1, length)
        values = self.model.logprobs(tokens, positions, np.maximum(ids, 0)).astype(np.float32)
        values[ids < 0] = -np.inf
        prompt_logprobs = None
        if k > 0:
            prompt_logprobs = [None] * (s + 1) + [self._row(tokens, j, k) for j in positions]
        answer = {
            "request_id": "r",
            "output_mode": "tokens",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "token_ids": [0],
                    "weight_versions": [{"version": "w1", "start": 0, "end": 1}],
                }
            ],
            "usage": {
                "prompt_tokens": length,
                "completion_tokens": 1,
                "total_tokens": length + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_id_logprobs": _npy_b64(values),
        }
        return Response(200, json.dumps(answer).encode())

    def _completions(self, body: dict[str, Any]) -> Response:
        tokens = np.asarray(body["prompt"], dtype=np.int64)
        k = int(body.get("prompt_logprobs") or 0)
        if k > self.max_logprobs >= 0:
            return _error(
                400,
                f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                f"{self.max_logprobs}",
            )
        rows = [None] + [self._row(tokens, j, k) for j in range(1, tokens.shape[0])]
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "finish_reason": "length",
                    "prompt_logprobs": rows,
                    "weight_versions": [{"version": "w1", "start": 0, "end": 1}],
                }
            ],
            "usage": {"prompt_tokens": tokens.shape[0], "total_tokens": 0, "completion_tokens": 1},
        }
        return Response(200, json.dumps(answer).encode())


def route(servers: dict[str, Any]) -> Any:
    """A MockTransport handler sending each request to the server whose base prefixes it
    (a server: a :class:`FakeVLLM` or an ``InProcessSGLang``)."""

    async def handler(method: str, url: str, body: bytes) -> Response:
        for base, server in servers.items():
            if url.startswith(base):
                got = server.handle(method, url[len(base) :].split("?")[0], body)
                return await got if isinstance(server, FakeVLLM) else got
        return Response(502, b'{"error": {"message": "no such server"}}')

    return handler

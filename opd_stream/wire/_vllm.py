"""vLLM teachers on the wire: which path each engine answers on, what it can score, and the
request bodies (vLLM 0.34.0: its ``sampling_params.py`` and scale-out / completions protocols).

Sans-IO. Two vLLM dialects (:data:`~opd_stream.wire._request.Engine`): ``"vllm"``
(``POST /inference/v1/generate``, ``vllm serve --enable-scale-out``), whose answer's
``prompt_token_id_logprobs`` is a base64 ``.npy`` float32 ``[R, cols]`` (more columns than
``ScoreRequest.max_ids`` are split into chunks of columns, each a whole request; chunk 0
carries the sampled token's column and the teacher's top-k; :func:`sends_id_columns`), and
``"vllm-completions"`` (``POST /v1/completions``, any vLLM: every prompt row, no
per-position ids). The bodies field by field: ``docs/design-notes.md``,
"opd_stream/wire/_vllm.py".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import msgspec
import numpy as np

from .._errors import CapabilityError
from ._request import Engine, Layout, ScoreRequest, column_chunks
from ._rows_json import rows_json

__all__ = (
    "ENGINE_PATHS",
    "build_vllm_bodies",
    "engine_problem",
    "sends_id_columns",
)

#: The path (below the server's URL) each engine scores on.
ENGINE_PATHS: Final[Mapping[Engine, str]] = MappingProxyType(
    {"sglang": "generate", "vllm": "inference/v1/generate", "vllm-completions": "v1/completions"}
)

_ENCODER = msgspec.json.Encoder()


def engine_problem(engine: Engine, *, top_k: int, ids: bool, max_logprobs: int = 0) -> str | None:
    """``None`` when a server of ``engine`` can answer a scoring request with ``top_k`` and
    (``ids``) per-position ids, else a sentence naming what the server lacks and what to change.

    ``max_logprobs``: the server's ``--max-logprobs`` where known (0 or -1: no cap); a
    server's own top-k (the teacher's or the student's) cannot be split, so a larger
    ``top_k`` is a problem (per-position ids can:
    :func:`~opd_stream.wire._request.column_chunks`).
    """
    if engine == "sglang":
        return None
    if engine == "vllm-completions" and ids:
        return (
            "vLLM's /v1/completions cannot score chosen ids per position: start vLLM with "
            "--enable-scale-out (POST /inference/v1/generate), or use a strategy that reads "
            "only the teacher's top-k"
        )
    if max_logprobs > 0 and top_k > max_logprobs:
        return (
            f"a top-{top_k} per position (prompt_logprobs {top_k}) needs vLLM's "
            f"--max-logprobs {top_k} or more (the server allows {max_logprobs})"
        )
    return None


def sends_id_columns(req: ScoreRequest) -> bool:
    """Whether a scale-out request sends ``prompt_logprob_token_ids`` (and reads the
    ``.npy`` answer): where ids are asked, or where nothing else gives the sampled token's
    logprob (``top_k`` 0). The teacher's top-k alone needs no column: vLLM puts the actual
    token in every ``prompt_logprobs`` dict (``append_logprobs_for_next_position``), with
    the same float32 logprob."""
    return req.ids is not None or req.top_k == 0


def build_vllm_bodies(req: ScoreRequest, lay: Layout) -> list[bytes]:
    """The bodies of a vLLM request (``lay = layout(req)``): one, or (scale-out, more
    columns than ``max_ids``) one per chunk of columns.

    Raises:
        CapabilityError: ``"engine"``: the engine cannot answer it (:func:`engine_problem`).
    """
    problem = engine_problem(
        req.engine, top_k=req.top_k, ids=req.ids is not None, max_logprobs=req.max_ids
    )
    if problem is not None:
        raise CapabilityError("engine", problem)
    if req.engine == "vllm-completions":
        return [_completions_body(req, lay)]
    return _scale_out_bodies(req, lay)


def _salt(req: ScoreRequest, n: int, several: bool) -> str | None:
    if req.cache_salt is None or not (req.salt_each_item and several):
        return req.cache_salt
    return f"{req.cache_salt}-{n}"


def _scale_out_bodies(req: ScoreRequest, lay: Layout) -> list[bytes]:
    p = lay.prompt_length
    columns = lay.tokens[p:, None]
    if req.ids is not None:
        columns = np.concatenate((columns, np.asarray(req.ids, dtype=np.int64)), axis=1)
    chunks = column_chunks(req)
    token_ids = msgspec.Raw(_ENCODER.encode(lay.tokens.tolist()))
    out = []
    with_columns = sends_id_columns(req)
    for n, (lo, hi) in enumerate(chunks):
        sampling: dict[str, Any] = {
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprob_start": p - 1,
        }
        if with_columns:
            part = columns if (lo, hi) == (0, columns.shape[1]) else columns[:, lo:hi]
            part_json = rows_json(np.ascontiguousarray(part), 0)
            sampling["prompt_logprob_token_ids"] = msgspec.Raw(part_json)
        sampling["skip_reading_prefix_cache"] = False
        if req.top_k > 0 and n == 0:
            sampling["prompt_logprobs"] = req.top_k
        sampling["detokenize"] = False
        body: dict[str, Any] = {
            "token_ids": token_ids,
            "sampling_params": sampling,
            "output_mode": "tokens",
        }
        salt = _salt(req, n, len(chunks) > 1)
        if salt is not None:
            body["cache_salt"] = salt
        body["stream"] = False
        out.append(_ENCODER.encode(body))
    return out


def _completions_body(req: ScoreRequest, lay: Layout) -> bytes:
    body: dict[str, Any] = {
        "prompt": lay.tokens.tolist(),
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": req.top_k,
        "return_weight_versions": True,
    }
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    body["stream"] = False
    return _ENCODER.encode(body)

"""Request bodies: a :class:`~opd_stream.wire._request.ScoreRequest` as ``/generate`` JSON bytes
(one body, or one per block for the ``"blocks"`` id form), and sampling requests.

The layout (which items, which ids) is :func:`opd_stream.wire._request.layout`'s; this module only
encodes it. Large bodies are encoded in chunks (no single call holds the GIL for long), so
that one built in a worker thread leaves the event loop its turns.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ._request import Engine, Layout, ScoreRequest, json_digits, layout, multi_body
from ._rows_json import ids_json, rows_json
from ._vllm import build_vllm_bodies

__all__ = (
    "build_block_payloads",
    "build_generate_payload",
    "build_score_payload",
    "payload_size_hint",
    "probe_body",
)

_ENCODER = msgspec.json.Encoder()


def build_score_payload(req: ScoreRequest) -> bytes:
    """Encode ``req`` as one ``/generate`` JSON body (blocked: one SGLang batch body).

    Keys appear in a fixed order: ``input_ids, sampling_params, return_logprob,
    logprob_start_len, [top_logprobs_num], [token_ids_logprob |
    token_ids_logprob_positions], [return_flat_raw_top_logprobs,
    return_flat_raw_output_top_logprobs, return_flat_raw_top_logprobs_b64], [cache_salt],
    return_text_in_logprobs, stream``. The three flat flags (``topk_wire="b64"`` with
    ``top_k > 0``) ask SGLang >= 0.5.23 for both the input and the output top-k as b64 flat
    arrays; servers that do not know them ignore them and answer nested JSON.

    Raises:
        InvalidSampleError: a malformed request (names the field).
    """
    return build_laid(req, layout(req))


def probe_body(engine: Engine) -> bytes:
    """A tiny valid scoring request for ``engine`` (tokens ``[0, 0]``, the last one scored:
    id 0 is in every vocabulary): what engine detection sends."""
    req = ScoreRequest(tokens=np.zeros(2, dtype=np.int64), response_length=1, engine=engine)
    if engine == "sglang":
        return build_score_payload(req)
    return build_vllm_bodies(req, layout(req))[0]


def build_laid(req: ScoreRequest, lay: Layout) -> bytes:
    """:func:`build_score_payload` for a request already checked and laid out
    (``lay = layout(req)``; the pipeline keeps it for the answer's decode). A vLLM request
    gets its engine's body (:mod:`opd_stream.wire._vllm`)."""
    if multi_body(req):
        raise ValueError("this request is sent as several bodies: build_block_payloads")
    if req.engine != "sglang":
        return build_vllm_bodies(req, lay)[0]
    body: dict[str, Any] = {}
    if lay.batch:
        lengths = [seg.length for seg in lay.segments]
        body["input_ids"] = msgspec.Raw(_prefixes_json(lay.tokens, lengths))
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 0}
        body["return_logprob"] = True
        body["logprob_start_len"] = [seg.start for seg in lay.segments]
    else:
        body["input_ids"] = msgspec.Raw(ids_json(lay.tokens))
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 0}
        body["return_logprob"] = True
        body["logprob_start_len"] = lay.segments[0].start
    if req.top_k > 0:
        body["top_logprobs_num"] = req.top_k
    if req.ids is not None:
        if req.id_form == "per-position":
            body["token_ids_logprob_positions"] = msgspec.Raw(
                rows_json(np.asarray(req.ids), lay.prompt_length)
            )
        elif lay.batch:
            body["token_ids_logprob"] = [u.tolist() for u in lay.unions]
        else:
            body["token_ids_logprob"] = lay.unions[0].tolist()
    salt: str | list[str] | None = req.cache_salt
    if salt is not None and req.salt_each_item and lay.batch:
        salt = [f"{req.cache_salt}-{n}" for n in range(len(lay.segments))]
    _finish(body, req, salt)
    return _ENCODER.encode(body)


def _finish(body: dict[str, Any], req: ScoreRequest, salt: str | list[str] | None) -> None:
    """The keys every scoring body ends with (b64 flags when asked, the cache salt when
    set, text off, no stream)."""
    if req.top_k > 0 and req.topk_wire == "b64":
        # output side too: the one (unused) output top-k row SGLang answers for
        # max_new_tokens = 0 is ~23% smaller in b64 than as nested triples (417 vs 543 B at k=16)
        body["return_flat_raw_top_logprobs"] = True
        body["return_flat_raw_output_top_logprobs"] = True
        body["return_flat_raw_top_logprobs_b64"] = True
    if salt is not None:
        body["cache_salt"] = salt
    body["return_text_in_logprobs"] = False
    body["stream"] = False


def build_block_payloads(req: ScoreRequest) -> list[bytes]:
    """The ``"blocks"`` id form: one single (non-batch) ``/generate`` body per block.

    The items of the blocked form (see the module docstring: block ``b`` is
    ``input_ids = tokens[:P + end]`` (one token short for id-only requests),
    ``logprob_start_len = P + start - 1``, ``token_ids_logprob`` = the block's id union),
    each sent as an independent request with a single ``logprob_start_len``: what a proxy
    that rejects per-item lists (sglang-router 0.3.2 answers them 422) forwards. Answers stay
    ``O(R k B)`` in all, never the flat union's ``O(R^2 k)``.

    A vLLM request (``req.engine``) gets its bodies from :func:`~opd_stream.wire._vllm.
    build_vllm_bodies`: one per chunk of id columns (``max_ids``), or its one body.

    Raises:
        InvalidSampleError: a malformed request (names the field).
        CapabilityError: ``"engine"``: the engine cannot answer the request.
    """
    lay = layout(req)
    if req.engine != "sglang":
        return build_vllm_bodies(req, lay)
    prefixes = _prefix_list(lay.tokens, [seg.length for seg in lay.segments])
    out = []
    for n, (seg, union, prefix) in enumerate(zip(lay.segments, lay.unions, prefixes, strict=True)):
        body: dict[str, Any] = {
            "input_ids": msgspec.Raw(prefix),
            "sampling_params": {"temperature": 0, "max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": seg.start,
        }
        if req.top_k > 0:
            body["top_logprobs_num"] = req.top_k
        body["token_ids_logprob"] = union.tolist()
        salt = req.cache_salt
        if salt is not None and req.salt_each_item:
            salt = f"{salt}-{n}"
        _finish(body, req, salt)
        out.append(_ENCODER.encode(body))
    return out


def payload_size_hint(req: ScoreRequest) -> int:
    """A cheap upper estimate of ``len(build_score_payload(req))`` (7 bytes per id sent)."""
    ids = 0 if req.ids is None else int(req.ids.size)
    tokens = int(req.tokens.size)
    if req.id_form in ("blocked", "blocks") and req.ids is not None:
        tokens *= -(-req.response_length // max(req.block_size, 1))  # a prefix per block
    return 7 * (tokens + ids)


def _prefix_list(tokens: npt.NDArray[np.int64], lengths: list[int]) -> list[bytes]:
    """``[t0,...,t(n-1)]`` as compact JSON for each ``n`` in ``lengths`` (one encoding,
    sliced; see :func:`_prefixes_json`)."""
    whole = _ENCODER.encode(tokens.tolist())
    end = _element_ends(tokens)
    return [whole[: int(end[n])] + b"]" if n else b"[]" for n in lengths]


def _element_ends(tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``end[n]`` (``n >= 1``): the offset just past element ``n - 1`` of ``tokens``'
    compact JSON encoding, before its comma."""
    digits = json_digits(tokens)
    out: npt.NDArray[np.int64] = np.concatenate(([1], 1 + np.cumsum(digits + 1))) - 1
    return out


def _prefixes_json(tokens: npt.NDArray[np.int64], lengths: list[int]) -> bytes:
    """``[[t0..t(n0-1)],[t0..t(n1-1)],...]`` as compact JSON, by slicing one encoding.

    The blocked form re-sends the prefix once per block (``O(R/B * L)`` ids); encoding the
    sequence once and copying byte ranges of it costs a memcpy per block instead of
    building and encoding ``O(R/B * L)`` Python ints. Byte-identical to
    ``msgspec.json.encode([tokens[:n].tolist() for n in lengths])`` for non-negative ids.
    """
    whole = _ENCODER.encode(tokens.tolist())  # b"[t0,t1,...]"
    end = _element_ends(tokens)
    # one copy of each prefix, straight into the result (memoryview slices copy nothing)
    view = memoryview(whole)
    parts: list[bytes | memoryview] = [b"["]
    for i, n in enumerate(lengths):
        if i:
            parts.append(b",")
        parts += (view[: int(end[n])], b"]") if n else (b"[]",)
    parts.append(b"]")
    return b"".join(parts)


def build_generate_payload(
    prompts: list[list[int]] | list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_logprobs_num: int = 0,
    seed: int | None = None,
    *,
    topk_wire: Literal["b64", "json"] = "json",
) -> bytes:
    """Encode a sampling (rollout) ``/generate`` request, single or batch.

    ``sampling_params`` holds ``temperature``, ``max_new_tokens`` and (if given)
    ``sampling_seed``; ``return_logprob`` is true so that the answer carries
    ``output_token_logprobs`` (and the output top-k when ``top_logprobs_num > 0``).
    No ``logprob_start_len`` is sent (SGLang's -1: no input logprobs).

    ``topk_wire="b64"`` (with ``top_logprobs_num > 0``) also sends
    ``return_flat_raw_output_top_logprobs`` and ``return_flat_raw_top_logprobs_b64``
    (after ``top_logprobs_num``): SGLang >= 0.5.23 then answers the output top-k as b64
    float32 / int32 flat arrays instead of nested triples (about 3x smaller). Servers that do
    not know the flags ignore them and answer nested rows; :func:`decode_generate_response`
    accepts both. The default stays ``"json"``, which every server version answers alike.

    Raises:
        ValueError: empty prompts, a non-int id, ``max_new_tokens < 1``,
            ``top_logprobs_num < 0``, an unknown ``topk_wire``.
    """
    if topk_wire not in ("b64", "json"):
        raise ValueError(f"topk_wire must be 'b64' or 'json', got {topk_wire!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
    if not prompts:
        raise ValueError("prompts is empty")
    seqs = [prompts] if not isinstance(prompts[0], list) else prompts
    for n, seq in enumerate(seqs):
        if not isinstance(seq, list) or not seq:
            raise ValueError(f"prompt {n} is not a non-empty list of token ids")
        if not all(type(t) is int and t >= 0 for t in seq):
            raise ValueError(f"prompt {n} holds an id that is not a non-negative int")
    sampling: dict[str, Any] = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    if seed is not None:
        sampling["sampling_seed"] = seed
    body: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": sampling,
        "return_logprob": True,
    }
    if top_logprobs_num > 0:
        body["top_logprobs_num"] = top_logprobs_num
        if topk_wire == "b64":
            body["return_flat_raw_output_top_logprobs"] = True
            body["return_flat_raw_top_logprobs_b64"] = True
    body["return_text_in_logprobs"] = False
    body["stream"] = False
    return _ENCODER.encode(body)

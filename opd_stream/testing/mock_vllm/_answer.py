"""Sans-IO answers of the mock vLLM server: the engine's output for one request item, and
the JSON bodies of ``/inference/v1/generate`` and ``/v1/completions``.

Values come from the SGLang mock's :class:`MockModel` (float32-identical on either mock).
``prompt_token_id_logprobs``: row ``i`` scores its ids as predictions of prompt token
``start + i + 1``, float32 ``[rows, cols]``, ``-inf`` where the id is -1, sent as base64 of
an ``.npy`` file (as vLLM's ``numpy2base64``). ``prompt_logprobs``: ``None`` for position 0
and the ``start`` positions after it, then per position a dict built as vLLM's
``append_logprobs_for_next_position`` builds it (the actual token first with its rank, then
the top-N in rank order), ``-inf`` written ``-9999.0``, ``decoded_token`` null.
"""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from ..mock_sglang import ByteModel, MockModel
from ._request import VllmItem

__all__ = ("ItemResult", "completions_body", "generate_body", "npy_base64", "score_item")


def npy_base64(arr: npt.NDArray[Any]) -> str:
    """vLLM's ``numpy2base64``: base64 of the array's ``.npy`` file."""
    with io.BytesIO() as buf:
        np.save(buf, arr, allow_pickle=False)
        return base64.b64encode(buf.getbuffer()).decode("ascii")


class ItemResult:
    """The engine's output for one item (a vLLM ``RequestOutput`` with one completion)."""

    def __init__(
        self,
        item: VllmItem,
        *,
        token_ids: list[int],
        finish_reason: str,
        stop_reason: int | None,
        prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None,
        id_logprobs: npt.NDArray[np.float32] | None,
        cached_tokens: int,
        weight_version: str,
    ) -> None:
        self.item = item
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.prompt_logprobs = prompt_logprobs
        self.id_logprobs = id_logprobs
        self.cached_tokens = cached_tokens
        self.weight_version = weight_version

    @property
    def weight_versions(self) -> list[dict[str, Any]]:
        """``WeightVersionSpan``s over the output tokens (one version per answer)."""
        return [{"version": self.weight_version, "start": 0, "end": len(self.token_ids)}]


def _actual_lp(
    model: MockModel,
    byte_model: ByteModel | None,
    tokens: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    rows: Any,
) -> npt.NDArray[np.float64]:
    if byte_model is not None:
        return byte_model.token_logprobs(tokens, positions)
    return model.logprobs_in(rows, tokens[positions][:, None])[:, 0]


def _ranks(model: MockModel, rows: Any, actual: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """vLLM's rank of each actual token: the number of ids whose float32 logprob is ``>=``
    its own (``batched_count_greater_than``)."""
    head = (rows.logits - rows.logz[:, None]).astype(np.float32)
    count = (head >= actual[:, None]).sum(axis=1).astype(np.int64)
    masked_in_head = np.isinf(rows.logits).sum(axis=1)
    n_tail = model.vocab_size - model.head_size - model.masked_ids.size + masked_in_head
    tail = rows.tail_lp.astype(np.float32)
    count += np.where(tail >= actual, n_tail, 0)
    n_masked = model.masked_ids.size - masked_in_head  # masked ids outside the head: -inf
    count += np.where(np.isneginf(actual), n_masked, 0)
    out: npt.NDArray[np.int64] = count.astype(np.int64)
    return out


def _clamped(values: npt.NDArray[np.float32]) -> Any:
    """Float32 values as Python floats, ``-inf`` as vLLM's ``-9999.0``
    (``clamp_prompt_logprobs``)."""
    return np.where(np.isneginf(values), np.float32(-9999.0), values).tolist()


def score_item(
    model: MockModel,
    item: VllmItem,
    *,
    rng: np.random.Generator,
    cached_tokens: int,
    weight_version: str,
    shift: float = 0.0,
    byte_model: ByteModel | None = None,
    fault: str | None = None,
) -> ItemResult:
    """Run one item through the model: generate ``max_tokens`` (greedy below temperature
    1e-5, else sampled), score the prompt rows it asks for.

    ``byte_model``: the actual token's logprob comes from it (``prompt_logprobs``, and column
    0 of ``prompt_token_id_logprobs`` where it holds the actual token); every other id's
    from ``model``, as on the SGLang mock.

    ``fault``: ``"misaligned"`` rolls the scored rows by one (values no longer belong to
    their positions), ``"missing_rows"`` drops the last scored row.
    """
    tok = item.token_ids
    length = int(tok.size)
    temperature = 0.0 if item.temperature < 1e-5 else item.temperature
    gen = model.sample(
        tok, item.max_tokens, rng, temperature=temperature, stop_token_ids=item.stop_token_ids
    )
    gen_list: list[int] = gen.tolist()
    stopped = bool(gen_list) and gen_list[-1] in item.stop_token_ids
    finish = "stop" if stopped else "length"
    stop_reason = gen_list[-1] if stopped else None

    id_lp: npt.NDArray[np.float32] | None = None
    plp: list[dict[str, dict[str, Any]] | None] | None = None
    if item.scores_prompt:
        s = item.start
        positions = np.arange(s + 1, length, dtype=np.int64)
        rows = model.head_rows(tok, positions)
        actual = _actual_lp(model, byte_model, tok, positions, rows) + shift
        if item.ids is not None:
            ids = item.ids
            pad = ids < 0
            lp = model.logprobs_in(rows, np.where(pad, 0, ids)) + shift
            if byte_model is not None and ids.shape[1]:
                # the sampled token's column (0, where the client puts the actual token) from
                # the byte model, as the SGLang mock's input_token_logprobs; every other
                # requested id from the closed form, as the SGLang mock's requested ids (the
                # actual token asked again in another column included)
                first = ids[:, 0] == tok[positions]
                lp[:, 0] = np.where(first, actual, lp[:, 0])
            lp = np.where(pad, -np.inf, lp)
            id_lp = lp.astype(np.float32)
            if fault == "misaligned" and id_lp.shape[0] > 1:
                id_lp = np.roll(id_lp, 1, axis=0)
            elif fault == "missing_rows":
                id_lp = id_lp[:-1]
        if item.prompt_logprobs is not None:
            plp = _prompt_logprobs(
                model, rows, tok, positions, actual, item.prompt_logprobs, s, shift
            )
            plp = plp[: len(plp) - 1] if fault == "missing_rows" else plp
            if fault == "misaligned" and len(plp) > s + 2:
                body = plp[s + 1 :]
                plp = plp[: s + 1] + body[-1:] + body[:-1]
    return ItemResult(
        item,
        token_ids=gen_list,
        finish_reason=finish,
        stop_reason=stop_reason,
        prompt_logprobs=plp,
        id_logprobs=id_lp,
        cached_tokens=cached_tokens,
        weight_version=weight_version,
    )


def _prompt_logprobs(
    model: MockModel,
    rows: Any,
    tok: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    actual: npt.NDArray[np.float64],
    top_n: int,
    start: int,
    offset: float,
) -> list[dict[str, dict[str, Any]] | None]:
    """The ``prompt_logprobs`` list (see the module docstring); JSON keys are the ids as
    strings, as pydantic writes ``dict[int, Logprob]``."""
    own = _actual_lp(model, None, tok, positions, rows)  # the model's own (for ranks)
    actual32 = actual.astype(np.float32)
    ranks = _ranks(model, rows, own.astype(np.float32))
    out: list[dict[str, dict[str, Any]] | None] = [None] * (1 + start)
    act_keys = list(map(str, tok[positions].tolist()))
    act_vals: list[float] = _clamped(actual32)
    rank_list: list[int] = ranks.tolist()
    t_keys: list[list[str]] = []
    t_vals: list[list[float]] = []
    if top_n > 0:
        top_ids, top_lp = model.topk_in(rows, top_n)
        t_keys = [list(map(str, row)) for row in top_ids.tolist()]
        t_vals = _clamped((top_lp + offset).astype(np.float32))
    for r in range(positions.size):
        d: dict[str, dict[str, Any]] = {
            act_keys[r]: {"logprob": act_vals[r], "rank": rank_list[r], "decoded_token": None}
        }
        if top_n > 0:  # an actual token among them keeps its place, takes its top-N rank
            d.update(
                {
                    key: {"logprob": v, "rank": j, "decoded_token": None}
                    for j, (key, v) in enumerate(zip(t_keys[r], t_vals[r], strict=True), 1)
                }
            )
        out.append(d)
    return out


def _usage(results: list[ItemResult], details: bool) -> dict[str, Any]:
    prompt = sum(int(r.item.token_ids.size) for r in results)
    gen = sum(len(r.token_ids) for r in results)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + gen}
    usage["completion_tokens"] = gen
    if details:  # vLLM reports the last prompt's cached tokens (one prompt: its own)
        usage["prompt_tokens_details"] = {
            "cached_tokens": results[-1].cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    usage["completion_tokens_details"] = None
    return usage


def generate_body(r: ItemResult, model_name: str, *, details: bool) -> dict[str, Any]:
    """``GenerateTokensResponse`` (``output_mode`` ``"tokens"``, non-streaming)."""
    it = r.item
    return {
        "request_id": it.request_id,
        "model": model_name,
        "created": int(time.time()),
        "usage": _usage([r], details),
        "prompt_logprobs": r.prompt_logprobs,
        "prompt_token_id_logprobs": None if r.id_logprobs is None else npy_base64(r.id_logprobs),
        "prompt_token_ids": it.token_ids.tolist() if it.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
                "token_ids": r.token_ids,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": r.weight_versions,
                "logprobs": None,
            }
        ],
    }


def aborted_generate_body(item: VllmItem, model_name: str, *, details: bool) -> dict[str, Any]:
    """An aborted request's answer (HTTP 200, ``finish_reason`` ``"abort"``, no scores)."""
    r = ItemResult(
        item,
        token_ids=[],
        finish_reason="abort",
        stop_reason=None,
        prompt_logprobs=None,
        id_logprobs=None,
        cached_tokens=0,
        weight_version="",
    )
    body = generate_body(r, model_name, details=details)
    body["choices"][0]["weight_versions"] = None
    return body


def completions_body(
    results: list[ItemResult], flags: dict[str, Any], model_name: str, *, details: bool
) -> dict[str, Any]:
    """``CompletionResponse`` for a batch of prompts (one choice each, ``n`` = 1)."""
    choices = []
    for i, r in enumerate(results):
        choices.append(
            {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
                "token_ids": r.token_ids if flags["return_token_ids"] else None,
                "prompt_logprobs": r.prompt_logprobs,
                "prompt_token_ids": (
                    r.item.token_ids.tolist() if flags["return_token_ids"] else None
                ),
                "routed_experts": None,
                "weight_versions": r.weight_versions if flags["return_weight_versions"] else None,
            }
        )
    return {
        "id": flags["id"],
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(results, details),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }

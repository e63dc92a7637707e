"""Synthetic student rollouts for the benchmarks, built from the mock's closed-form student.

Response tokens are random ids (any token sequence can be scored); the student's top-k rows
and rollout logprobs come from :class:`~opd_stream.testing.mock_sglang.MockModel` with the
student server's seed, so they are what that student would report for those tokens. The
top-k rows are Python ``[[logprob, id], ...]`` lists, the form a rollout engine hands over
after decoding SGLang's nested JSON, or (``topk_arrays=True``) the ``(ids, logprobs)`` array
form that a rollout decoded from SGLang's flat b64 output top-k arrives in.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from opd_stream import Sample
from opd_stream.testing.mock_sglang import MockModel

__all__ = ("STUDENT_SEED", "TEACHER_SEED", "iter_samples", "make_sample", "make_samples")

STUDENT_SEED = 0
TEACHER_SEED = 1
_MODELS: dict[int, MockModel] = {}


def _student() -> MockModel:
    model = _MODELS.get(STUDENT_SEED)
    if model is None:
        model = _MODELS[STUDENT_SEED] = MockModel("student", STUDENT_SEED)
    return model


def make_sample(
    index: int, prompt: int, response: int, top_k: int, seed: int = 0, *, topk_arrays: bool = False
) -> Sample:
    """One rollout of ``prompt + response`` tokens with rollout logprobs (and top-k rows).

    With ``topk_arrays`` the top-k rows are int64 ids and float32 logprobs ``[R, k]`` (the
    same values as the list form).
    """
    rng = np.random.default_rng([seed, index])
    tokens = rng.integers(0, 30000, prompt + response, dtype=np.int64)
    model = _student()
    positions = np.arange(prompt, prompt + response, dtype=np.int64)
    rows = model.head_rows(tokens, positions)
    rollout = model.logprobs_in(rows, tokens[prompt:, None])[:, 0].astype(np.float32)
    top: object = None
    if top_k > 0 and topk_arrays:
        ids, lps = model.topk_in(rows, top_k)
        top = (ids.astype(np.int64), lps.astype(np.float32))
    elif top_k > 0:
        ids, lps = model.topk_in(rows, top_k)
        lpl = lps.astype(np.float32).tolist()
        idl = ids.tolist()
        top = [
            [[lp, i] for lp, i in zip(lr, ir, strict=True)] for lr, ir in zip(lpl, idl, strict=True)
        ]
    return Sample(
        tokens.tolist(),
        response,
        rollout_logprobs=rollout.tolist(),
        student_top_logprobs=top,
        sample_id=index,
    )


def make_samples(
    n: int, prompt: int, response: int, top_k: int, seed: int = 0, *, topk_arrays: bool = False
) -> list[Sample]:
    """``n`` rollouts (see :func:`make_sample`)."""
    return [
        make_sample(i, prompt, response, top_k, seed, topk_arrays=topk_arrays) for i in range(n)
    ]


def iter_samples(n: int, prompt: int, response: int, top_k: int, seed: int = 0) -> Iterator[Sample]:
    """Like :func:`make_samples`, lazily (the soak scenario)."""
    for i in range(n):
        yield make_sample(i, prompt, response, top_k, seed)

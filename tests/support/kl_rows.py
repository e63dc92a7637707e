"""Candidate rows for the KL tail and divergence tests (``test_kl_tail``, ``test_kl_divergences``).

A sample is a :data:`Rows` dict of ``[R, K]`` arrays (``FIELDS`` pairs each
:class:`~opd_stream.kl._math.TopKBatch` field with its key); :func:`batch_of` pads samples
into one batch; :func:`distribution_rows` draws rows of real (sub-)distributions with a given
candidate mass; :func:`model_rows` gives what the mock servers would send, with the
full-vocabulary reverse KL of the mock's closed form (float64).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opd_stream.kl._math import TopKBatch
from opd_stream.testing.mock_sglang import MockModel
from support.kl_padding import pad_batch
from support.kl_reference import reference_full_reverse_kl

FIELDS = (
    ("student_ids", "s_ids"),
    ("student_lp", "s_lp"),
    ("teacher_on_student", "t_on_s"),
    ("teacher_ids", "t_ids"),
    ("teacher_lp", "t_lp"),
    ("student_on_teacher", "s_on_t"),
)

Rows = dict[str, np.ndarray]  # one sample: s_ids, s_lp, t_on_s, t_ids, t_lp, s_on_t, [R, K]


def batch_of(samples: list[Rows], device: str = "cpu") -> TopKBatch:
    fields: dict[str, Any] = {}
    valid = None
    for name, key in FIELDS:
        fill = None if name.endswith("_ids") else math.nan
        fields[name], valid = pad_batch([s[key] for s in samples], device=device, fill=fill)
    assert valid is not None
    return TopKBatch(valid=valid, **fields)


def distribution_rows(
    rng: np.random.Generator, r: int, k: int, *, overlap: float, mass_s: Any, mass_t: Any
) -> Rows:
    """Rows of real distributions: the student's ``S`` holds ``mass_s`` of its mass, the
    teacher's ``T`` ``mass_t`` of its own; the values of the other model's ids are its
    probabilities of them, drawn below what is left."""
    vocab = 4 * k + 3
    perm = np.argsort(rng.random((r, vocab)), axis=1) + 5
    s_ids = perm[:, :k]
    shared = rng.random((r, k)) < overlap
    t_ids = np.where(shared, np.roll(s_ids, 1, axis=1), perm[:, k : 2 * k])

    def split(mass: Any, n: int) -> np.ndarray:
        share = rng.dirichlet(np.ones(n) * 0.5, size=r)
        return np.log(np.maximum(np.asarray(mass, dtype=np.float64)[..., None] * share, 1e-300))

    ms = np.broadcast_to(np.asarray(mass_s, dtype=np.float64), (r,))
    mt = np.broadcast_to(np.asarray(mass_t, dtype=np.float64), (r,))
    s_lp = split(ms, k)
    t_lp = split(mt, k)
    # the other model's value of an id: its own where the id is in its top-k, else a share
    # of what its top-k leaves (so every row stays a sub-distribution)
    t_on_s = split((1 - mt) * 0.9, k)
    s_on_t = split((1 - ms) * 0.9, k)
    for a_ids, a_lp, b_ids, b_on_a in ((s_ids, s_lp, t_ids, s_on_t), (t_ids, t_lp, s_ids, t_on_s)):
        eq = b_ids[:, :, None] == a_ids[:, None, :]
        hit = eq.any(axis=2)
        b_on_a[hit] = np.take_along_axis(a_lp, eq.argmax(axis=2), axis=1)[hit]
    f32 = np.float32
    return {
        "s_ids": s_ids.astype(np.int64),
        "s_lp": s_lp.astype(f32),
        "t_on_s": t_on_s.astype(f32),
        "t_ids": t_ids.astype(np.int64),
        "t_lp": t_lp.astype(f32),
        "s_on_t": s_on_t.astype(f32),
    }


def model_rows(
    student: MockModel,
    teacher: MockModel,
    tokens: np.ndarray,
    positions: np.ndarray,
    k: int,
    dtype: type[np.floating[Any]] = np.float32,
) -> tuple[Rows, list[float]]:
    """What the servers would send (float32; ``dtype=np.float64``: the closed form's exact
    values) at ``positions``, and the full-vocabulary reverse KL there (float64, from the
    closed form)."""
    rows_s = student.head_rows(tokens, positions)
    rows_t = teacher.head_rows(tokens, positions)
    assert (rows_s.ids == rows_t.ids).all()  # one candidate pool for both roles
    s_ids, s_lp = student.topk_in(rows_s, k)
    t_ids, t_lp = teacher.topk_in(rows_t, k)
    f32 = dtype
    rows = {
        "s_ids": s_ids,
        "s_lp": s_lp.astype(f32),
        "t_on_s": teacher.logprobs_in(rows_t, s_ids).astype(f32),
        "t_ids": t_ids,
        "t_lp": t_lp.astype(f32),
        "s_on_t": student.logprobs_in(rows_s, t_ids).astype(f32),
    }
    n_tail = student.vocab_size - student.head_size - student.masked_ids.size
    full = [
        reference_full_reverse_kl(
            (rows_s.logits[j] - rows_s.logz[j]).tolist(),
            (rows_t.logits[j] - rows_t.logz[j]).tolist(),
            float(rows_s.tail_lp[j]),
            float(rows_t.tail_lp[j]),
            n_tail,
        )
        for j in range(positions.size)
    ]
    return rows, full

"""Which requests each strategy sends (``docs/semantics.md``, "Which requests each strategy
makes"), in which order, in each id form.

Golden payloads: for a tiny sample (prompt [7, 8, 9], response [5, 6], student top-2
S = [[4, 1], [3, 2]]) the exact bodies the teacher and student servers receive.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream.kl._plan import RequestPlan, plan_requests
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"
TOKENS = [7, 8, 9, 5, 6]
S_IDS = [[4, 1], [3, 2]]
COMMON = {
    "sampling_params": {"temperature": 0, "max_new_tokens": 0},
    "return_logprob": True,
    "return_text_in_logprobs": False,
    "stream": False,
}


@pytest.mark.parametrize(
    ("strategy", "have_s", "expected"),
    [
        ("only-student", True, RequestPlan(teacher_scores_student_ids=True)),
        (
            "only-student",
            False,
            RequestPlan(fetch_student_topk=True, teacher_scores_student_ids=True),
        ),
        ("intersection", True, RequestPlan(teacher_topk=True)),
        ("intersection", False, RequestPlan(fetch_student_topk=True, teacher_topk=True)),
        ("only-teacher", True, RequestPlan(teacher_topk=True, student_scores_teacher_ids=True)),
        ("only-teacher", False, RequestPlan(teacher_topk=True, student_scores_teacher_ids=True)),
        (
            "union",
            True,
            RequestPlan(
                teacher_topk=True, teacher_scores_student_ids=True, student_scores_teacher_ids=True
            ),
        ),
        (
            "xor",
            False,
            RequestPlan(
                fetch_student_topk=True,
                teacher_topk=True,
                teacher_scores_student_ids=True,
                student_scores_teacher_ids=True,
            ),
        ),
    ],
)
def test_each_strategy_asks_for_exactly_what_it_uses(
    strategy: str, have_s: bool, expected: RequestPlan
) -> None:
    assert plan_requests(16, strategy, have_student_topk=have_s) == expected  # type: ignore[arg-type]


def test_sampled_token_mode_needs_only_the_teacher() -> None:
    plan = plan_requests(0, "only-student", have_student_topk=False)
    assert plan == RequestPlan()
    assert not plan.needs_student_server


def _ids_fields(form: str, rows: list[list[int]], *, topk: bool = False) -> dict[str, Any]:
    """The id-scoring fields of the sample above, written out by hand per form."""
    if form == "per-position":
        return {
            "input_ids": TOKENS,
            "logprob_start_len": 2,
            "token_ids_logprob_positions": [[], [], [], rows[0], rows[1]],
        }
    if form == "flat":
        return {
            "input_ids": TOKENS,
            "logprob_start_len": 2,
            "token_ids_logprob": sorted({*rows[0], *rows[1]}),
        }
    # blocked, one position per block, start one before it
    if topk:  # prefix cut at the block end
        return {
            "input_ids": [TOKENS[:4], TOKENS],
            "logprob_start_len": [2, 3],
            "token_ids_logprob": [sorted(rows[0]), sorted(rows[1])],
        }
    # id-only: the row comes from the output row, so the prefix stops before the target,
    # which joins the ids (for its logprob)
    return {
        "input_ids": [TOKENS[:3], TOKENS[:4]],
        "logprob_start_len": [2, 3],
        "token_ids_logprob": [sorted({*rows[0], TOKENS[3]}), sorted({*rows[1], TOKENS[4]})],
    }


def _expected_bodies(
    strategy: str, form: str, t_ids: list[list[int]]
) -> tuple[list[Any], list[Any]]:
    topk = {"top_logprobs_num": 2}
    plain = {"input_ids": TOKENS, "logprob_start_len": 2}
    teacher: dict[str, Any]
    if strategy == "only-student":
        teacher = _ids_fields(form, S_IDS)
    elif strategy == "intersection" or strategy == "only-teacher":
        teacher = {**plain, **topk}
    else:  # union, xor
        teacher = {**_ids_fields(form, S_IDS, topk=True), **topk}
    student = []
    if strategy in ("only-teacher", "union", "xor"):
        student = [{**COMMON, **_ids_fields(form, t_ids)}]
    return [{**COMMON, **teacher}], student


@pytest.mark.parametrize("form", ["per-position", "flat", "blocked"])
@pytest.mark.parametrize(
    "strategy", ["only-student", "only-teacher", "intersection", "union", "xor"]
)
async def test_golden_payloads_for_every_strategy_and_id_form(strategy: str, form: str) -> None:
    servers = {T: InProcessSGLang("teacher", 4), S: InProcessSGLang("student", 4)}
    cfg = stream_config(
        T,
        student_url=S,
        top_k=2,
        strategy=strategy,
        id_scoring=form,
        id_block_size=1,
        topk_wire="json",
    )
    rows = [[[-0.5, S_IDS[t][0]], [-1.5, S_IDS[t][1]]] for t in range(2)]
    sample = Sample(TOKENS, 2, student_top_logprobs=rows)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run([sample]) as results:
            out = [r async for r in results]
    assert isinstance(out[0], ScoredSample), out
    tid, _ = servers[T].model.topk(np.asarray(TOKENS), np.array([3, 4]), 2)
    want_teacher, want_student = _expected_bodies(strategy, form, tid.tolist())

    def decoded(bodies: list[bytes]) -> list[Any]:
        return [msgspec.json.decode(b) for b in bodies]

    assert decoded(servers[T].bodies) == want_teacher
    assert decoded(servers[S].bodies) == want_student


def test_the_strategy_table_covers_every_strategy_once() -> None:
    from opd_stream.kl._names import STRATEGIES
    from opd_stream.kl._plan import STRATEGY_NEEDS

    assert tuple(STRATEGY_NEEDS) == STRATEGIES
    for strategy, needs in STRATEGY_NEEDS.items():
        # a strategy reads at least one top-k, and is twice as wide only when it joins both
        assert needs.student_topk or needs.teacher_topk, strategy
        assert needs.width == (2 if strategy in ("union", "xor") else 1)


@pytest.mark.parametrize(
    "strategy", ["only-student", "only-teacher", "intersection", "union", "xor"]
)
def test_the_kl_reads_and_returns_what_the_strategy_table_says(strategy: Any) -> None:
    import torch

    from opd_stream.kl._math import topk_reverse_kl
    from opd_stream.kl._plan import STRATEGY_NEEDS, candidate_width
    from opd_stream.kl._tensors import TopKBatch, needed_inputs

    needs = STRATEGY_NEEDS[strategy]
    want = {
        "student_ids": needs.student_topk,
        "student_lp": needs.student_topk,
        "teacher_ids": needs.teacher_topk,
        "teacher_lp": needs.teacher_topk,
        "teacher_on_student": needs.teacher_scores_student_ids,
        "student_on_teacher": needs.student_scores_teacher_ids,
    }
    assert needed_inputs(strategy) == {name for name, used in want.items() if used}
    # Ks = 2, Kt = 3: the candidate axis of the result is the table's width, and only the
    # fields the table names are needed (the others are None).
    lp = torch.log(torch.tensor([[[0.5, 0.25]]]))
    lp3 = torch.log(torch.tensor([[[0.5, 0.25, 0.125]]]))
    full = {
        "student_ids": torch.tensor([[[1, 2]]]),
        "student_lp": lp,
        "teacher_on_student": lp,
        "teacher_ids": torch.tensor([[[2, 3, 4]]]),
        "teacher_lp": lp3,
        "student_on_teacher": lp3,
    }
    batch = TopKBatch(
        **{name: (x if want[name] else None) for name, x in full.items()},
        valid=torch.ones((1, 1), dtype=torch.bool),
    )
    res = topk_reverse_kl(batch, strategy, "student_p")
    assert res.ids.shape == (1, 1, candidate_width(strategy, 2, 3))
    assert candidate_width(strategy, 4) == 4 * needs.width


def test_the_miles_flag_choices_are_the_strategies_and_weight_modes_of_the_table() -> None:
    # Miles' reference flags are listed as the reference spells them; they are ours exactly.
    from opd_stream.integrations.miles import _flags
    from opd_stream.kl._names import STRATEGIES, WEIGHT_MODES

    assert set(_flags.STRATEGIES) == set(STRATEGIES)
    assert set(_flags.WEIGHT_MODES) == set(WEIGHT_MODES)

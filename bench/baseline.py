"""A reference-style scoring client: what the reference OPD system does
(``docs/semantics.md``, "What it does that opd_stream does better", items 1-4), kept
deliberately naive so the bench can compare.

* one new ``aiohttp.ClientSession`` per request (no pooling, no keep-alive);
* no bound on concurrency: one task per sample, all started at once;
* payloads with stdlib ``json.dumps``, answers with stdlib ``json.loads``;
* every parsed answer is kept until the whole batch is in; then one serial pure-Python pass
  over per-position ``{id: logprob}`` dicts computes the signals;
* ``logprob_start_len = 0`` (every prompt row comes back and is thrown away);
* ids are scored with the flat union ``token_ids_logprob`` (one sorted list of every id of
  the sample, scored at every position), or, like the reference's
  ``--opd-topk-per-position`` flag, with ``token_ids_logprob_positions`` on a patched server.

The numbers must equal ``opd_stream``'s (the bench checks within 1e-5): the same clamp of
``-inf`` to ``-1e4`` is applied before the arithmetic.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from opd_stream import Sample

__all__ = ("BaselineOutcome", "BaselineResult", "baseline_score")

_FLOOR = -1e4
IdForm = Literal["flat", "per-position"]


@dataclass
class BaselineResult:
    """One sample's signals (plain Python lists, float64)."""

    index: int
    teacher_logprobs: list[float]
    reverse_kl: list[float] | None


@dataclass
class BaselineOutcome:
    """What a baseline run produced, and when each sample's answers were all in."""

    results: dict[int, BaselineResult] = field(default_factory=dict)
    answered_at: dict[int, float] = field(default_factory=dict)
    done_at: float = 0.0
    finished: int = 0
    timed_out: bool = False
    bytes_received: int = 0


def _lp(v: float | None) -> float:
    return _FLOOR if v is None else max(float(v), _FLOOR)


async def _post(url: str, payload: dict[str, Any], out: BaselineOutcome) -> Any:
    # The reference's habit: a fresh session per request, a 4 h timeout, stdlib json.
    timeout = aiohttp.ClientTimeout(total=14400)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            url + "/generate",
            data=json.dumps(payload),
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"baseline request failed with HTTP {resp.status}")
        out.bytes_received += len(raw)
        return json.loads(raw)


def _payload(
    tokens: list[int],
    top_k: int,
    ids_rows: list[list[int]] | None,
    prompt: int,
    id_form: IdForm,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k > 0:
        body["top_logprobs_num"] = top_k
    if ids_rows is not None:
        if id_form == "flat":
            union: set[int] = set()
            for row in ids_rows:
                union.update(row)
            body["token_ids_logprob"] = sorted(union)
        else:
            body["token_ids_logprob_positions"] = [[] for _ in range(prompt)] + ids_rows
    body["return_text_in_logprobs"] = False
    return body


async def _score_one(
    sample: Sample,
    index: int,
    teacher_url: str,
    student_url: str | None,
    top_k: int,
    strategy: str,
    id_form: IdForm,
    answers: dict[int, tuple[Any, Any]],
    out: BaselineOutcome,
) -> None:
    tokens = list(sample.tokens)
    r = sample.response_length
    p = len(tokens) - r
    s_rows: list[list[int]] | None = None
    if top_k > 0 and strategy in ("only-student", "union", "xor"):
        s_rows = [[int(e[1]) for e in row[:top_k]] for row in sample.student_top_logprobs]
    teacher_topk = top_k if top_k > 0 and strategy != "only-student" else 0
    teacher = await _post(teacher_url, _payload(tokens, teacher_topk, s_rows, p, id_form), out)
    student = None
    if top_k > 0 and strategy in ("only-teacher", "union", "xor"):
        assert student_url is not None
        t_rows = [
            [int(e[1]) for e in row] for row in teacher["meta_info"]["input_top_logprobs"][1:][-r:]
        ]
        student = await _post(student_url, _payload(tokens, 0, t_rows, p, id_form), out)
    answers[index] = (teacher, student)
    out.answered_at[index] = time.perf_counter()


def _rows_as_dicts(rows: list[Any], r: int) -> list[dict[int, float]]:
    return [{int(e[1]): _lp(e[0]) for e in row} for row in rows[1:][-r:]]


def _kl_pass(
    sample: Sample, teacher: Any, student: Any, top_k: int, strategy: str, index: int
) -> BaselineResult:
    r = sample.response_length
    tmeta = teacher["meta_info"]
    t_tok = [_lp(e[0]) if e[0] is not None else -math.inf for e in tmeta["input_token_logprobs"]]
    teacher_lp = t_tok[1:][-r:]
    if top_k == 0:
        rkl = None
        if sample.rollout_logprobs is not None:
            rollout = list(sample.rollout_logprobs)
            rkl = [float(a) - max(b, _FLOOR) for a, b in zip(rollout, teacher_lp, strict=True)]
        return BaselineResult(index, teacher_lp, rkl)
    s_dicts: list[dict[int, float]] = []
    if sample.student_top_logprobs is not None:
        s_dicts = [
            {int(e[1]): _lp(e[0]) for e in row[:top_k]} for row in sample.student_top_logprobs
        ]
    t_dicts = (
        _rows_as_dicts(tmeta["input_top_logprobs"], r) if "input_top_logprobs" in tmeta else []
    )
    t_on_s = (
        _rows_as_dicts(tmeta["input_token_ids_logprobs"], r)
        if "input_token_ids_logprobs" in tmeta
        else []
    )
    s_on_t = (
        _rows_as_dicts(student["meta_info"]["input_token_ids_logprobs"], r)
        if student is not None
        else []
    )
    rkl: list[float] = []
    for t in range(r):
        if strategy == "only-student":
            sel = list(s_dicts[t])
            sv = [s_dicts[t][v] for v in sel]
            tv = [t_on_s[t][v] for v in sel]
        elif strategy == "only-teacher":
            sel = list(t_dicts[t])
            sv = [s_on_t[t][v] for v in sel]
            tv = [t_dicts[t][v] for v in sel]
        else:
            s_d, t_d = s_dicts[t], t_dicts[t]
            if strategy == "intersection":
                sel = [v for v in s_d if v in t_d]
            elif strategy == "union":
                sel = list(s_d) + [v for v in t_d if v not in s_d]
            else:  # xor
                sel = [v for v in s_d if v not in t_d] + [v for v in t_d if v not in s_d]
            sv = [s_d[v] if v in s_d else s_on_t[t][v] for v in sel]
            tv = [t_d[v] if v in t_d else t_on_s[t][v] for v in sel]
        if not sel:
            rkl.append(0.0)
            continue
        if strategy == "xor":
            weights = [math.exp(x) for x in sv]
        else:
            m = max(sv)
            ex = [math.exp(x - m) for x in sv]
            z = sum(ex)
            weights = [e / z for e in ex]
        rkl.append(sum(w * (a - b) for w, a, b in zip(weights, sv, tv, strict=True)))
    return BaselineResult(index, teacher_lp, rkl)


async def baseline_score(
    samples: Sequence[Sample] | AsyncIterable[Sample],
    teacher_url: str,
    *,
    student_url: str | None = None,
    top_k: int = 0,
    strategy: str = "only-student",
    id_form: IdForm = "flat",
    cap_s: float | None = None,
) -> BaselineOutcome:
    """Score ``samples`` the reference way (see the module docstring).

    Student-p weights only (the reference's default). ``cap_s`` bounds the whole run: what
    finished by then is kept, the rest is cancelled and ``timed_out`` is set.
    """
    out = BaselineOutcome()
    answers: dict[int, tuple[Any, Any]] = {}
    kept: dict[int, Sample] = {}
    tasks: list[asyncio.Task[None]] = []

    async def feed() -> None:
        if isinstance(samples, AsyncIterable):
            i = 0
            async for s in samples:
                kept[i] = s
                tasks.append(asyncio.ensure_future(_go(s, i)))
                i += 1
        else:
            for i, s in enumerate(samples):
                kept[i] = s
                tasks.append(asyncio.ensure_future(_go(s, i)))
        await asyncio.gather(*tasks)

    async def _go(s: Sample, i: int) -> None:
        await _score_one(s, i, teacher_url, student_url, top_k, strategy, id_form, answers, out)

    try:
        await asyncio.wait_for(feed(), cap_s)
    except TimeoutError:
        out.timed_out = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # The whole batch is in: one serial pure-Python pass over everything kept.
    for i in sorted(answers):
        teacher, student = answers[i]
        out.results[i] = _kl_pass(kept[i], teacher, student, top_k, strategy, i)
    out.finished = len(out.results)
    out.done_at = time.perf_counter()
    return out

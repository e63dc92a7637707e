"""Miles' own OPD scorer, run as Miles runs it, for ``bench.cpu_burst``.

``miles/rollout/on_policy_distillation.py`` (radixark/miles, loaded from a repository at
hand by :mod:`opd_stream.testing._miles_source`: ``MILES_REPO``, else this machine's
mirror): ``reward_func`` for every sample at once (Miles' rollout gathers one per sample),
each answer kept on its sample, then ``post_process_rewards`` over the batch, which stores
each sample's ``opd_reverse_kl``. Top-k only-student, ``student_p`` weights, per-position
ids (``--opd-topk-per-position``), the student's top-k as Python rows in the sample's
metadata, the way Miles' rollout leaves them.

``bench.baseline`` does the same work the same way without Miles' code (it runs where
Miles' source is not at hand); the bench reports both.
"""

from __future__ import annotations

import asyncio
import types
from argparse import Namespace

import numpy as np
import numpy.typing as npt

from opd_stream import Sample
from opd_stream.testing._miles_source import MILES_SCORER_FILES, load_miles_module

__all__ = ("MilesScorer", "load_miles_scorer")


class MilesScorer:
    """Miles' scorer, one burst at a time (:meth:`score`)."""

    def __init__(self, module: types.ModuleType, teacher: str, top_k: int) -> None:
        self._module = module
        self._args = Namespace(
            opd_log_prob_top_k=top_k,
            opd_top_k_strategy="only-student",
            opd_reward_weight_mode="student_p",
            opd_topk_per_position=True,
            rm_url=f"{teacher}/generate",
            opd_teacher_urls=None,
            sglang_router_request_timeout_secs=None,
            reward_key=None,
        )

    def samples(self, samples: list[Sample]) -> list[object]:
        """Miles' own samples for ``samples`` (their student top-k as Python rows): made
        before a burst, as Miles' rollout has them when it scores."""
        out = []
        for s in samples:
            rows = s.student_top_logprobs
            if not isinstance(rows, list):
                raise ValueError("Miles' scorer takes the student's top-k as Python rows")
            out.append(
                self._module.Sample(
                    tokens=list(s.tokens),
                    response_length=s.response_length,
                    metadata={"opd_student_top_logprobs": rows},
                )
            )
        return out

    async def score(self, samples: list[object]) -> list[npt.NDArray[np.float32]]:
        """One burst: every sample's reward at once, then the batch's post-processing;
        each sample's ``opd_reverse_kl``."""
        module, args = self._module, self._args
        rewards = await asyncio.gather(*(module.reward_func(args, s) for s in samples))
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = reward  # type: ignore[attr-defined]
        module.post_process_rewards(args, samples)
        out = [s.opd_reverse_kl.numpy() for s in samples]  # type: ignore[attr-defined]
        for s in samples:  # (a burst's answers are not kept into the next one)
            s.reward = None  # type: ignore[attr-defined]
        del rewards
        # The loop's callbacks the finished requests left (the done tasks, the closed
        # connections) hold the parsed answers until they run: run them here, so that the
        # answers are freed within Miles' own measurement, not within whatever runs next
        # (measured: the next stream's loop paid ~2 ms a sample more).
        await asyncio.sleep(0)
        return out


def load_miles_scorer(teacher: str, top_k: int) -> MilesScorer | None:
    """Miles' scorer against ``teacher`` (a base URL), or None without Miles' source."""
    module = load_miles_module(MILES_SCORER_FILES, "miles.rollout.on_policy_distillation")
    return None if module is None else MilesScorer(module, teacher, top_k)

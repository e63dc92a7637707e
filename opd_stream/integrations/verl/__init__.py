"""verl drop-in: SGLang teacher logprobs in verl's vLLM ``prompt_logprobs`` contract.

:class:`TeacherManager` replaces verl's ``AsyncTeacherLLMServerManager``: it scores through
one shared :class:`~opd_stream.OPDStream` and returns verl's ``(ids int32 [S, K], logprobs
float32 [S, K])``. :func:`extract_prompt_logprobs` is the lower-level converter of one
SGLang ``/generate`` answer (asked with :func:`sglang_prompt_logprobs_params`; nested or
flat forms) into verl's lists: per sequence of ``S`` tokens, rows ``j < S - 1`` predict
token ``j + 1`` (``[token_id]`` / ``[logprob]`` with ``k = 0``, else the top-k best first),
then one pad row of zeros; every row ``max(k, 1)`` wide. It never asserts: a short or
misaligned answer raises :class:`~opd_stream.MisalignedResponseError`, a missing field
:class:`~opd_stream.MalformedResponseError`; SGLang's ``null`` and any NaN become ``-inf``.
"""

from __future__ import annotations

from ._prompt_logprobs import (
    extract_prompt_logprobs,
    fill_prompt_logprobs,
    sglang_prompt_logprobs_params,
)
from ._teacher_manager import TeacherManager, verl_teacher_names, verl_top_k

__all__ = (
    "TeacherManager",
    "extract_prompt_logprobs",
    "fill_prompt_logprobs",
    "sglang_prompt_logprobs_params",
    "verl_teacher_names",
    "verl_top_k",
)

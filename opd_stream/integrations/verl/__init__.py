"""verl drop-in: SGLang teacher logprobs in verl's vLLM ``prompt_logprobs`` contract.

verl's distillation teacher manager consumes, per sequence of ``sequence_length`` tokens,
two lists of ``sequence_length`` rows each, every row ``max(k, 1)`` wide:

* ``prompt_ids[j]`` / ``prompt_logprobs[j]`` for ``j < sequence_length - 1``: the
  prediction of token ``j + 1`` (position 0 has no context and is skipped): with
  ``k = 0`` the scored token itself ``[token_id]`` / ``[logprob]``; with ``k > 0`` the
  teacher's top-k there, best first.
* one pad row last, ``[0] * max(k, 1)`` / ``[0.0] * max(k, 1)``.

:class:`TeacherManager` is a drop-in for verl's ``AsyncTeacherLLMServerManager``: it
scores against external SGLang teacher servers through one shared
:class:`~opd_stream.OPDStream` (pooled connections, per-endpoint bounds, retries, deadlines,
replica balancing) and returns verl's ``(ids int32 [S, K], logprobs float32 [S, K])``
tensors. :func:`extract_prompt_logprobs` is the lower-level converter.

The converter builds those lists from an SGLang ``/generate`` answer asked with
:func:`sglang_prompt_logprobs_params` (``logprob_start_len = 0``), in the nested form
(``[logprob, token_id, text]`` triples) or the flat forms of SGLang >= 0.5.23 (base64 or
plain lists). Unlike verl's own ``_extract_prompt_logprobs_sglang`` it never asserts: a
short or misaligned
answer raises :class:`~opd_stream.MisalignedResponseError` naming the position and the
counts, a missing field :class:`~opd_stream.MalformedResponseError`, a bad argument
:class:`~opd_stream.ConfigError`, an aborted answer :class:`~opd_stream.ServerAbortError`.
SGLang's ``null`` logprob (``-inf``), and NaN in any form, becomes ``float("-inf")``.
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

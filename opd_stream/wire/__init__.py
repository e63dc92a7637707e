"""SGLang ``/generate`` (and vLLM) wire building blocks, for callers who talk to the servers
themselves.

The stream uses these internally; an application normally needs none of them. Sans-IO:
bytes in, bytes or numpy arrays out.

* :class:`ScoreRequest`, :func:`build_score_payload`, :func:`decode_score_response`,
  :class:`ScoreRows`: one scoring question (sampled-token logprobs, top-k, requested ids
  per position, flat or in blocks) and its validated answer;
* :func:`build_generate_payload`, :func:`decode_generate_response`, :class:`Generation`:
  a sampling (rollout) request and its answer, top-k included;
* :func:`parse_student_topk`: a rollout's Python top-k rows into arrays;
* :func:`parse_error_message`: the server's message from an error body, redacted.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

from __future__ import annotations

from ._answers import Generation, ScoreRows
from ._codec import decode_score_response
from ._decode_generate import decode_generate_response
from ._error_body import parse_error_message
from ._payloads import build_generate_payload, build_score_payload
from ._request import ScoreRequest
from ._student_topk import parse_student_topk

__all__ = (
    "Generation",
    "ScoreRequest",
    "ScoreRows",
    "build_generate_payload",
    "build_score_payload",
    "decode_generate_response",
    "decode_score_response",
    "parse_error_message",
    "parse_student_topk",
)

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

Its modules (private; the names above are the public part):

* ``_answers``: the wire's model: a decoded answer (:class:`ScoreRows`, :class:`Generation`),
  an answer's body, and one HTTP item as the decoders see it (``Segment``);
* ``_request``: :class:`ScoreRequest` and its layout (what each HTTP item asks);
* ``_payloads``: request bodies as ``/generate`` JSON bytes (a vLLM request's from ``_vllm``);
* ``_rows_json``: rows of ids as compact JSON (the per-position id rows of both engines);
* ``_vllm``: vLLM's engines: their paths, what each can score, probe and request bodies;
* ``_vllm_decode``: vLLM answers (scale-out and completions) into checked rows;
* ``_npy``: a base64 ``.npy`` float32 matrix read from an untrusted answer;
* ``_codec``: a scoring request built and its answer decoded, by whichever parser is ready;
* ``_decode_score``: the msgspec decoder of scoring answers (and the answer schema);
* ``_decode_columns``: scoring answers decoded from a reader's checked columns;
* ``_columns``: the checked columns a reader gives;
* ``_scan_reader``: the compiled scanner as a reader (it hands the scanner the schema);
* ``_checks``: the array-level checks both parsers share;
* ``_entries``: the msgspec entry types the decoders share;
* ``_decode_generate``: the msgspec decoder of sampling answers;
* ``_student_topk``: a rollout's top-k rows as arrays;
* ``_error_body``: the server's message from an error body, redacted.
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

"""The JSON Lines schemas of ``opd-stream score`` and the sans-IO line codecs: plain functions
and msgspec Structs, usable without a server or an event loop (the runner is
:mod:`opd_stream.cli._score`).

* :class:`InputLine` / :func:`decode_line`: one input line -> a :class:`Sample` whose
  ``sample_id`` is a :class:`LineRef`, or an :class:`InvalidSampleError` that names the
  field and never repeats the line; :func:`line_failure`: the result of such a line;
* :class:`ScoredLine` / :class:`FailedLine` / :func:`render_result`: one output line.

Probability 0 is written ``null`` in every output line (``teacher_logprobs`` and
``candidates``, values at or below ``LOGPROB_FLOOR`` included); ``reverse_kl`` and
``weights`` are computed with the floor: never ``null``, never NaN.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

from .._errors import InvalidSampleError
from .._sample import Sample, SampleFailure, ScoredSample
from ..kl._names import LOGPROB_FLOOR
from ..wire._student_topk import MAX_TOKEN_ID
from ..xtok._chat import TeacherPrompts

if TYPE_CHECKING:
    import torch

    from .._pipeline import Result

__all__ = (
    "AlignmentLine",
    "CandidatesLine",
    "FailedLine",
    "InputLine",
    "LineRef",
    "ScoredLine",
    "decode_line",
    "line_failure",
    "line_ref_of",
    "render_result",
)

_MAX_MESSAGE = 300  # characters of a decode error message kept

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
"""A token id as the input schema accepts it: an integer in ``[0, 2**31 - 1]``."""


# --- input schema -------------------------------------------------------------------------


class InputLine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One input line: a JSON object with these keys (any other key is an error).

    Attributes:
        id: any JSON value, copied verbatim to the output line; default: the 0-based
            index of the line among the non-blank lines.
        prompt_ids: prompt token ids (non-empty); with ``response_ids``.
        response_ids: response token ids (may be empty); with ``prompt_ids``.
        tokens: prompt + response token ids; with ``response_length`` (instead of
            ``prompt_ids`` + ``response_ids``).
        response_length: R, the number of trailing ``tokens`` that are the response.
        teacher: the teacher name (stored in ``metadata[teacher_key]``); default: the
            default teacher.
        rollout_logprobs: the student's logprob of each response token (R finite floats).
        student_top_logprobs: one row per response token of ``[logprob, token_id]`` pairs
            (or SGLang ``[logprob, token_id, text]`` triples), best first; ``null`` logprob
            means ``-inf``.
        metadata: an object, passed on as ``Sample.metadata``.
        teacher_prompt_ids: the teacher's own prompt token ids (non-empty), when the teacher
            sees another context than the student (``Sample.teacher_prompt_ids``): teacher
            requests send it + the response.
        prompt_messages: the prompt as chat messages (``[{"role", "content"}, ...]``, or a
            string: one user message), for a teacher with its own tokenizer
            (``--teacher-tokenizer``): rendered with its chat template into
            ``teacher_prompt_ids`` (not with ``teacher_prompt_ids``).
    """

    id: msgspec.Raw = msgspec.Raw()
    prompt_ids: list[TokenId] | None = None
    response_ids: list[TokenId] | None = None
    tokens: list[TokenId] | None = None
    response_length: Annotated[int, msgspec.Meta(ge=0)] | None = None
    teacher: str | None = None
    rollout_logprobs: list[float] | None = None
    student_top_logprobs: list[list[Any]] | None = None
    metadata: dict[str, Any] | None = None
    teacher_prompt_ids: list[TokenId] | None = None
    prompt_messages: list[dict[str, Any]] | str | None = None


class _IdOnly(msgspec.Struct):
    """Lenient view of a line that failed the schema: only its ``id``, if it is JSON."""

    id: msgspec.Raw = msgspec.Raw()


class LineRef(msgspec.Struct, frozen=True):
    """Where a sample came from; carried as ``Sample.sample_id`` through the stream.

    Attributes:
        seq: 0-based index among the non-blank input lines.
        line: 1-based line number in the input (blank lines counted).
        id: the output ``id``, as raw JSON.
    """

    seq: int
    line: int
    id: msgspec.Raw


_DECODER = msgspec.json.Decoder(InputLine)
_ID_DECODER = msgspec.json.Decoder(_IdOnly)
_PATH_FIELD = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN_KEY = re.compile(r"unknown field `(.*)`", re.DOTALL)
_FIELD_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _default_id(seq: int) -> msgspec.Raw:
    return msgspec.Raw(str(seq).encode())


def _is_utf8(raw: msgspec.Raw) -> bool:
    """msgspec copies a ``Raw`` value's bytes unchecked; the output must stay valid JSON."""
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _line_id(data: bytes, seq: int) -> msgspec.Raw:
    """The ``id`` of a line that failed the schema, when it is readable, else the default."""
    try:
        raw = _ID_DECODER.decode(data).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _default_id(seq)
    return raw.copy() if len(raw) and _is_utf8(raw) else _default_id(seq)


def _shown_key(match: re.Match[str]) -> str:
    """An unknown key is named when it looks like a misspelt field (a short identifier);
    any other key is the line's own text, and not repeated."""
    key = match.group(1)
    if _FIELD_LIKE.fullmatch(key):
        return f"unknown field `{key}`"
    return "unknown field (a key that is no field name; not shown)"


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _keys_below(value: dict[str, Any]) -> int:
    """The keys of ``value`` and of every object inside it (as decoded: each distinct
    once); a loop, not a recursion, however deep the nesting."""
    count = 0
    todo: list[Any] = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            count += len(item)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return count


_NULLABLE_FIELDS = tuple(name for name in InputLine.__struct_fields__ if name != "id")


def _distinct_keys(parsed: InputLine) -> int:
    """A lower bound of the distinct keys of a decoded line: its top-level keys with a
    non-null value, and every key of ``metadata`` and below."""
    count = 1 if len(parsed.id) else 0
    for name in _NULLABLE_FIELDS:
        if getattr(parsed, name) is not None:
            count += 1
    if parsed.metadata is not None:
        count += _keys_below(parsed.metadata)
    return count


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[{}]')
"""A JSON string (a key when a ``:`` follows it), or a brace: enough to see, in a line
msgspec has accepted, which keys each object holds."""


def _check_duplicate_keys(data: bytes, distinct: int) -> None:
    """Raise when an object of the line (msgspec has accepted it) holds a key twice.

    msgspec keeps the last value of a repeated key without a word; the schema is strict, so
    a repeated key fails its line. Each key has one ``:`` after it, and ``distinct`` (at
    most the keys msgspec kept, :func:`_distinct_keys`) cannot exceed the keys written, so
    when the line's ``:`` count equals it no key is repeated: one ``bytes.count`` (~0.3 ms
    per MB). Else the count again with every string emptied (a ``:`` inside a string, ~6
    ms per MB of strings), and only when that differs too, the keys of every object read
    one by one.

    Raises:
        InvalidSampleError: naming the repeated key when it is one of the schema's, else
            the schema key it is under (the key itself is the line's and not repeated).
    """
    if data.count(b":") == distinct or _JSON_STRING.sub(b'""', data).count(b":") == distinct:
        return
    stack: list[set[bytes]] = []
    top_key: list[bytes] = []  # the schema key each nested object is under
    pending = b""  # the last key of the top-level object
    for token in _JSON_TOKEN.finditer(data):
        text = token.group(0)
        if text == b"{":
            stack.append(set())
            if len(stack) == 2:
                top_key.append(pending)
            continue
        if text == b"}":
            if len(stack) == 2:
                top_key.pop()
            stack.pop()
            continue
        if token.group(1) is None or not stack:
            continue  # a string value
        raw = text[: text.rindex(b'"') + 1]
        key = msgspec.json.decode(raw).encode() if b"\\" in raw else raw[1:-1]
        if len(stack) == 1:
            pending = key
        if key in stack[-1]:
            if len(stack) == 1:
                raise InvalidSampleError(key.decode(), "the key is given twice")
            raise InvalidSampleError(top_key[0].decode(), "holds an object that gives a key twice")
        stack[-1].add(key)


def decode_line(
    data: bytes,
    *,
    line: int,
    seq: int,
    teacher_key: str = "opd_teacher",
    default_teacher: str | None = None,
    teacher_prompts: TeacherPrompts | None = None,
    own_tokenizer: Collection[str] = (),
) -> Sample:
    """Turn one input line into a :class:`Sample` (``sample_id`` = :class:`LineRef`).

    Only the line's own shape is checked here (JSON, schema, which token keys are given);
    the rest (``response_length`` range, rollout and top-k values, routing) is checked by
    the stream at intake, where it fails the sample alone like any other sample.

    Args:
        data: the line, without its newline (surrounding whitespace is allowed).
        line: its 1-based line number (for :class:`LineRef`).
        seq: its 0-based index among non-blank lines (the default ``id``).
        teacher_key: the metadata key that names the teacher.
        default_teacher: put into ``metadata[teacher_key]`` when the line names no teacher.
        teacher_prompts: renders ``prompt_messages`` with the line's teacher's chat template.
        own_tokenizer: the teachers with a tokenizer of their own (``--teacher-tokenizer``):
            a line of one of them gives ``prompt_messages`` or ``teacher_prompt_ids``.

    Raises:
        InvalidSampleError: not JSON (field ``json``; nesting too deep included), not the
            schema (the field named by the error path, or ``schema``), an ``id`` that is not
            valid UTF-8, a missing or conflicting token key, an empty ``prompt_ids``, or
            ``teacher`` disagreeing with ``metadata[teacher_key]``, no teacher prompt for a
            teacher with its own tokenizer. Messages carry field names, positions and
            types, never values.
    """
    try:
        parsed = _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        text = _UNKNOWN_KEY.sub(_shown_key, str(exc))
        match = _PATH_FIELD.search(text)
        raise InvalidSampleError(match.group(1) if match else "schema", _clip(text)) from None
    except msgspec.DecodeError as exc:
        raise InvalidSampleError("json", _clip(str(exc))) from None
    except RecursionError:
        raise InvalidSampleError("json", "nested too deeply to be read") from None
    if len(parsed.id) and not _is_utf8(parsed.id):
        raise InvalidSampleError("id", "holds a string that is not valid UTF-8")
    _check_duplicate_keys(data, _distinct_keys(parsed))

    split = parsed.prompt_ids is not None or parsed.response_ids is not None
    joined = parsed.tokens is not None or parsed.response_length is not None
    if split and joined:
        raise InvalidSampleError(
            "tokens", "give prompt_ids + response_ids or tokens + response_length, not both"
        )
    if split:
        if parsed.prompt_ids is None:
            raise InvalidSampleError("prompt_ids", "required with response_ids")
        if parsed.response_ids is None:
            raise InvalidSampleError("response_ids", "required with prompt_ids")
        if not parsed.prompt_ids:
            raise InvalidSampleError(
                "prompt_ids", "must not be empty (at least one prompt token precedes the response)"
            )
        tokens = np.array(parsed.prompt_ids + parsed.response_ids, dtype=np.int64)
        response_length = len(parsed.response_ids)
    elif joined:
        if parsed.tokens is None:
            raise InvalidSampleError("tokens", "required with response_length")
        if parsed.response_length is None:
            raise InvalidSampleError("response_length", "required with tokens")
        tokens = np.array(parsed.tokens, dtype=np.int64)
        response_length = parsed.response_length
    else:
        raise InvalidSampleError(
            "prompt_ids", "required: give prompt_ids + response_ids (or tokens + response_length)"
        )

    metadata = dict(parsed.metadata) if parsed.metadata is not None else {}
    if parsed.teacher is not None:
        given = metadata.get(teacher_key)
        if given is not None and str(given) != parsed.teacher:
            raise InvalidSampleError("teacher", f"disagrees with metadata[{teacher_key!r}]")
        metadata[teacher_key] = parsed.teacher
    elif metadata.get(teacher_key) is None and default_teacher is not None:
        metadata[teacher_key] = default_teacher

    rollout = None
    if parsed.rollout_logprobs is not None:
        rollout = np.asarray(parsed.rollout_logprobs, dtype=np.float64)
    ident = parsed.id.copy() if len(parsed.id) else _default_id(seq)
    teacher_prompt = None
    if parsed.teacher_prompt_ids is not None:  # (an empty one fails at intake, named)
        teacher_prompt = np.array(parsed.teacher_prompt_ids, dtype=np.int64)
    name = metadata.get(teacher_key)
    if parsed.prompt_messages is not None:
        if teacher_prompt is not None:
            raise InvalidSampleError(
                "prompt_messages", "give teacher_prompt_ids or prompt_messages, not both"
            )
        prompts = teacher_prompts if teacher_prompts is not None else TeacherPrompts(None)
        teacher_prompt = prompts.ids(str(name), parsed.prompt_messages, "prompt_messages")
    elif teacher_prompt is None and name is not None and str(name) in own_tokenizer:
        raise InvalidSampleError(
            "teacher_prompt_ids",
            f"required: teacher {str(name)!r} has its own tokenizer (--teacher-tokenizer), "
            "so the line gives its prompt: as prompt_messages (chat messages, rendered with "
            "the teacher's chat template) or as teacher_prompt_ids (the teacher's own ids)",
        )
    return Sample(
        tokens,
        response_length,
        metadata=metadata,
        rollout_logprobs=rollout,
        student_top_logprobs=parsed.student_top_logprobs,
        sample_id=LineRef(seq, line, ident),
        teacher_prompt_ids=teacher_prompt,
    )


def line_failure(data: bytes, *, line: int, seq: int, error: InvalidSampleError) -> SampleFailure:
    """The failure of a line that did not decode, in the stream's result type."""
    ref = LineRef(seq, line, _line_id(data, seq))
    return SampleFailure(
        sample=Sample([], 0, sample_id=ref),
        index=seq,
        reason=error.reason,
        message=str(error),
        attempts=0,
    )


# --- output schema ------------------------------------------------------------------------


class CandidatesLine(msgspec.Struct, kw_only=True):
    """Top-k candidate arrays of one sample, each ``[R][C]`` (``--with-candidates``).

    ``ids`` is -1 and the values are 0 where ``mask`` is false (unused slots). With the tail
    bucket (``OPD_STREAM_TAIL``), ``student_tail_logprobs`` and ``teacher_tail_logprobs``
    (``[R]``, always finite) are each model's log-mass outside the candidates; else absent.
    """

    ids: list[list[int]]
    student_logprobs: list[list[float | None]]
    teacher_logprobs: list[list[float | None]]
    weights: list[list[float]]
    mask: list[list[bool]]
    student_tail_logprobs: list[float] | msgspec.UnsetType = msgspec.UNSET
    teacher_tail_logprobs: list[float] | msgspec.UnsetType = msgspec.UNSET


class AlignmentLine(msgspec.Struct, kw_only=True):
    """The span alignment of a teacher with its own tokenizer (``--with-alignment``; see
    :class:`~opd_stream.TokenAlignment`)."""

    teacher_ids: list[int]
    teacher_token_logprobs: list[float | None]
    student_spans: list[int]
    teacher_spans: list[int]
    span_bytes: list[int]
    scored: list[bool]


class ScoredLine(msgspec.Struct, kw_only=True):
    """An output line for a scored sample (``ok`` is true).

    ``teacher_logprobs`` may hold ``null`` (-inf); ``reverse_kl`` is null in sampled-token
    mode without ``rollout_logprobs``; ``candidates`` is present only in top-k mode with
    ``--with-candidates``. With ``--divergence forward_kl`` or ``jsd``, ``reverse_kl`` is
    null and ``divergence`` (its name) and ``signal`` (its values) are present; with the
    default ``reverse_kl`` they are absent (the line is as it always was).
    """

    id: msgspec.Raw
    line: int
    ok: bool
    teacher: str
    response_length: int
    teacher_logprobs: list[float | None]
    reverse_kl: list[float] | None
    attempts: int
    latency_s: float
    candidates: CandidatesLine | msgspec.UnsetType = msgspec.UNSET
    alignment: AlignmentLine | msgspec.UnsetType = msgspec.UNSET
    divergence: str | msgspec.UnsetType = msgspec.UNSET
    signal: list[float] | msgspec.UnsetType | None = msgspec.UNSET


class FailedLine(msgspec.Struct, kw_only=True):
    """An output line for a sample that could not be scored (``ok`` is false)."""

    id: msgspec.Raw
    line: int
    ok: bool
    reason: str
    message: str
    attempts: int


def line_ref_of(item: Result) -> LineRef:
    """The :class:`LineRef` of a result whose sample :func:`decode_line` (or
    :func:`line_failure`) made.

    Raises:
        TypeError: the sample's ``sample_id`` is not a :class:`LineRef`.
    """
    ref = item.sample.sample_id
    if not isinstance(ref, LineRef):
        raise TypeError(f"expected a sample from decode_line, got sample_id {type(ref).__name__}")
    return ref


def _logprob_rows(values: torch.Tensor) -> list[list[float | None]]:
    """Candidate logprobs as lists; the floor (probability 0) becomes -inf, written ``null``."""
    floored = values <= LOGPROB_FLOOR
    if bool(floored.any()):
        values = values.masked_fill(floored, -math.inf)
    rows: list[list[float | None]] = values.tolist()
    return rows


def render_result(item: Result, *, with_candidates: bool = False) -> bytes:
    """Render one result as an output line: a JSON object followed by ``\\n``.

    Float32 values become the Python floats they equal (so reading them back as float32
    is exact); probability 0 is ``null`` in every logprob list (see the module docstring).

    Args:
        item: a result of a sample made by :func:`decode_line` (its ``sample_id`` is a
            :class:`LineRef`), or a line failure.
        with_candidates: include ``candidates`` (top-k mode only; they are large).

    Raises:
        TypeError: the sample's ``sample_id`` is not a :class:`LineRef`.
    """
    ref = line_ref_of(item)
    out: ScoredLine | FailedLine
    if isinstance(item, ScoredSample):
        candidates: CandidatesLine | msgspec.UnsetType = msgspec.UNSET
        if with_candidates and item.candidates is not None:
            c = item.candidates
            candidates = CandidatesLine(
                ids=c.ids.tolist(),
                student_logprobs=_logprob_rows(c.student_logprobs),
                teacher_logprobs=_logprob_rows(c.teacher_logprobs),
                weights=c.weights.tolist(),
                mask=c.mask.tolist(),
            )
            if c.student_tail_logprobs is not None and c.teacher_tail_logprobs is not None:
                candidates.student_tail_logprobs = c.student_tail_logprobs.tolist()
                candidates.teacher_tail_logprobs = c.teacher_tail_logprobs.tolist()
        out = ScoredLine(
            id=ref.id,
            line=ref.line,
            ok=True,
            teacher=item.teacher,
            response_length=item.sample.response_length,
            teacher_logprobs=item.teacher_logprobs.tolist(),
            reverse_kl=None if item.reverse_kl is None else item.reverse_kl.tolist(),
            attempts=item.attempts,
            latency_s=item.latency_s,
            candidates=candidates,
        )
        if item.alignment is not None:
            a = item.alignment
            out.alignment = AlignmentLine(
                teacher_ids=a.teacher_ids.tolist(),
                teacher_token_logprobs=a.teacher_token_logprobs.tolist(),
                student_spans=a.student_spans.tolist(),
                teacher_spans=a.teacher_spans.tolist(),
                span_bytes=a.span_bytes.tolist(),
                scored=a.scored.tolist(),
            )
        if item.divergence != "reverse_kl":
            out.divergence = item.divergence
            out.signal = None if item.signal is None else item.signal.tolist()
    else:
        out = FailedLine(
            id=ref.id,
            line=ref.line,
            ok=False,
            reason=item.reason,
            message=item.message,
            attempts=item.attempts,
        )
    return msgspec.json.encode(out) + b"\n"

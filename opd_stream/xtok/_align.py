"""Cross-tokenizer alignment of one response, and the sampled-token signal per span.

Student and teacher tokens of the same response text are grouped into the smallest
**spans** whose byte boundaries coincide; a span's signal is ``sum(student logprobs) -
sum(teacher logprobs)`` over its tokens. The whole value goes on the span's **last** student
token, 0 on the others, so ``sum(reverse_kl)`` is the response text's sequence-level
log-ratio. Textless tokens (:mod:`opd_stream.xtok._vocab`) and a last span cut inside a
UTF-8 character are not scored (0). Bad input fails alone
(:class:`~opd_stream._errors.InvalidSampleError`, field ``tokens``). The rules in full:
``docs/design-notes.md``, "opd_stream/xtok/_align.py".
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import InvalidSampleError
from ._vocab import Vocab

__all__ = (
    "Alignment",
    "align_response",
    "byte_twins",
    "candidate_rows",
    "one_to_one",
    "span_signal",
    "teacher_candidates",
)

IntArray = npt.NDArray[np.int64]


class Alignment(msgspec.Struct, frozen=True, kw_only=True):
    """The alignment of one response (numpy arrays; ``n`` spans).

    Attributes:
        teacher_ids: int64 ``[R_t]``, the teacher tokenizer's ids of the response text.
        student_spans: int64 ``[n + 1]``: span ``j`` is student response tokens
            ``student_spans[j] : student_spans[j + 1]`` (0 first, ``R`` last).
        teacher_spans: int64 ``[n + 1]``: span ``j`` is teacher response tokens
            ``teacher_spans[j] : teacher_spans[j + 1]`` (0 first, ``R_t`` last).
        span_bytes: int64 ``[n + 1]``, the spans' byte offsets in the response's bytes.
        scored: bool ``[n]``: the span is compared (False: textless tokens only, or the
            incomplete final character; value 0).
        textless: bool ``[R]``: student tokens with no bytes.
    """

    teacher_ids: IntArray
    student_spans: IntArray
    teacher_spans: IntArray
    span_bytes: IntArray
    scored: npt.NDArray[np.bool_]
    textless: npt.NDArray[np.bool_]


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n)
    return int(np.argmax(x)) if x.any() else n


def align_response(student: Vocab, teacher: Vocab, ids: IntArray, teacher_name: str) -> Alignment:
    """Align the student response ``ids`` with the teacher tokenizer's ids of its text.

    Raises:
        InvalidSampleError: (field ``tokens``) an id outside the student vocabulary, bytes
            that are not UTF-8 (but for a final character cut short), or text the teacher
            tokenizer does not round-trip.
    """
    r = int(ids.shape[0])
    if r and int(ids.max()) >= student.size:
        p = int(np.argmax(ids >= student.size))
        raise InvalidSampleError(
            "tokens",
            f"response token id {int(ids[p])} at response position {p} is outside the student "
            f"tokenizer's vocabulary (size {student.size}, {student.path})",
        )
    lengths = student.lengths[ids]
    ends = np.cumsum(lengths)
    data = student.join(ids, ends)
    total = len(data)
    cut = total
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.end != total or exc.reason != "unexpected end of data":
            p = int(np.searchsorted(ends, exc.start, side="right"))
            raise InvalidSampleError(
                "tokens",
                f"the response is not UTF-8 text at byte {exc.start} (student token at response "
                f"position {p}): teacher {teacher_name!r} has another tokenizer and needs text",
            ) from None
        cut = exc.start
        text = data[:cut].decode("utf-8")
    t_ids = teacher.encode(text)
    t_lengths = teacher.lengths[t_ids]
    t_ends = np.cumsum(t_lengths)
    t_bytes = teacher.join(t_ids, t_ends)
    if t_bytes != data[:cut]:
        off = _first_difference(t_bytes, data[:cut])
        raise InvalidSampleError(
            "tokens",
            f"teacher {teacher_name!r}'s tokenizer ({teacher.path}) does not round-trip the "
            f"response text: its tokens spell other bytes from byte {off} on (of {cut}; a "
            "normaliser changed the text)",
        )
    # The common boundaries: the student tokens' ends that are teacher tokens' ends (both
    # strictly increasing over tokens with bytes; the teacher's tokens of text all have
    # bytes, but a tokenizer that gave one without is still aligned exactly).
    zero = lengths == 0
    any_zero = bool(zero.any())
    t_unique = bool((t_lengths > 0).all())
    s_ends = ends[~zero] if any_zero else ends
    s_common = np.isin(s_ends, t_ends, assume_unique=t_unique)
    common = s_ends[s_common]
    if cut < total:
        common = np.append(common, total)
    # A key per token, non-decreasing along each side: a token with bytes in byte span k
    # (bytes common[k-1] .. common[k]) has 2k + 1; textless tokens at a common boundary
    # before span k have 2k, inside span k 2k + 1. k, the number of common boundaries
    # before the token's end, counts the earlier tokens whose end is one (the appended
    # ``total`` is before none).
    if any_zero:
        on = np.zeros(r, dtype=np.int64)
        on[~zero] = s_common
    else:
        on = s_common.astype(np.int64)
    k = np.cumsum(on) - on
    keys = 2 * k + 1
    if any_zero:
        pos = ends[zero]
        at = np.searchsorted(common, pos, side="left")
        on_boundary = np.append(common, -1)[at] == pos
        keys[zero] = np.where(pos == 0, 0, np.where(on_boundary, 2 * (at + 1), 2 * at + 1))
    if t_unique:
        t_on = np.isin(t_ends, s_ends, assume_unique=True).astype(np.int64)
        t_keys = 2 * (np.cumsum(t_on) - t_on) + 1
    else:
        t_keys = 2 * np.searchsorted(common, t_ends, side="left") + 1
    starts = np.flatnonzero(np.diff(keys)) + 1
    span_keys = keys[np.concatenate([[0], starts])] if r else keys[:0]
    student_spans = np.concatenate([[0], starts, [r]] if r else [[0]]).astype(np.int64)
    t_starts = np.searchsorted(t_keys, span_keys, side="left")
    teacher_spans = np.concatenate([t_starts, [t_ids.shape[0]]]).astype(np.int64)
    span_bytes = np.concatenate([[0], ends[student_spans[1:] - 1]]) if r else np.zeros(1, np.int64)
    scored = (span_keys % 2 == 1) & (teacher_spans[1:] > teacher_spans[:-1])
    if cut < total:  # the last byte span holds the incomplete character
        scored &= span_keys != 2 * (common.shape[0] - 1) + 1
    return Alignment(
        teacher_ids=t_ids,
        student_spans=student_spans,
        teacher_spans=teacher_spans,
        span_bytes=span_bytes.astype(np.int64),
        scored=scored,
        textless=zero,
    )


def span_signal(
    alignment: Alignment,
    teacher_lps: npt.NDArray[np.float32],
    student_lps: npt.NDArray[np.float32] | None,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32] | None]:
    """Per student response token: the teacher's log-probability of each span, and the
    span's reverse-KL estimate, both on the span's last student token (0 elsewhere and on
    spans not scored). Sums in float64, results float32.

    Args:
        alignment: from :func:`align_response`.
        teacher_lps: ``[R_t]``, the teacher's logprob of each of its tokens.
        student_lps: ``[R]``, the student's rollout logprobs, or None (no reverse KL).

    Returns:
        ``(teacher_logprobs [R], reverse_kl [R] or None)``.
    """
    s_spans, t_spans, scored = alignment.student_spans, alignment.teacher_spans, alignment.scored
    r = int(s_spans[-1])
    teacher_out = np.zeros(r, dtype=np.float32)
    rkl = None if student_lps is None else np.zeros(r, dtype=np.float32)
    if r == 0:
        return teacher_out, rkl
    last = s_spans[1:][scored] - 1
    # reduceat: a span of one token sums to that token's value exactly (a difference of
    # running sums would not); the appended 0 lets a span start at R_t (no teacher token)
    t = np.append(teacher_lps.astype(np.float64), 0.0)
    t_sum = np.add.reduceat(t, t_spans[:-1])[scored]
    teacher_out[last] = t_sum
    if student_lps is None or rkl is None:
        return teacher_out, None
    counted = np.where(alignment.textless, 0.0, student_lps.astype(np.float64))
    s_sum = np.add.reduceat(counted, s_spans[:-1])[scored]
    rkl[last] = s_sum - t_sum
    return teacher_out, rkl


# --- top-k (only-student) with a teacher of another tokenizer -------------------------------


def byte_twins(student: Vocab, teacher: Vocab) -> IntArray:
    """``twin[v]``: the teacher id whose bytes are student id ``v``'s (the smallest such id),
    or -1 (no teacher token spells them; textless ids have none). int64 ``[student.size]``."""
    index: dict[bytes, int] = {}
    for i in range(teacher.size - 1, -1, -1):  # the smallest id of equal bytes wins
        b = teacher.token_bytes[i]
        if b:
            index[b] = i
    get = index.get
    return np.fromiter(
        (get(b, -1) if b else -1 for b in student.token_bytes), dtype=np.int64, count=student.size
    )


def one_to_one(alignment: Alignment) -> tuple[IntArray, IntArray]:
    """The scored spans of one student and one teacher token: ``(student rows, teacher
    rows)``, the response positions of each side."""
    s, t = alignment.student_spans, alignment.teacher_spans
    single = (np.diff(s) == 1) & (np.diff(t) == 1) & alignment.scored
    return s[:-1][single], t[:-1][single]


def teacher_candidates(
    alignment: Alignment, student_ids: IntArray, twins: IntArray
) -> tuple[IntArray, IntArray]:
    """The candidates of only-student top-k with a teacher of another tokenizer.

    A student candidate ``v`` at response position ``s`` is kept when ``s`` is a one-to-one
    span (its token and one teacher token spell the same bytes after the same prefix) and
    a teacher token ``w`` spells ``v``'s bytes; the teacher is asked ``w`` at the span's
    teacher position. Any other candidate (textless, spelled by no teacher token, or an id
    beyond the student tokenizer) becomes padding (-1): not a candidate.

    Args:
        alignment: the response's alignment.
        student_ids: int64 ``[R, k]``, the student's top-k ids (-1 padding).
        twins: :func:`byte_twins` of the two tokenizers.

    Returns:
        ``(kept student ids [R, k], teacher ids [R_t, k])``, both with -1 padding; within a
        row the teacher ids are distinct (a second candidate of the same bytes is dropped).
    """
    r, k = student_ids.shape
    kept = np.full((r, k), -1, dtype=np.int64)
    asked = np.full((alignment.teacher_ids.shape[0], k), -1, dtype=np.int64)
    s_rows, t_rows = one_to_one(alignment)
    if s_rows.size == 0 or k == 0:
        return kept, asked
    ids = student_ids[s_rows]
    # an id beyond the tokenizer (a model's padded embedding rows) has no bytes: no twin
    known = (ids >= 0) & (ids < twins.shape[0])
    twin = np.where(known, twins[np.where(known, ids, 0)], -1)
    # two candidates of identical bytes (e.g. an added token and a vocabulary entry): the
    # better ranked one stays
    ordered = np.sort(twin, axis=1)
    dup_rows = np.flatnonzero(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1))
    for i in dup_rows.tolist():
        seen: set[int] = set()
        for c in range(k):
            w = int(twin[i, c])
            if w >= 0 and w in seen:
                twin[i, c] = -1
            seen.add(w)
    keep = twin >= 0
    kept[s_rows] = np.where(keep, ids, -1)
    asked[t_rows] = twin
    return kept, asked


def candidate_rows(
    alignment: Alignment, asked_logprobs: npt.NDArray[np.float32] | None, shape: tuple[int, int]
) -> npt.NDArray[np.float32]:
    """The teacher's logprobs of the kept candidates on the student's rows (``[R, k]``; NaN
    where nothing was asked): row ``t_rows[i]`` of ``asked_logprobs`` goes to row
    ``s_rows[i]``."""
    out = np.full(shape, np.nan, dtype=np.float32)
    if asked_logprobs is not None:
        s_rows, t_rows = one_to_one(alignment)
        out[s_rows] = asked_logprobs[t_rows]
    return out

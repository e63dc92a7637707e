"""What goes into a stream (:class:`Sample`), what comes out (:class:`ScoredSample` or
:class:`SampleFailure`), what the pipeline carries between (:class:`PreparedSample` after
intake, :class:`Fetched` after the fetch), and the one-time validation that turns a
``Sample`` into a ``PreparedSample`` (:func:`prepare_sample`; the student top-k field's
two forms are parsed by :mod:`opd_stream.wire._student_topk`).

Validation is strict and happens once, at intake: a bad sample becomes a
``SampleFailure(reason="invalid_sample")`` whose message names the field, and the rest of
the stream goes on.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from ._errors import InvalidSampleError
from .scanner._loader import compiled
from .wire._answers import ScoreRows
from .wire._checks import LOGPROB_TOLERANCE
from .wire._student_topk import MAX_TOKEN_ID, RowsRead, parse_student_topk, student_topk_arrays
from .xtok._align import Alignment
from .xtok._tokenizers import CrossTokenizers

if TYPE_CHECKING:
    import torch

__all__ = (
    "Candidates",
    "CrossSample",
    "Fetched",
    "TokenAlignment",
    "PreparedSample",
    "Sample",
    "SampleFailure",
    "ScoredSample",
    "cross_sample",
    "prepare_sample",
    "request_ids",
)


def _is_tensor(x: Any) -> bool:
    """``x`` is a torch tensor (torch is not imported for the question: a caller that
    passes a tensor has loaded it)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(x, torch_module.Tensor)


class Sample(msgspec.Struct, kw_only=False):
    """One student rollout to score.

    Attributes:
        tokens: prompt + response token ids (a sequence of ints, a 1-D integer numpy array
            or torch tensor).
        response_length: R, the number of trailing tokens that are the response
            (``0 <= R < len(tokens)``: at least one prompt token precedes the response).
        metadata: free-form; ``metadata[config.teacher_key]`` names the teacher.
        rollout_logprobs: the student's logprob of each response token, as the rollout
            engine returned them (length R, finite, <= 0). Needed for the sampled-token
            reverse KL estimate.
        student_top_logprobs: one row per response token of ``[logprob, token_id]`` pairs
            (or SGLang ``[logprob, token_id, text]`` triples), best first; or, cheaper, a
            pair ``(ids, logprobs)`` of numpy arrays or torch tensors of shape
            ``[R, >= top_k]`` (e.g. SGLang's b64 flat top-k decoded). A row may hold fewer
            than ``top_k`` entries, or none (Miles' multi-turn merge leaves ``[]`` on
            observation spans); in the array form such a row is padded at its end with id
            ``-1`` (:data:`PAD_ID`). Only the entries present are candidates
            (``docs/semantics.md``, "Missing values and empty rows"): an empty row selects
            nothing under only-student, the teacher's top-k alone under union. When top-k
            mode needs it and it is None, it is fetched from the student server. Ignored
            (neither converted nor checked) in sampled-token mode and under only-teacher,
            which never read it.
        sample_id: anything the caller wants back on the result.
        teacher_prompt_ids: the teacher's own prompt (token ids, non-empty; a sequence of
            ints, a 1-D integer numpy array or torch tensor), for a teacher that sees a
            different context than the student (privileged context: a demonstration, the
            solution, a hint; self-distillation). When set, every teacher request is
            ``teacher_prompt_ids + response`` and teacher row ``t`` describes the same
            response token as student row ``t``; the student's requests keep ``tokens``.
            None: the teacher sees ``tokens``. Required for a teacher with its own tokenizer
            (``StreamConfig.teacher_tokenizers``), in that teacher's ids: its requests are
            ``teacher_prompt_ids`` + the teacher's ids of the response text.
    """

    tokens: Any
    response_length: int
    metadata: Mapping[str, Any] = {}
    rollout_logprobs: Any = None
    student_top_logprobs: Any = None
    sample_id: Any = None
    teacher_prompt_ids: Any = None


class Candidates(msgspec.Struct, frozen=True, kw_only=True):
    """Per-candidate top-k arrays of one sample, each ``[R, C]`` (CPU tensors).

    ``C`` is ``top_k`` for only-student, only-teacher and intersection, ``2 * top_k`` for
    union and xor. Selected candidates are packed first in the strategy's order; unused
    slots have ``mask`` False, ``ids`` -1 and zero values.

    With ``tail=True`` (the tail bucket), ``weights`` are ``exp(student_logprobs)`` (the
    reverse KL's; the forward KL's are ``exp(teacher_logprobs)``) and
    ``student_tail_logprobs`` / ``teacher_tail_logprobs`` (float32 ``[R]``) are each model's
    log-mass outside the selected candidates (``log S_tail``, ``log T_tail``; their mass at
    least 1e-6, 0 where nothing is selected): ``r_t = sum(weights * (student_logprobs -
    teacher_logprobs)) + exp(ls) * (ls - lt)``, at least 0. Without it they are None.
    Under ``divergence="jsd"``, ``weights`` are the mixture ``M``'s probabilities of the
    candidates (docs/semantics.md, "Other divergences").
    """

    ids: torch.Tensor
    student_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    student_tail_logprobs: torch.Tensor | None = None
    teacher_tail_logprobs: torch.Tensor | None = None


class TokenAlignment(msgspec.Struct, frozen=True, kw_only=True):
    """What a teacher with its own tokenizer was compared on (``docs/cross-tokenizer.md``):
    the response's teacher ids and the ``n`` spans of coinciding byte
    boundaries (CPU tensors).

    Attributes:
        teacher_ids: int64 ``[R_t]``, the teacher's ids of the response text (sent).
        teacher_token_logprobs: float32 ``[R_t]``, the teacher's logprob of each.
        student_spans: int64 ``[n + 1]``: span ``j`` is student response tokens
            ``student_spans[j]:student_spans[j + 1]``.
        teacher_spans: int64 ``[n + 1]``: span ``j`` is teacher tokens
            ``teacher_spans[j]:teacher_spans[j + 1]``.
        span_bytes: int64 ``[n + 1]``, the spans' byte offsets in the response text.
        scored: bool ``[n]``: the span was compared (False: textless tokens only, or an
            incomplete final character; its value is 0).
    """

    teacher_ids: torch.Tensor
    teacher_token_logprobs: torch.Tensor
    student_spans: torch.Tensor
    teacher_spans: torch.Tensor
    span_bytes: torch.Tensor
    scored: torch.Tensor


class ScoredSample(msgspec.Struct, frozen=True, kw_only=True):
    """A sample scored by its teacher.

    Attributes:
        sample: the input sample, unchanged.
        index: its 0-based position in the input (a call of ``OPDStream.score``: the
            call's number among the stream's calls).
        teacher: the teacher name it was routed to.
        teacher_logprobs: float32 ``[R]``, the teacher logprob of each sampled token. A
            teacher with its own tokenizer: the teacher's logprob of each span's text, on
            the span's last student token (0 on the others).
        reverse_kl: float32 ``[R]``, the reverse KL signal. Top-k mode: ``r_t``
            (``docs/semantics.md``, "Top-k mode"). Sampled-token mode: ``rollout_logprobs -
            teacher_logprobs`` when rollout logprobs were given, else None. A teacher with
            its own tokenizer: each span's ``sum(student lp) - sum(teacher lp)`` on the
            span's last student token (0 on the others). None as well when the stream's
            ``divergence`` is another one (see ``signal``): a forward KL or a JSD is never
            returned under this name.
        candidates: the per-candidate arrays in top-k mode, else None (and None when
            the stream's ``candidates`` setting is false: the signal alone).
        attempts: HTTP attempts made for this sample, all requests together.
        latency_s: seconds from admission to result.
        alignment: a teacher with its own tokenizer, with ``return_alignment``: the spans
            compared; else None.
        signal: float32 ``[R]``, the per-token signal of ``divergence`` (the same tensor as
            ``reverse_kl`` when that is the divergence); None where ``reverse_kl`` is None
            in sampled-token mode.
        divergence: which divergence ``signal`` is: ``reverse_kl``, ``forward_kl`` or
            ``jsd`` (the stream's ``divergence`` setting).
    """

    sample: Sample
    index: int
    teacher: str
    teacher_logprobs: torch.Tensor
    reverse_kl: torch.Tensor | None
    candidates: Candidates | None
    attempts: int
    latency_s: float
    alignment: TokenAlignment | None = None
    signal: torch.Tensor | None = None
    divergence: str = "reverse_kl"


class SampleFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A sample that could not be scored, and why.

    Attributes:
        sample: the input, unchanged: the :class:`Sample`, or, for an input that is not
            one (reason ``invalid_sample``), the object given in its place.
        index: its 0-based position in the input (a call of ``OPDStream.score``: the
            call's number among the stream's calls).
        reason: a short stable code (``invalid_sample``, ``routing``, ``teacher_http_400``,
            ``deadline_exceeded``, ``misaligned_response``, ``capability``, ``cancelled``
            (the caller of ``OPDStream.score`` stopped waiting for it), ...).
        message: a human-readable explanation (never a payload or a secret).
        attempts: HTTP attempts made before giving up.
    """

    sample: Sample | Any
    index: int
    reason: str
    message: str
    attempts: int


class PreparedSample(msgspec.Struct, frozen=True, kw_only=True):
    """A validated sample with everything the pipeline needs, in numpy form."""

    sample: Sample
    index: int
    teacher: str
    tokens: npt.NDArray[np.int64]
    prompt_length: int
    response_length: int
    rollout_logprobs: npt.NDArray[np.float32] | None
    student_top_ids: npt.NDArray[np.int64] | None
    student_top_logprobs: npt.NDArray[np.float32] | None
    # teacher_prompt_ids + the response (what every teacher request sends), or None: tokens
    teacher_tokens: npt.NDArray[np.int64] | None = None


class Fetched(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the KL stage needs for one sample: what the fetch stage hands it."""

    prepared: PreparedSample
    teacher_rows: ScoreRows
    student_ids: npt.NDArray[np.int64] | None
    student_lps: npt.NDArray[np.float32] | None
    student_rows: ScoreRows | None
    attempts: int
    admitted_at: float
    # a teacher with its own tokenizer: the response's alignment (teacher_rows has R_t rows)
    alignment: Alignment | None = None
    return_alignment: bool = False
    # ... and the teacher's logprob of each of its R_t tokens, when teacher_rows is not them
    teacher_token_logprobs: npt.NDArray[np.float32] | None = None


class CrossSample(msgspec.Struct, frozen=True, kw_only=True):
    """One sample's teacher side, for a teacher with its own tokenizer: what the teacher is
    asked, and the alignment."""

    teacher_prepared: PreparedSample
    """The sample as the teacher request sends it: ``tokens`` is the teacher prompt + the
    teacher's ids of the response, ``response_length`` their count."""
    alignment: Alignment


def _as_token_array(tokens: Any, field: str = "tokens") -> npt.NDArray[np.int64]:
    if _is_tensor(tokens):
        dtype = tokens.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
            raise InvalidSampleError(field, f"expected integer token ids, got dtype {dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise InvalidSampleError(field, f"expected integer token ids, got dtype {tokens.dtype}")
        arr = tokens
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidSampleError(
            field, f"expected a sequence of int token ids, got {type(tokens).__name__}"
        )
    else:
        fast = _compiled_ids(tokens)
        if fast is not None:  # every id checked on the way
            return fast
        # One C-level pass over the element types (a list of plain ints is the common case);
        # only an unexpected type pays for the Python loop that names the element.
        if not set(map(type, tokens)) <= {int}:
            for i, tok in enumerate(tokens):
                if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                    raise InvalidSampleError(
                        field, f"element {i} is {type(tok).__name__}, expected int"
                    )
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise InvalidSampleError(field, "a token id does not fit in 64 bits") from None
    if arr.ndim != 1:
        raise InvalidSampleError(field, f"expected a 1-D sequence, got shape {arr.shape}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise InvalidSampleError(
                field, f"negative token id at position {int(np.argmax(arr < 0))}"
            )
        if hi > MAX_TOKEN_ID:
            raise InvalidSampleError(
                field,
                f"token id above {MAX_TOKEN_ID} at position {int(np.argmax(arr > MAX_TOKEN_ID))}",
            )
    return np.ascontiguousarray(arr, dtype=np.int64)


_LISTS_MSGPACK = msgspec.msgpack.Encoder()


def _list_msgpack(values: Any) -> bytes | None:
    """A plain list (or tuple) as ``msgspec.msgpack`` writes it, or ``None`` (another type,
    or an element msgspec cannot write)."""
    if type(values) not in (list, tuple):
        return None
    try:
        return _LISTS_MSGPACK.encode(values)
    except (TypeError, ValueError, OverflowError):
        return None


def _compiled_ids(tokens: Sequence[Any]) -> npt.NDArray[np.int64] | None:
    """A plain list (or tuple) of token ids through the compiled reader
    (:mod:`opd_stream.scanner._lists`): ``msgspec.msgpack`` writes the ints (no type check
    per element in Python, no numpy conversion), the reader takes them back with every id
    checked in ``[0, MAX_TOKEN_ID]``; ~8x cheaper than numpy's conversion and its checks.
    ``None`` when the kernels are not compiled yet or anything is unusual (a bool, a float,
    a numpy integer, an id out of range): numpy's path then decides and names the fault."""
    kernel = compiled()
    if kernel is None or (body := _list_msgpack(tokens)) is None:
        return None
    return kernel.ids_read(body, len(tokens), MAX_TOKEN_ID)


def _compiled_logprobs(values: Any, r: int) -> npt.NDArray[np.float32] | None:
    """:func:`_compiled_ids` for ``r`` rollout logprobs: each a finite Python float at most
    ``LOGPROB_TOLERANCE``, else ``None`` (numpy's path decides)."""
    kernel = compiled()
    if kernel is None or len(values) != r or (body := _list_msgpack(values)) is None:
        return None
    got = kernel.logprobs_read(body, r, LOGPROB_TOLERANCE)
    if got is None:
        return None
    with np.errstate(over="ignore"):  # below -float32 max: -inf, as it should
        return got.astype(np.float32)


def _check_response_length(response_length: Any, n_tokens: int) -> int:
    if isinstance(response_length, bool) or not isinstance(response_length, (int, np.integer)):
        raise InvalidSampleError(
            "response_length", f"expected int, got {type(response_length).__name__}"
        )
    r = int(response_length)
    if not 0 <= r <= n_tokens - 1:
        raise InvalidSampleError(
            "response_length",
            f"{r} is out of range for {n_tokens} tokens (need 0 <= R <= len(tokens) - 1, "
            "so that at least one prompt token precedes the response)",
        )
    return r


def _as_rollout_logprobs(values: Any, r: int) -> npt.NDArray[np.float32]:
    if _is_tensor(values):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise InvalidSampleError(
            "rollout_logprobs", f"expected a sequence of floats, got {type(values).__name__}"
        )
    fast = _compiled_logprobs(values, r)
    if fast is not None:  # every value checked on the way
        return fast
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidSampleError("rollout_logprobs", "expected a sequence of floats") from None
    if arr.ndim != 1 or arr.shape[0] != r:
        raise InvalidSampleError(
            "rollout_logprobs",
            f"expected {r} values (one per response token), got shape {arr.shape}",
        )
    bad = ~np.isfinite(arr)
    if bad.any():
        raise InvalidSampleError(
            "rollout_logprobs", f"non-finite value at response position {int(np.argmax(bad))}"
        )
    over = arr > LOGPROB_TOLERANCE
    if over.any():
        raise InvalidSampleError(
            "rollout_logprobs",
            f"value > 0 at response position {int(np.argmax(over))} is not a logprob",
        )
    with np.errstate(over="ignore"):  # below -float32 max: -inf, as it should
        return arr.astype(np.float32)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or _is_tensor(x)


def request_ids(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``ids [R, k]`` as they may be sent to a server: padding slots (id ``-1``) replaced.

    A request never carries ``-1``: each padding slot gets a filler id, the smallest
    non-negative ids not among its row's real ids (so a row's ids stay distinct), in
    ascending order. What the server answers for a filler is never used: the KL stage reads
    the ids with their padding, and a padding slot is never a candidate. Returns ``ids``
    itself when it holds no padding.
    """
    if ids.size == 0 or int(ids.min()) >= 0:
        return ids
    rows = np.flatnonzero((ids < 0).any(axis=1))
    sub = ids[rows]
    n, k = sub.shape
    # Filler candidates 0 .. 2k - 1: a row's (at most k) real ids leave at least k free.
    taken = np.zeros((n, 2 * k + 1), dtype=np.bool_)
    np.put_along_axis(taken, np.where((sub >= 0) & (sub < 2 * k), sub, 2 * k), True, axis=1)
    free_first = np.argsort(taken[:, : 2 * k], axis=1, kind="stable")  # free ids, ascending
    pad = sub < 0
    slot = np.cumsum(pad, axis=1) - 1  # the j-th padding slot of its row gets free id j
    fill = np.take_along_axis(free_first, np.clip(slot, 0, k - 1), axis=1)
    out = ids.copy()
    out[rows] = np.where(pad, fill, sub)
    return out


def cross_sample(xtok: CrossTokenizers, prepared: PreparedSample) -> CrossSample:
    """Align the response for the sample's teacher, which has its own tokenizer, and build
    the teacher's request input (:meth:`~opd_stream.xtok._tokenizers.CrossTokenizers.prepare`;
    blocking: CPU).

    Raises:
        InvalidSampleError: see :func:`~opd_stream.xtok._align.align_response`, and a
            missing ``teacher_prompt_ids``.
    """
    side = xtok.prepare(
        prepared.teacher, prepared.tokens, prepared.response_length, prepared.teacher_tokens
    )
    teacher_prepared = msgspec.structs.replace(
        prepared,
        tokens=side.tokens,
        prompt_length=side.prompt_length,
        response_length=side.response_length,
        teacher_tokens=None,
        student_top_ids=None,
        student_top_logprobs=None,
    )
    return CrossSample(teacher_prepared=teacher_prepared, alignment=side.alignment)


def prepare_sample(
    sample: Any,
    index: int,
    *,
    teacher: str,
    top_k: int,
    student_topk: bool = True,
    rows_read: RowsRead | None = None,
) -> PreparedSample:
    """Validate ``sample`` and convert it for the pipeline.

    Args:
        sample: the caller's object; anything but a :class:`Sample` is rejected.
        index: its position in the input.
        teacher: the routed teacher name (routing happens before, see ``TeacherRouting``).
        top_k: the configured top-k (0 = sampled-token mode, where student top-k is ignored).
        student_topk: whether the strategy reads the student's top-k (``only-teacher``
            does not: then it is ignored too, neither converted nor checked).
        rows_read: the sample's Python top-k rows read already (on the loop, a slice at a
            time: :func:`opd_stream.wire._student_topk.rows_read_slices`); ``None``: read
            here if needed.

    Raises:
        InvalidSampleError: naming the offending field.
    """
    if not isinstance(sample, Sample):
        raise InvalidSampleError(
            "sample", f"expected opd_stream.Sample, got {type(sample).__name__}"
        )
    if not isinstance(sample.metadata, Mapping):
        raise InvalidSampleError(
            "metadata", f"expected a mapping, got {type(sample.metadata).__name__}"
        )
    tokens = _as_token_array(sample.tokens)
    if tokens.shape[0] < 1:
        raise InvalidSampleError("tokens", "empty token list")
    r = _check_response_length(sample.response_length, tokens.shape[0])
    teacher_tokens = None
    if sample.teacher_prompt_ids is not None:
        teacher_prompt = _as_token_array(sample.teacher_prompt_ids, "teacher_prompt_ids")
        if teacher_prompt.shape[0] < 1:
            raise InvalidSampleError(
                "teacher_prompt_ids",
                "empty teacher prompt (it needs at least one token, as nothing predicts the "
                "first; None means the teacher sees tokens)",
            )
        teacher_tokens = np.concatenate([teacher_prompt, tokens[tokens.shape[0] - r :]])
    rollout = None
    if sample.rollout_logprobs is not None:
        rollout = _as_rollout_logprobs(sample.rollout_logprobs, r)
    top_ids = top_lps = None
    given = sample.student_top_logprobs
    if top_k > 0 and student_topk and given is not None:
        if isinstance(given, tuple) and len(given) == 2 and all(map(_is_array, given)):
            ids, lps = given
            if _is_tensor(ids):
                ids = ids.detach().cpu().numpy()
            if _is_tensor(lps):
                lps = lps.detach().cpu().float().numpy()
            top_ids, top_lps = student_topk_arrays(ids, lps, r, top_k)
        else:
            top_ids, top_lps = parse_student_topk(given, r, top_k, read=rows_read)
    return PreparedSample(
        sample=sample,
        index=index,
        teacher=teacher,
        tokens=tokens,
        prompt_length=tokens.shape[0] - r,
        response_length=r,
        rollout_logprobs=rollout,
        student_top_ids=top_ids,
        student_top_logprobs=top_lps,
        teacher_tokens=teacher_tokens,
    )

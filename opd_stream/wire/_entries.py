"""The msgspec pieces shared by the msgspec decoders: the ``[logprob, token_id, text]``
entry Struct, rows of entries, ``finish_reason``, and the row checks built on them.

Used by :mod:`opd_stream.wire._decode_score` (scoring answers),
:mod:`opd_stream.wire._decode_generate`
(sampling answers) and :mod:`opd_stream.wire._student_topk` (the rollout engine's top-k rows).
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import MalformedResponseError, MisalignedResponseError, ServerAbortError
from .._redact import redact_bearer
from ._answers import Segment
from ._checks import input_rows

__all__ = (
    "ENTRY_ID",
    "ENTRY_LP",
    "Entry",
    "EntryRows",
    "FinishReason",
    "Int64",
    "check_abort",
    "checked_rows",
    "decode_error",
    "rows_block",
    "too_deep",
)

ENTRY_LP = attrgetter("lp")
ENTRY_ID = attrgetter("id")


Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class Entry(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One SGLang ``[logprob, token_id, text]`` triple; the text (if any) is ignored."""

    lp: float | None
    id: Int64  # a larger id would overflow numpy's int64 arrays


EntryRows = list[list[Entry] | None]


class FinishReason(msgspec.Struct, gc=False, frozen=True):
    type: str | None = None
    message: str | None = None


def decode_error(exc: msgspec.DecodeError) -> MalformedResponseError:
    return MalformedResponseError(f"cannot decode the response: {exc}")


def too_deep() -> MalformedResponseError:
    return MalformedResponseError(
        "cannot decode the response: JSON nested too deeply (beyond the decoder's depth limit)"
    )


def check_abort(fr: FinishReason | None, where: str, side: str) -> None:
    if fr is not None and fr.type == "abort":
        # bearer tokens masked before the cut (a cut inside one would leave part of it)
        msg = redact_bearer(fr.message or "<no message>")[:500]
        raise ServerAbortError(f"server aborted the request (`{where}`): {msg}", side=side)


def rows_block(
    rows: EntryRows, field: str, seg: Segment, t0: int, width: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Validate and convert the last ``seg.rows`` rows of an ``input_*`` row list.

    Returns ids int64 ``[rows, width]`` and logprobs float64 ``[rows, width]`` (NaN = null).
    """
    sel = checked_rows(rows, field, seg, t0, width)
    n = seg.rows
    total = n * width
    ids = np.fromiter(map(ENTRY_ID, chain.from_iterable(sel)), dtype=np.int64, count=total)  # type: ignore[arg-type]
    lps = np.fromiter(map(ENTRY_LP, chain.from_iterable(sel)), dtype=np.float64, count=total)  # type: ignore[arg-type]
    return ids.reshape(n, width), lps.reshape(n, width)


def checked_rows(rows: EntryRows, field: str, seg: Segment, t0: int, width: int) -> EntryRows:
    """The last ``seg.rows`` rows, after checking the entry count, nulls and row widths."""
    n_entries = seg.length - seg.start
    if len(rows) != n_entries:
        raise MisalignedResponseError(
            f"`{field}` has {len(rows)} entries, expected {n_entries} "
            f"(input length {seg.length} - logprob_start_len {seg.start})"
        )
    n = input_rows(seg)
    first_abs = seg.length - n
    sel = rows[n_entries - n :]
    if None in sel:
        r = sel.index(None)
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {first_abs + r} "
            f"(response position {t0 + r}) is null or empty"
        )
    widths = np.fromiter(map(len, sel), dtype=np.intp, count=n)  # type: ignore[arg-type]
    bad = np.flatnonzero(widths != width)
    if bad.size:
        r = int(bad[0])
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {first_abs + r} (response position {t0 + r}) "
            f"has {int(widths[r])} entries, expected {width}"
        )
    return sel

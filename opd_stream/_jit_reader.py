"""The compiled scanner (:mod:`opd_stream._jit_kernel`) as a reader of scoring answers.

:func:`read_answers_jit` runs the scan (GIL released), cuts the logprob lists it parsed
out of the body, decodes what is left (the envelope: ``finish_reason``, ``weight_version``,
the b64 fields, and every other key) with the msgspec decoder's own types
(:func:`opd_stream._decode_score.decode_metas`), and hands the array decoder
(:mod:`opd_stream._decode_arrow`) the same columns pyarrow's reader would. An answer the
scan does not take, or whose envelope does not decode, gives ``None``: the next parser
decodes it (and, if it is bad, names the fault).

Compiling: the kernel is compiled by numba on first use (about 2-5 s of CPU on a 2-core
machine; about 0.2 s when numba's on-disk cache, next to the module, already holds it).
:func:`prepare` does it, blocking, in whichever decode thread first needs it; until it is
done every answer goes to the other parsers, and if numba is missing or fails, it stays so
(logged once at DEBUG).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._arrow_reader import ArrowEntries, ArrowRows
from ._decode_score import decode_metas

__all__ = ("JitAnswers", "available", "prepare", "read_answers_jit")

_log = logging.getLogger("opd_stream")
_lock = threading.Lock()
_kernel: ModuleType | None = None
_failed = False

#: A tiny answer that makes numba compile every path of the scan once.
_WARM_BODY = (
    b'{"text":"","meta_info":{"finish_reason":{"type":"length"},"input_token_logprobs":'
    b'[[null,1,null],[-0.5,2]],"input_token_ids_logprobs":[null,[[-1.25e-3,3,null]]],'
    b'"input_top_logprobs":[null,[]],"output_token_ids_logprobs":[[[-2.0,4]]]}}'
)


def available() -> bool:
    """Whether the scanner is compiled and ready."""
    return _kernel is not None


def prepare() -> bool:
    """Compile (or load from numba's cache) the scanner, blocking; whether it is usable.

    Thread-safe: while one thread compiles, another caller gets ``False`` at once (its
    answer goes to another parser). After a failure (numba missing or broken) it is never
    tried again in this process.
    """
    global _kernel, _failed
    if _kernel is not None:
        return True
    if _failed or not _lock.acquire(blocking=False):
        return False
    try:
        if _kernel is None and not _failed:
            import numba

            if getattr(numba.config, "DISABLE_JIT", False):  # it would run as Python
                raise RuntimeError("NUMBA_DISABLE_JIT is set")
            from . import _jit_kernel

            _run(_jit_kernel, _WARM_BODY, False)
            _run(_jit_kernel, b"[" + _WARM_BODY + b"]", True)
            _kernel = _jit_kernel
    except Exception as exc:  # numba absent or unusable here: the other parsers remain
        _failed = True
        _log.debug("opd_stream: compiled answer scanner unavailable: %s", type(exc).__name__)
    finally:
        _lock.release()
    return _kernel is not None


def _run(kernel: Any, body: bytes | bytearray, batch: bool) -> tuple[Any, ...]:
    n = len(body)
    b = np.frombuffer(body, dtype=np.uint8)
    if b.flags.writeable:  # one compiled variant: read-only bytes
        b = b.view()
        b.flags.writeable = False
    entries = n // 6 + 1  # the shortest entry, "[0,0]," is 6 bytes
    rows = n // 3 + 1  # the shortest row, "[],", 3
    lps = np.empty(entries, dtype=np.float64)
    ids = np.empty(entries, dtype=np.int64)
    widths = np.empty(rows, dtype=np.int32)
    nulls = np.empty(rows, dtype=np.uint8)
    records = np.empty((n // 8 + 8, 8), dtype=np.int64)
    got = kernel.scan(b, batch, lps, ids, widths, nulls, records)
    return got, lps, ids, widths, nulls, records


def read_answers_jit(body: bytes | bytearray, batch: bool) -> JitAnswers | None:
    """Every item's ``meta_info``, the logprob lists scanned into arrays, or ``None``
    (scanner not ready, or an answer it does not take)."""
    kernel = _kernel
    if kernel is None or not body:
        return None
    (status, n_rec, n_items, n_ent, n_rows), lps, ids, widths, nulls, records = _run(
        kernel, body, batch
    )
    if status != kernel.OK:
        return None
    rec = records[:n_rec]
    pieces: list[bytes | bytearray] = []
    pos = 0
    for start, end in rec[:, [kernel.R_START, kernel.R_END]].tolist():
        pieces += (body[pos:start], b"[]")
        pos = end
    pieces.append(body[pos:])
    metas = decode_metas(b"".join(pieces), batch)
    if metas is None or len(metas) != n_items:
        return None
    keys = [k.decode() for k in kernel.KEYS]
    for key, item in rec[:, [kernel.R_KEY, kernel.R_ITEM]].tolist():
        if getattr(metas[item], keys[key]) != []:  # the envelope must agree with the scan
            return None
    return JitAnswers(
        metas, keys, rec, lps[:n_ent], ids[:n_ent], widths[:n_rows], nulls[:n_rows], kernel
    )


class JitAnswers:
    """:class:`~opd_stream._arrow_reader.Answers` from the scan: the cut lists' columns
    come from the kernel's buffers, everything else from the decoded envelope."""

    __slots__ = ("_ids", "_k", "_keys", "_lps", "_metas", "_nulls", "_rec", "_widths")

    def __init__(
        self,
        metas: Sequence[Any],
        keys: list[str],
        rec: npt.NDArray[np.int64],
        lps: npt.NDArray[np.float64],
        ids: npt.NDArray[np.int64],
        widths: npt.NDArray[np.int32],
        nulls: npt.NDArray[np.uint8],
        kernel: Any,
    ) -> None:
        self._metas, self._keys, self._rec = metas, keys, rec
        self._lps, self._ids, self._widths, self._nulls = lps, ids, widths, nulls
        self._k = kernel

    def __len__(self) -> int:
        return len(self._metas)

    def values(self, name: str) -> list[Any]:
        return [getattr(m, name) for m in self._metas]

    def finish_types(self) -> list[str | None]:
        return [None if m.finish_reason is None else m.finish_reason.type for m in self._metas]

    def _records(self, name: str) -> list[list[int] | None]:
        """The record of ``name`` per item (``None``: null or absent)."""
        k = self._k
        out: list[list[int] | None] = [None] * len(self._metas)
        key = self._keys.index(name)
        for r in self._rec[self._rec[:, k.R_KEY] == key].tolist():
            out[r[k.R_ITEM]] = r
        return out

    def _entries_of(self, recs: list[list[int]]) -> ArrowEntries:
        k = self._k
        spans = [(r[k.R_ENT0], r[k.R_ENT1]) for r in recs]
        lps = _cat([self._lps[a:b] for a, b in spans], np.float64)
        ids = _cat([self._ids[a:b] for a, b in spans], np.int64)
        return ArrowEntries.of(ids.astype(np.float64), lps)

    def entries(self, name: str) -> tuple[ArrowEntries, npt.NDArray[np.intp]] | None:
        recs = self._records(name)
        if any(r is None for r in recs):
            return None
        present = [r for r in recs if r is not None]
        k = self._k
        counts = np.array([r[k.R_ENT1] - r[k.R_ENT0] for r in present], dtype=np.intp)
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.intp)
        return self._entries_of(present), offsets

    def rows(self, name: str) -> ArrowRows:
        k = self._k
        recs = self._records(name)
        present = [r for r in recs if r is not None]
        item_null = np.array([r is None for r in recs], dtype=bool)
        counts = np.array([0 if r is None else r[k.R_ROW1] - r[k.R_ROW0] for r in recs])
        item_off = np.concatenate(([0], np.cumsum(counts))).astype(np.intp)
        spans = [(r[k.R_ROW0], r[k.R_ROW1]) for r in present]
        row_width = _cat([self._widths[a:b] for a, b in spans], np.int32).astype(np.intp)
        row_null = _cat([self._nulls[a:b] for a, b in spans], np.uint8).astype(bool)
        return ArrowRows.of(item_null, item_off, row_null, row_width, self._entries_of(present))


def _cat(parts: list[npt.NDArray[Any]], dtype: Any) -> npt.NDArray[Any]:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)

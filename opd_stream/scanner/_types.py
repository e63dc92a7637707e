"""What the scanner's modules share: the scan's result (:class:`Scan`), the fields it parses
(:class:`ScanSchema`, :func:`scan_schema`), the body it reads (:data:`Body`), and
:class:`Kernels`, the typed calls of :mod:`opd_stream.scanner._calls` as
:func:`opd_stream.scanner._loader.compiled` gives them.

Light: numpy is imported by :func:`scan_schema` only (the loader imports this module at
start-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ("Body", "Kernels", "Scan", "ScanSchema", "ScanSlices", "scan_schema")

#: An answer's body as the scan reads it: the union :data:`opd_stream.wire._answers.Body`
#: names (the scanner imports nothing of the wire, which imports it).
Body = bytes | bytearray | memoryview


class Scan(NamedTuple):
    """What the answer scan gives (:func:`opd_stream.scanner._scan.scan`), its buffers cut
    to what it wrote (``raw`` whole: records hold its byte ranges)."""

    status: int  #: :attr:`Kernels.OK`, or the answer is not for the scanner
    n_items: int
    records: npt.NDArray[np.int64]  #: ``[n, 8]``, columns :attr:`Kernels.R_KEY` ...
    lps: npt.NDArray[np.float64]
    ids: npt.NDArray[np.int64]
    widths: npt.NDArray[np.int32]
    nulls: npt.NDArray[np.uint8]
    raw: npt.NDArray[np.uint8]


class ScanSchema(NamedTuple):
    """The values the scan parses, as the wire declares them (built once by
    :mod:`opd_stream.wire._scan_reader` from its msgspec schema with :func:`scan_schema`):
    each key's name and kind (an entries list, a rows list or a base64 string, numbered as
    the wire numbers them), the envelope they sit in, and the same as the kernel's arrays."""

    keys: tuple[str, ...]
    kinds: tuple[int, ...]
    envelope: str
    key_bytes: npt.NDArray[np.uint8]  #: every key's bytes, one after the other
    key_starts: npt.NDArray[np.int64]  #: key ``k`` is ``key_bytes[starts[k]:starts[k + 1]]``
    kind_codes: npt.NDArray[np.int64]
    envelope_bytes: npt.NDArray[np.uint8]


def scan_schema(fields: Sequence[tuple[str, int]], envelope: str) -> ScanSchema:
    """:class:`ScanSchema` of ``(name, kind)`` pairs inside the object under ``envelope``;
    its arrays read-only (one compiled variant)."""
    import numpy as np

    keys = tuple(name for name, _ in fields)
    arrays = (
        np.frombuffer("".join(keys).encode(), dtype=np.uint8).copy(),
        np.cumsum([0] + [len(k.encode()) for k in keys]).astype(np.int64),
        np.array([kind for _, kind in fields], dtype=np.int64),
        np.frombuffer(envelope.encode(), dtype=np.uint8).copy(),
    )
    for a in arrays:
        a.flags.writeable = False
    return ScanSchema(keys, tuple(kind for _, kind in fields), envelope, *arrays)


class ScanSlices(Protocol):
    """A scan done a slice at a time (:class:`opd_stream.scanner._calls.SlicedScan`)."""

    def step(self, nbytes: int) -> Scan | None: ...


class Kernels(Protocol):
    """The compiled kernels as :func:`~opd_stream.scanner._loader.compiled` gives them:
    :mod:`opd_stream.scanner._calls`, checked against this by mypy where
    :func:`~opd_stream.scanner._loader.prepare` hands it out."""

    #: The scan's status of an answer it took (:attr:`Scan.status`).
    OK: int
    #: The columns of :attr:`Scan.records`: the value's key (an index into
    #: :attr:`ScanSchema.keys`),
    #: its item, its byte span in the body, its rows and its entries (for a base64 string,
    #: its bytes in :attr:`Scan.raw`).
    R_KEY: int
    R_ITEM: int
    R_START: int
    R_END: int
    R_ROW0: int
    R_ROW1: int
    R_ENT0: int
    R_ENT1: int

    def run_scan(self, body: Body, batch: bool, schema: ScanSchema) -> Scan: ...

    def sliced_scan(self, body: Body, batch: bool, schema: ScanSchema) -> ScanSlices: ...

    def rows_read(
        self, body: bytes, r: int, k: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]] | None: ...

    def objects_readable(self) -> bool: ...

    def object_rows_read(
        self,
        rows: list[Any],
        start: int,
        stop: int,
        k: int,
        lps: npt.NDArray[np.float64],
        ids: npt.NDArray[np.int64],
    ) -> bool: ...

    def ids_read(self, body: bytes, n: int, max_id: int) -> npt.NDArray[np.int64] | None: ...

    def logprobs_read(
        self, body: bytes, n: int, tolerance: float
    ) -> npt.NDArray[np.float64] | None: ...

    def topk_check(
        self,
        ids: npt.NDArray[np.int64],
        lps: npt.NDArray[np.floating[Any]],
        pad_id: int,
        max_id: int,
        tolerance: float,
    ) -> tuple[npt.NDArray[np.float32], dict[str, int]]: ...

    def positions_json(self, ids: npt.NDArray[Any], empty_rows: int) -> memoryview | None: ...

    def id_fault(self, ids: npt.NDArray[np.int64], max_id: int) -> tuple[int, int]: ...

    def pick_rows(
        self,
        e_ids: npt.NDArray[np.int64],
        e_lps: npt.NDArray[np.float64],
        entry_off: npt.NDArray[np.intp],
        row_width: npt.NDArray[np.intp],
        row_null: npt.NDArray[np.bool_],
        first_row: int,
        expect: npt.NDArray[np.int64],
        out: npt.NDArray[np.float32],
    ) -> tuple[bool, float]: ...

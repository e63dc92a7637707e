"""The compiled scanner and checks restate a few facts that the Python decoders declare
(numba compiles module-level constants in, so the kernels keep their own copies): each copy
is tied to its one declaration here, not by hand."""

from __future__ import annotations

import msgspec
import numpy as np

from opd_stream.scanner import _calls as scanner_calls
from opd_stream.scanner import _checks as scanner_checks
from opd_stream.scanner import _ids as scanner_ids
from opd_stream.scanner import _rows as scanner_rows
from opd_stream.scanner import _scan as scanner_scan
from opd_stream.scanner import _types as scanner_types
from opd_stream.wire import _answers as wire_answers
from opd_stream.wire import _checks as wire_checks
from opd_stream.wire import _decode_score, _scan_reader, _student_topk
from opd_stream.wire._student_topk import MAX_TOKEN_ID, PAD_ID


def test_the_scanner_falls_back_at_the_decoders_logprob_tolerance() -> None:
    assert scanner_scan._TOLERANCE == wire_checks.LOGPROB_TOLERANCE


def test_the_scanner_reads_the_bodies_the_wire_decodes() -> None:
    # the scanner names the body types itself (it imports nothing of the wire)
    assert scanner_types.Body == wire_answers.Body


def test_the_scanner_numbers_the_kinds_of_value_as_the_schema_does() -> None:
    kernel = (scanner_scan.ENTRIES, scanner_scan.ROWS, scanner_scan.B64)
    assert kernel == (_decode_score.ENTRIES, _decode_score.ROWS, _decode_score.B64)
    assert {kind for _, kind in _decode_score.SCANNED} <= set(kernel)


def test_the_scanner_looks_for_the_schemas_field_names() -> None:
    fields = {f.name for f in msgspec.structs.fields(_decode_score._Response)}
    schema = _scan_reader._SCHEMA
    assert schema.envelope_bytes.tobytes().decode() == schema.envelope in fields
    meta = {f.name for f in msgspec.structs.fields(_decode_score._Meta)}
    assert set(schema.keys) <= meta
    assert b"".join(k.encode() for k in schema.keys) == schema.key_bytes.tobytes()


def test_the_number_limits_of_the_kernels_are_those_of_the_types() -> None:
    exact = 2 ** (np.finfo(np.float64).nmant + 1)  # integers exact in a double
    assert scanner_scan._EXACT_MANTISSA == scanner_rows._EXACT == exact
    f32 = np.finfo(np.float32)
    assert float(f32.tiny) <= scanner_scan._F32_TINY < 2 * float(f32.tiny)
    assert float(f32.max) > scanner_scan._F32_SAFE
    # the id writer: every id below its limit has at most as many digits as it has powers
    assert len(str(scanner_ids._LIMIT - 1)) <= len(scanner_ids._POWERS)
    assert MAX_TOKEN_ID < scanner_ids._LIMIT
    assert (
        scanner_ids._ASCII_ZEROS
        == scanner_scan._ASCII_ZEROS
        == np.uint64(int.from_bytes(b"0" * 8, "little"))
    )


def test_the_fault_numbers_of_the_checks_follow_their_names() -> None:
    names = ("negative_id", "id_above", "lp_nan", "lp_posinf", "lp_above")
    names += ("pad_before_id", "duplicate")
    numbers = (scanner_checks.NEGATIVE_ID, scanner_checks.ID_ABOVE, scanner_checks.LP_NAN)
    numbers += (scanner_checks.LP_POSINF, scanner_checks.LP_ABOVE, scanner_checks.PAD_BEFORE_ID)
    numbers += (scanner_checks.DUPLICATE,)
    assert tuple(scanner_checks.FAULTS.index(n) for n in names) == numbers
    assert scanner_checks.N_FAULTS == len(scanner_checks.FAULTS) == len(set(scanner_checks.FAULTS))
    # every fault the sample checks report is one the kernel names
    assert {n for n, _ in _student_topk._ARRAY_FAULTS} == set(scanner_checks.FAULTS)
    assert {n for n, _ in _student_topk._ROW_FAULTS} <= set(scanner_checks.FAULTS)


def test_the_kernel_and_its_numpy_twin_name_the_same_faults_at_the_same_rows() -> None:
    # one row per fault, in FAULTS order
    ids = np.array(
        [[PAD_ID - 1, 1], [MAX_TOKEN_ID + 1, 1], [1, 2], [1, 2], [1, 2], [PAD_ID, 3], [4, 4]],
        dtype=np.int64,
    )
    lps = np.full(ids.shape, -1.0)
    lps[2, 0], lps[3, 0], lps[4, 0] = np.nan, np.inf, 0.5
    twin_out, twin = _student_topk._topk_faults(ids, lps)
    out, kernel = scanner_calls.topk_check(
        ids, lps, PAD_ID, MAX_TOKEN_ID, wire_checks.LOGPROB_TOLERANCE
    )
    assert set(twin) == set(scanner_checks.FAULTS)
    assert {name: twin[name] for name in scanner_checks.FAULTS} == {
        name: row for row, name in enumerate(scanner_checks.FAULTS)
    } | {"lp_above": 3}  # +inf is above the tolerance too, and its row comes first
    assert kernel == twin
    assert np.array_equal(out, twin_out)

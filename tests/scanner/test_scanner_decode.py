"""The compiled scanner (``opd_stream.wire._scan_reader``) against the msgspec decoder, on the
same bytes.

The rule: the scanner accepts an answer only when the msgspec decoder accepts it, and then
gives exactly the same arrays (it has no leniency: an id written ``5.0`` is handed back);
every other answer is handed back (``None``), and ``decode_score_response(parser="scanner")``
raises the msgspec decoder's error, type and message.
"""

from __future__ import annotations

import copy
import json
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import fake_generate as wf
from support.fuzz_corpus import FUZZ, REQUESTS, VALID, field_values, json_values, mutate, paths_of

from opd_stream import OPDStreamError
from opd_stream.scanner._loader import available, prepare
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import PARSERS, decode_in_slices, decode_score_response, parser_for
from opd_stream.wire._columns import EntryColumns
from opd_stream.wire._decode_columns import decode_segments_columns
from opd_stream.wire._decode_generate import decode_generate_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest, layout
from opd_stream.wire._scan_reader import read_answers_jit


def _mock_requests() -> list[tuple[str, ScoreRequest]]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 30000, 40 + 97, dtype=np.int64)
    ids = np.stack([rng.choice(150000, 5, replace=False) for _ in range(97)]).astype(np.int64)
    out = []
    for form in ("per-position", "flat", "blocked"):
        for top_k, wire in ((0, "json"), (3, "json"), (3, "b64")):
            for block in (0, 1, 7) if form == "blocked" else (0,):
                req = ScoreRequest(
                    tokens=tokens,
                    response_length=97,
                    top_k=top_k,
                    ids=ids,
                    id_form=form,  # type: ignore[arg-type]
                    topk_wire=wire,  # type: ignore[arg-type]
                    block_size=block,
                )
                out.append((f"{form}-k{top_k}-{wire}-B{block}", req))
    for top_k, wire in ((0, "json"), (4, "json"), (4, "b64")):
        for start in ("prompt", "zero"):
            req = ScoreRequest(
                tokens=tokens,
                response_length=97,
                top_k=top_k,
                topk_wire=wire,  # type: ignore[arg-type]
                start=start,  # type: ignore[arg-type]
            )
            out.append((f"noids-k{top_k}-{wire}-{start}", req))
    return out


MOCK = _mock_requests()


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert prepare(), "numba could not compile the scanner"


def _jit(body: bytes | bytearray, req: ScoreRequest) -> ScoreRows | None:
    lay = layout(req)
    return decode_segments_columns(
        body,
        batch=lay.batch,
        segments=lay.segments,
        tokens=lay.tokens,
        top_k=req.top_k,
        reader=read_answers_jit,
    )


def _assert_same(a: ScoreRows, b: ScoreRows) -> None:
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            assert x.tobytes() == y.tobytes(), name  # bit for bit: -0.0 is not 0.0
        else:
            assert x == y, name


def _differential(body: bytes, req: ScoreRequest) -> ScoreRows | None:
    fast = _jit(body, req)
    try:
        slow: ScoreRows | OPDStreamError = decode_score_response(body, req)
    except OPDStreamError as exc:
        slow = exc
    if fast is not None:
        assert not isinstance(slow, OPDStreamError), f"jit accepted what msgspec rejects: {slow}"
        _assert_same(slow, fast)
    try:
        public: ScoreRows | OPDStreamError = decode_score_response(body, req, parser="scanner")
    except OPDStreamError as exc:
        public = exc
    if isinstance(slow, OPDStreamError):
        assert type(public) is type(slow) and str(public) == str(slow)
    else:
        assert isinstance(public, ScoreRows)
        _assert_same(slow, public)
    for nbytes in (1, 37, 1 << 20):  # the scan a slice at a time: the same outcome
        sliced = _sliced(body, req, nbytes)
        if isinstance(slow, OPDStreamError):
            assert type(sliced) is type(slow) and str(sliced) == str(slow)
        else:
            assert isinstance(sliced, ScoreRows)
            _assert_same(slow, sliced)
    return fast


def _sliced(body: bytes | bytearray, req: ScoreRequest, nbytes: int) -> ScoreRows | OPDStreamError:
    """``decode_in_slices`` run to its end (its outcome: the rows, or the error)."""
    steps = decode_in_slices(body, req, nbytes)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        rows: ScoreRows = done.value[0]
        return rows
    except OPDStreamError as exc:
        return exc


def test_the_scanner_compiles_and_is_the_parser_of_choice() -> None:
    assert available()
    assert parser_for() == "scanner"


@pytest.mark.parametrize(("name", "req"), MOCK, ids=[n for n, _ in MOCK])
def test_mock_answers_decode_to_identical_arrays(name: str, req: ScoreRequest) -> None:
    body = InProcessSGLang("teacher", 1).handle("POST", "/generate", build_score_payload(req)).body
    fast = _jit(body, req)
    assert fast is not None, "the scanner handed a valid answer back"
    _assert_same(decode_score_response(body, req), fast)
    _assert_same(decode_score_response(bytearray(body), req, parser="scanner"), fast)
    for nbytes in (1, 4096):
        sliced = _sliced(body, req, nbytes)
        assert isinstance(sliced, ScoreRows)
        _assert_same(sliced, fast)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_fake_answers_decode_to_identical_arrays(name: str) -> None:
    body = wf.encode(VALID[name])
    assert _differential(body, REQUESTS[name]) is not None


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_pretty_printed_answers_are_scanned_too(name: str) -> None:
    body = json.dumps(VALID[name], indent=2).encode()
    assert _differential(body, REQUESTS[name]) is not None


@FUZZ
@given(
    name=st.sampled_from(sorted(REQUESTS)),
    data=st.data(),
    n_mutations=st.integers(min_value=1, max_value=3),
)
def test_mutated_answers_are_accepted_only_when_msgspec_accepts_them(
    name: str, data: st.DataObject, n_mutations: int
) -> None:
    obj = copy.deepcopy(VALID[name])
    for _ in range(n_mutations):
        path = data.draw(st.sampled_from(paths_of(obj)))
        op = data.draw(
            st.sampled_from(["replace", "delete", "duplicate", "truncate", "bump", "b64-flip"])
        )
        obj = mutate(obj, path, op, data.draw(field_values) if op == "replace" else None)
    _differential(json.dumps(obj).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), value=json_values)
def test_random_json_is_handed_back_with_msgspecs_error(name: str, value: Any) -> None:
    _differential(json.dumps(value).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), data=st.data())
def test_truncated_and_corrupted_bodies_are_handed_back(name: str, data: st.DataObject) -> None:
    body = wf.encode(VALID[name])
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    junk = data.draw(st.binary(max_size=8))
    _differential(body[:cut] + junk, REQUESTS[name])


def _per_position(edit: Any) -> bytes:
    obj = copy.deepcopy(VALID["ids-per-position"])
    obj["meta_info"]["input_token_ids_logprobs"][-1][0][0] = -0.5
    return edit(json.dumps(obj, separators=(",", ":"))).encode()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("label", "edit", "taken"),
    [
        ("NaN literal", lambda s: s.replace("-0.5", "NaN", 1), False),
        ("a boolean logprob", lambda s: s.replace("-0.5", "true", 1), False),
        ("a text element", lambda s: s.replace("[-0.5,", '[-0.5,"x",', 1), False),
        ("a second object after the answer", lambda s: s + "\n" + s, False),
        ("duplicate meta_info", lambda s: s[:-1] + ',"meta_info":{}}', False),
        ("a byte-order mark", lambda s: "\ufeff" + s, False),
        (
            "a key spelled with an escape",
            lambda s: s.replace('"input_token_ids_logprobs"', '"input\\u005ftoken_ids_logprobs"'),
            False,
        ),
        (
            "a duplicate logprob key",
            lambda s: s.replace('"meta_info":{', '"meta_info":{"input_token_logprobs":null,', 1),
            False,
        ),
        ("a leading zero in a logprob", lambda s: s.replace("-0.5", "-00.5", 1), False),
        ("an exponent logprob", lambda s: s.replace("-0.5", "-5E-1", 1), True),
        (
            "a logprob with 25 digits",
            lambda s: s.replace("-0.5", "-0.5000000000000000000000001", 1),
            True,
        ),
        ("minus zero", lambda s: s.replace("-0.5", "-0.0", 1), True),
        ("a tiny logprob", lambda s: s.replace("-0.5", "-1e-44", 1), False),
    ],
)
def test_edge_answers_get_the_msgspec_outcome(label: str, edit: Any, taken: bool) -> None:
    body = _per_position(edit)
    fast = _differential(body, REQUESTS["ids-per-position"])
    assert (fast is not None) is taken, label


def test_an_integral_float_id_is_handed_back() -> None:
    obj = copy.deepcopy(VALID["ids-per-position"])
    row = obj["meta_info"]["input_token_ids_logprobs"][-1]
    text = json.dumps(obj, separators=(",", ":"))
    body = text.replace(f",{row[0][1]},", f",{row[0][1]}.0,", 1).encode()
    assert body != text.encode()
    assert _jit(body, REQUESTS["ids-per-position"]) is None
    with pytest.raises(OPDStreamError, match="Expected `int`, got `float`"):
        decode_score_response(body, REQUESTS["ids-per-position"], parser="scanner")


def test_an_abort_is_reported_by_the_msgspec_decoder() -> None:
    obj = copy.deepcopy(VALID["plain"])
    obj["meta_info"]["finish_reason"] = {"type": "abort", "message": "queue full"}
    body = wf.encode(obj)
    assert _jit(body, REQUESTS["plain"]) is None
    with pytest.raises(OPDStreamError, match="queue full") as info:
        decode_score_response(body, REQUESTS["plain"], parser="scanner")
    assert info.value.reason == "aborted"


def _deep(body: bytes, levels: int) -> bytes:
    return b'{"deep":' + b"[" * levels + b"]" * levels + b"," + body[1:]


def test_an_unknown_field_nested_100k_deep_is_malformed_on_every_path() -> None:
    req = REQUESTS["ids-per-position"]
    body = _deep(wf.encode(VALID["ids-per-position"]), 100_000)
    assert _jit(body, req) is None
    for parser in PARSERS:
        with pytest.raises(OPDStreamError, match="nested too deeply") as info:
            decode_score_response(body, req, parser=parser)
        assert info.value.reason == "malformed_response"


@pytest.mark.parametrize(
    "name", ["plain", "topk-json", "topk-b64", "ids-per-position", "ids-blocked"]
)
def test_a_positive_logprob_is_malformed_for_both_parsers(name: str) -> None:
    req = REQUESTS[name]
    obj = copy.deepcopy(VALID[name])
    item = obj[-1] if isinstance(obj, list) else obj
    item["meta_info"]["input_token_logprobs"][-1][0] = 5.0
    body = wf.encode(obj)
    for parser in PARSERS:
        with pytest.raises(OPDStreamError, match="logprob above 0") as info:
            decode_score_response(body, req, parser=parser)
        assert info.value.reason == "malformed_response"


def test_a_tiny_positive_logprob_from_float_rounding_is_accepted() -> None:
    req = REQUESTS["plain"]
    obj = copy.deepcopy(VALID["plain"])
    obj["meta_info"]["input_token_logprobs"][-1][0] = 5e-5
    body = wf.encode(obj)
    rows = _jit(body, req)
    assert rows is not None and rows.token_logprobs[-1] == np.float32(5e-5)
    _assert_same(decode_score_response(body, req), rows)


def test_an_unknown_field_nested_deeper_than_the_scanner_goes_gets_msgspecs_outcome() -> None:
    plain = wf.encode(VALID["ids-per-position"])
    for levels in (10, 70, 100_000):
        body = b'{"deep":' + b"[" * levels + b"]" * levels + b"," + plain[1:]
        _differential(body, REQUESTS["ids-per-position"])


def _f32_neighbours() -> list[float]:
    """Doubles at and just around float32 rounding midpoints, and float32 values."""
    out = []
    rng = np.random.default_rng(3)
    for f in -rng.random(200).astype(np.float32) * 20:
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
        up = struct.unpack("<f", struct.pack("<I", bits + 1))[0]
        mid = (float(f) + float(up)) / 2
        out += [float(f), mid, np.nextafter(mid, 0.0), np.nextafter(mid, -1.0)]
    return out


def test_logprobs_at_float32_midpoints_round_as_msgspec_rounds_them() -> None:
    req = REQUESTS["ids-per-position"]
    values = _f32_neighbours()
    taken = 0
    for v in values:
        obj = copy.deepcopy(VALID["ids-per-position"])
        obj["meta_info"]["input_token_ids_logprobs"][-1][0][0] = v
        taken += _differential(wf.encode(obj), req) is not None
    assert taken >= len(values) // 4  # float32 values and most neighbours are scanned


@FUZZ
@given(
    value=st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
    | st.floats(min_value=-1e-30, max_value=0.0)
    | st.floats(width=32, max_value=0.0, allow_nan=False, allow_infinity=False),
    style=st.sampled_from(["repr", "e", "f"]),
)
def test_any_logprob_text_is_read_as_msgspec_reads_it(value: float, style: str) -> None:
    text = {"repr": repr(value), "e": f"{value:.20e}", "f": f"{value:.30f}"}[style]
    body = _per_position(lambda s: s.replace("-0.5", text, 1))
    _differential(body, REQUESTS["ids-per-position"])


def test_the_scanner_takes_its_fields_from_the_msgspec_schema() -> None:
    from opd_stream.wire._decode_score import B64, ENTRIES, ROWS
    from opd_stream.wire._scan_reader import _SCHEMA

    assert dict(zip(_SCHEMA.keys, _SCHEMA.kinds, strict=True)) == {
        "input_token_logprobs": ENTRIES,
        "input_top_logprobs": ROWS,
        "input_token_ids_logprobs": ROWS,
        "output_token_ids_logprobs": ROWS,
        "input_top_logprobs_val_flat_b64": B64,
        "input_top_logprobs_idx_flat_b64": B64,
    }


def _zero_answer(name: str, spelling: str) -> bytes:
    """``VALID[name]`` with its last token logprob and the first entry of every last row
    written as ``spelling``."""
    obj = copy.deepcopy(VALID[name])
    for item in obj if isinstance(obj, list) else [obj]:
        meta = item["meta_info"]
        meta["input_token_logprobs"][-1][0] = -0.125
        for field in ("input_top_logprobs", "input_token_ids_logprobs"):
            if meta.get(field):
                meta[field][-1][0][0] = -0.125
    text = json.dumps(obj, separators=(",", ":"))
    assert "-0.125" in text
    return text.replace("-0.125", spelling).encode()


@pytest.mark.parametrize("spelling", ["-0", "-0.0", "-0.000", "-0e0", "0", "-0E-3"])
@pytest.mark.parametrize("name", ["plain", "topk-json", "ids-per-position", "ids-blocked"])
def test_a_negative_zero_logprob_is_read_alike_on_every_path(name: str, spelling: str) -> None:
    # msgspec, the reference, reads "-0" as the integer 0 (0.0) and "-0.0" as -0.0; the
    # scanner gives the same bits, and takes the answer itself
    req = REQUESTS[name]
    body = _zero_answer(name, spelling)
    fast = _jit(body, req)
    assert fast is not None
    slow = decode_score_response(body, req)
    _assert_same(slow, fast)
    _assert_same(slow, decode_score_response(body, req, parser="scanner"))
    assert fast.token_logprobs[-1] == 0.0
    for arr in (fast.token_logprobs, fast.top_logprobs, fast.id_logprobs):
        if arr is not None:
            zeros = np.signbit(arr[arr == 0.0])
            assert not zeros.any() if spelling in ("-0", "0") else zeros.all()


def test_a_logprob_written_minus_zero_is_zero_in_a_sampling_answer() -> None:
    body = b'{"output_ids":[5,6],"meta_info":{"output_token_logprobs":[[-0,5,null],[-0.0,6]]}}'
    (gen,) = decode_generate_response(body)
    assert gen.output_logprobs.tolist() == [0.0, 0.0]
    assert np.signbit(gen.output_logprobs).tolist() == [False, True]  # as msgspec reads them


def test_full_double_logprobs_are_scanned_not_handed_back() -> None:
    # a double that is no float32 (a server computing in float64) is still taken: its
    # float32 rounding is unambiguous unless it lies within ~1e-14 of a rounding boundary
    rng = np.random.default_rng(3)
    for value in -rng.random(40) * 10:
        body = _per_position(lambda s, v=value: s.replace("-0.5", repr(float(v)), 1))
        assert _differential(body, REQUESTS["ids-per-position"]) is not None


def test_eight_digits_at_once_only_when_all_eight_are_digits() -> None:
    from opd_stream.scanner._scan import _eight_digits

    for pos in range(8):
        for byte in range(256):
            text = bytearray(b"12345678")
            text[pos] = byte
            got = _eight_digits(np.frombuffer(bytes(text), dtype=np.uint8), 0)
            want = int(text) if text.isdigit() else -1
            assert got == want, (pos, byte)
    for value in (0, 9, 10_000_000, 99_999_999, 12_345_678, 90_000_009):
        assert _eight_digits(np.frombuffer(b"%08d" % value, dtype=np.uint8), 0) == value


@FUZZ
@given(digits=st.text("0123456789", min_size=1, max_size=40), point=st.integers(0, 40))
def test_long_digit_runs_are_read_as_msgspec_reads_them(digits: str, point: int) -> None:
    point = min(point, len(digits) - 1)
    text = "-" + digits[: point + 1].lstrip("0").rjust(1, "0") + "." + digits[point + 1 :] + "1"
    body = _per_position(lambda s: s.replace("-0.5", text, 1))
    _differential(body, REQUESTS["ids-per-position"])


def test_without_numba_msgspec_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    import opd_stream.scanner._loader as jr

    monkeypatch.setattr(jr, "_kernel", None)
    monkeypatch.setattr(jr, "_failed", True)
    assert not prepare()
    assert parser_for() == "msgspec"
    body = wf.encode(VALID["plain"])
    assert read_answers_jit(body, False) is None
    _assert_same(
        decode_score_response(body, REQUESTS["plain"]),
        decode_score_response(body, REQUESTS["plain"], parser="scanner"),
    )


_ALPHABET = b'[]{},:"\\0123456789.-eE nul'


@FUZZ
@given(
    data=st.binary(max_size=600)
    | st.lists(st.sampled_from(list(_ALPHABET)), max_size=600).map(bytes)
    | st.sampled_from(sorted(REQUESTS)).flatmap(
        lambda name: st.integers(0, len(wf.encode(VALID[name]))).map(
            lambda cut: wf.encode(VALID[name])[:cut]
        )
    ),
    batch=st.booleans(),
)
def test_the_scan_survives_any_bytes_and_stays_in_its_buffers(data: bytes, batch: bool) -> None:
    from opd_stream.scanner import _calls as kernel
    from opd_stream.wire._scan_reader import _SCHEMA

    (status, n_rec, _, n_ent, n_rows), lps, _, widths, _, _, records = kernel.scan_buffers(
        data, batch, _SCHEMA
    )
    assert status in (kernel.OK, kernel.UNUSUAL)  # never out of buffer space
    assert 0 <= n_ent <= lps.shape[0] and 0 <= n_rows <= widths.shape[0]
    for rec in records[:n_rec]:
        assert 0 <= rec[kernel.R_START] < rec[kernel.R_END] <= len(data)
    assert read_answers_jit(data, batch) is None or data.lstrip()[:1] in (b"{", b"[")


def _b64_answer(edit: Any) -> bytes:
    obj = copy.deepcopy(VALID["topk-b64"])
    meta = (obj[-1] if isinstance(obj, list) else obj)["meta_info"]
    meta["input_top_logprobs_val_flat_b64"] = edit(meta["input_top_logprobs_val_flat_b64"])
    return wf.encode(obj)


@pytest.mark.parametrize(
    ("label", "edit", "taken"),
    [
        ("as sent", lambda t: t, True),
        ("an escaped slash", lambda t: t.replace("/", "\\/") if "/" in t else t + "\\/", False),
        ("excess padding", lambda t: t + "====" if not t.endswith("=") else t, False),
        ("a space inside", lambda t: t[:4] + " " + t[4:], False),
        ("a non-alphabet character", lambda t: t[:4] + "*" + t[5:], False),
        ("padding inside", lambda t: t[:4] + "=" + t[5:], False),
        ("one character short", lambda t: t[:-1], False),
        ("empty", lambda t: "", False),
    ],
)
def test_b64_strings_are_read_as_b64decode_reads_them(label: str, edit: Any, taken: bool) -> None:
    body = _b64_answer(lambda t: edit(t))
    if "\\/" in label or "escaped" in label:
        body = body.replace(b"\\\\/", b"\\/")  # one JSON escape, not an escaped backslash
    fast = _differential(body, REQUESTS["topk-b64"])
    assert (fast is not None) is taken, label


# ------------------------------------------------- the compact entries, eight bytes a step

_LONG_IDS = np.array(
    [[1, 22, 333], [4_444, 55_555, 666_666], [7_777_777, 88_888_888, 999_999_999]] * 22,
    dtype=np.int64,
)
_LONG_ROWS = len(_LONG_IDS)
_LONG = ScoreRequest(
    tokens=np.arange(_LONG_ROWS + 20, dtype=np.int64) + 3,
    response_length=_LONG_ROWS,
    ids=_LONG_IDS,
)
_LP_TEXT = st.one_of(
    st.floats(width=32, max_value=0.0, allow_nan=False, allow_infinity=False).map(repr),
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False).map(repr),
    st.builds(
        lambda sign, whole, frac: f"{sign}{whole}.{frac}",
        st.sampled_from(["-", ""]),
        st.sampled_from(["0", "1", "12", "123", "1234", "00", "012"]),
        st.text("0123456789", min_size=0, max_size=26),
    ),
    st.sampled_from(["-0.0", "0.0", "-0", "-1e-05", "-1.5E+2", "-2.5e-3", "-.5", "-1.", "-3"]),
)


def _long_answer(texts: dict[tuple[int, int], str], id_texts: dict[tuple[int, int], str]) -> bytes:
    """The compact answer to :data:`_LONG`, with the given logprob and id texts in place."""
    obj: Any = wf.answer(build_score_payload(_LONG))
    rows = obj["meta_info"]["input_token_ids_logprobs"][-_LONG_ROWS:]
    marks = {}
    for n, (at, text) in enumerate(sorted(texts.items())):
        rows[at[0]][at[1]][0] = -7.0 - (n + 1) / 1024  # a unique, exactly printed mark
        marks[f"[{rows[at[0]][at[1]][0]!r},"] = f"[{text},"
    for at, text in id_texts.items():
        rows[at[0]][at[1]][0] = -9.0 - (at[0] * 3 + at[1] + 1) / 1024
        marks[f"[{rows[at[0]][at[1]][0]!r},{_LONG_IDS[at]},"] = f"[-0.25,{text},"
    body = json.dumps(obj, separators=(",", ":"))
    for mark, text in marks.items():
        assert mark in body
        body = body.replace(mark, text, 1)
    return body.encode()


def test_compact_logprobs_of_every_length_are_read_as_msgspec_reads_them() -> None:
    rng = np.random.default_rng(5)
    texts = [
        f"-{whole}.{''.join(map(str, rng.integers(0, 10, frac)))}"
        for whole in ("0", "3", "45", "678")
        for frac in range(1, 25)
    ]
    for start in range(0, len(texts), _LONG_ROWS * 3):
        chunk = texts[start : start + _LONG_ROWS * 3]
        body = _long_answer({divmod(j, 3): t for j, t in enumerate(chunk)}, {})
        assert _differential(body, _LONG) is not None


@FUZZ
@given(
    texts=st.dictionaries(
        st.tuples(st.integers(0, _LONG_ROWS - 1), st.integers(0, 2)), _LP_TEXT, max_size=12
    ),
    id_text=st.sampled_from(["0{}", "-{}", "{}.0", "{}e0", " {} ", "{}"]),
    id_at=st.tuples(st.integers(0, _LONG_ROWS - 1), st.integers(0, 2)),
)
def test_compact_entries_are_read_as_msgspec_reads_them(
    texts: dict[tuple[int, int], str], id_text: str, id_at: tuple[int, int]
) -> None:
    # ids of 1 to 9 digits: most entries take the eight-byte path, and whatever it
    # refuses (an exponent, a leading zero, 19+ digits, an id written as a float or with
    # a leading zero) must come out exactly as msgspec says
    texts.pop(id_at, None)
    body = _long_answer(texts, {id_at: id_text.format(_LONG_IDS[id_at])})
    _differential(body, _LONG)


def test_a_long_compact_answer_is_scanned() -> None:
    body = _long_answer({}, {})
    assert _differential(body, _LONG) is not None


def test_leading_digits_of_a_word_for_every_byte_at_every_position() -> None:
    from opd_stream.scanner._scan import _digits_value, _lead_digits

    for pos in range(8):
        for byte in range(256):
            text = bytearray(b"98765432")
            text[pos] = byte
            word = np.uint64(int.from_bytes(text, "little"))
            want = next((j for j, c in enumerate(text) if not 48 <= c <= 57), 8)
            assert _lead_digits(word) == want, (pos, byte)
            if want:
                assert _digits_value(word, want) == int(text[:want]), (pos, byte)


@pytest.mark.parametrize(
    ("entry", "taken"),
    [
        ("-2.189894676208496,92342,null],[", True),
        ("-14.404208183288574,420,null],[", True),
        ("-0.04875009134411812,7,null],[", True),
        ("0.0,1234567,null],[", True),
        ("-123.5,1,null],[", True),
        ("-1234.5,1,null],[", False),  # four digits before the point
        ("-1.0013580322265625e-05,5,null],[", False),  # an exponent
        ("-0.1234567890123456789,5,null],[", False),  # 19 digits
        ("-01.5,5,null],[", False),  # a leading zero
        ("-1.5,12345678,null],[", False),  # an eight-digit id
        ("-1.5,05,null],[", False),
        ("-1.5, 5,null],[", False),  # whitespace
        ("-1.5,5,null]]", False),  # a row's last entry
        ("-1.5,-5,null],[", False),
    ],
)
def test_the_eight_byte_path_takes_only_the_compact_form(entry: str, taken: bool) -> None:
    from opd_stream.scanner._scan import _P10, _fast_entry, _number

    b = np.frombuffer(entry.encode() + b" " * 64, dtype=np.uint8)
    end, lp, token, ok = _fast_entry(b, 0, len(b), _P10)
    assert ok is taken
    if taken:
        _, want, _ = _number(b, 0, len(b), _P10)
        assert lp == want and np.signbit(lp) == np.signbit(want)
        assert token == int(entry.split(",")[1])
        assert entry.encode()[end - 1 : end + 1] == b",["


_B64_STRAYS = sorted({*b'\x00\t "+,-./09:=@AZ[\\]`az{\x7f\x80\xff'})


def test_b64_strings_of_every_length_with_any_stray_byte_are_read_as_b64decode_reads_them() -> None:
    # four characters a step through the string's body, the rest one at a time: whichever
    # way a stray byte or the padding is met, the outcome is b64decode's on the canonical
    # form and "unusual" on anything else
    import base64
    import re

    from opd_stream.scanner._scan import OK, _b64

    rng = np.random.default_rng(3)
    canonical = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
    for size in range(20):
        text = base64.b64encode(rng.bytes(size))
        variants = [text] + [
            text[:at] + bytes([c]) + text[at + drop :]
            for at in range(len(text) + 1)
            for c in _B64_STRAYS
            for drop in (0, 1)
        ]
        for s in variants:
            body = b'"' + s + b'"' + b" " * 8
            b = np.frombuffer(body, dtype=np.uint8)
            raw = np.zeros(len(body), dtype=np.uint8)
            end, nb, status = _b64(b, 0, len(body), raw, np.int64(0))
            content = s.split(b'"')[0]
            want = canonical.fullmatch(content) is not None and len(content) % 4 == 0
            assert (status == OK) is want, s
            if want:
                assert raw[:nb].tobytes() == base64.b64decode(content, validate=True), s
                assert end == len(content) + 2, s


def _mock_body(req: ScoreRequest) -> bytes:
    body: bytes = (
        InProcessSGLang("teacher", 1).handle("POST", "/generate", build_score_payload(req)).body
    )
    return body


def test_entry_columns_keep_int64_ids_and_make_the_doubles_only_when_read() -> None:
    ints = np.array([3, 150000, 2**52], dtype=np.int64)
    cols = EntryColumns.of(ints, np.zeros(3))
    assert cols.ints is ints
    doubles = cols.ids
    assert doubles.dtype == np.float64 and doubles.tolist() == [3.0, 150000.0, 2.0**52]
    assert cols.ids is doubles  # made once
    given = np.array([1.0, 2.0])
    as_doubles = EntryColumns.of(given, np.zeros(2))
    assert as_doubles.ids is given and as_doubles.ints is None


def test_a_per_position_answer_is_picked_from_the_scanned_int64_ids() -> None:
    name, req = next((n, r) for n, r in MOCK if n.startswith("per-position-k0"))
    body = _mock_body(req)
    answers = read_answers_jit(body, layout(req).batch)
    assert answers is not None
    entries = answers.rows("input_token_ids_logprobs").entries
    assert entries.ints is not None and entries.ints.dtype == np.int64
    rows = _differential(body, req)  # the fast path: the same arrays as msgspec's
    assert rows is not None and rows.id_logprobs is not None, name


def test_a_field_absent_from_every_item_is_one_shared_read_only_object() -> None:
    name, req = next((n, r) for n, r in MOCK if n.startswith("per-position-k0"))
    body = _mock_body(req)
    first, second = (read_answers_jit(body, layout(req).batch) for _ in range(2))
    assert first is not None and second is not None
    a, b = first.rows("input_top_logprobs"), second.rows("input_top_logprobs")
    assert a is b, name
    assert a.item_null.tolist() == [True] and a.item_off.tolist() == [0, 0]
    for arr in (a.item_null, a.item_off, a.row_null, a.row_width, a.entry_off):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[...] = 0

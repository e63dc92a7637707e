"""A rollout's flat Python lists (its token ids, its rollout logprobs) read through the
compiled reader give what numpy's conversion gives: the same arrays, or the same error."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opd_stream.scanner._loader as jit
from opd_stream import InvalidSampleError, Sample
from opd_stream._sample import prepare_sample


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


def _outcome(tokens: Any, r: int, rollout: Any) -> Any:
    try:
        p = prepare_sample(Sample(tokens, r, rollout_logprobs=rollout), 0, teacher="t", top_k=0)
    except InvalidSampleError as exc:
        return ("error", str(exc))
    assert p.rollout_logprobs is not None
    return ("ok", p.tokens.tobytes(), p.tokens.dtype, p.rollout_logprobs.tobytes())


def _both(tokens: Any, r: int, rollout: Any) -> Any:
    fast = _outcome(tokens, r, rollout)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jit, "_kernel", None)
        slow = _outcome(tokens, r, rollout)
    assert fast == slow
    return fast


def _reads(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Record whether each call of the compiled reader ``name`` took its list."""
    calls: list[bool] = []
    kernel = jit.compiled()
    assert kernel is not None
    real = getattr(kernel, name)

    def spy(*args: Any) -> Any:
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(kernel, name, spy)
    return calls


_TOKEN = (
    st.integers(0, 200_000)
    | st.integers(-(2**63), 2**64 + 5)  # every msgpack integer width, signed and unsigned
    | st.sampled_from(
        [0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, -1, -33, True, False]
    )
    | st.sampled_from([3.0, None, "7", np.int64(5), np.int32(-2), np.uint64(2**63)])
)
_LOGPROB = (
    st.floats(max_value=0.0, allow_nan=False)
    | st.floats(width=32, max_value=0.0, allow_nan=False)
    | st.sampled_from([-math.inf, math.inf, math.nan, 0, -3, 5e-5, 1e-4, 2e-4, True, None])
    | st.sampled_from([np.float32(-0.5), np.float64(-1.5), "x"])
)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 40),
    container=st.sampled_from([list, tuple]),
    plain=st.booleans(),
)
def test_any_lists_give_the_same_arrays_or_error(
    data: st.DataObject, n: int, container: Any, plain: bool
) -> None:
    if plain:  # mostly valid: the reader's own path, with a rare odd element
        tokens = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        r = data.draw(st.integers(0, n - 1))
        rollout = data.draw(
            st.lists(st.floats(-50.0, 0.0), min_size=r, max_size=r)
            | st.lists(_LOGPROB, min_size=r, max_size=r)
        )
    else:
        tokens = data.draw(st.lists(_TOKEN, min_size=n, max_size=n))
        r = data.draw(st.integers(0, n - 1))
        rollout = data.draw(st.lists(_LOGPROB, min_size=max(r - 1, 0), max_size=r + 1))
    _both(container(tokens), r, container(rollout))


def test_a_rollout_takes_the_reader_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    tokens = [*rng.integers(0, 2**31, 600).tolist(), 0, 127, 128, 255, 256, 65535, 65536]
    rollout = [*(-rng.random(500) * 30).tolist(), -0.0, 0.0, 1e-4, -5e-324, -1e39]
    id_reads = _reads(monkeypatch, "ids_read")
    lp_reads = _reads(monkeypatch, "logprobs_read")
    assert _both(tokens, len(rollout), rollout)[0] == "ok"
    assert id_reads == [True] and lp_reads == [True]


def test_the_reader_gives_every_value_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [2**31 - 1, 65536, 65535, 256, 255, 128, 127, 1, 0, 9]
    rollout = [-0.0, -1e-300, -5e-324, -1.0000000000000002, -(2.0**-149), -3e38, -1e39, -7.25]
    p = prepare_sample(Sample(tokens, 8, rollout_logprobs=rollout), 0, teacher="t", top_k=0)
    assert p.tokens.tolist() == tokens
    with np.errstate(over="ignore"):  # -1e39 is -inf in float32
        want = np.array(rollout, dtype=np.float64).astype(np.float32)
    assert p.rollout_logprobs is not None
    assert p.rollout_logprobs.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([5, -1, 7], "negative token id at position 1"),
        ([5, 2**31, 7], "token id above 2147483647 at position 1"),
        ([5, True, 7], "element 1 is bool, expected int"),
        ([5, 6.0, 7], "element 1 is float, expected int"),
        ([5, 6, 2**64], "does not fit in 64 bits"),
    ],
)
def test_a_bad_token_is_named_alike(
    tokens: list[Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _reads(monkeypatch, "ids_read")
    kind, text = _both(tokens, 1, [-0.5])[:2]
    assert kind == "error" and message in text
    assert True not in reads  # not taken: numpy's path named it


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "non-finite value at response position 1"),
        (-math.inf, "non-finite value at response position 1"),
        (0.5, "value > 0 at response position 1 is not a logprob"),
    ],
)
def test_a_bad_logprob_is_named_alike(value: float, message: str) -> None:
    kind, text = _both([1, 2, 3, 4], 3, [-0.5, value, -1.0])[:2]
    assert kind == "error" and message in text


@pytest.mark.parametrize(
    "body",
    [
        b"",  # no array header
        msgspec.msgpack.encode([1, 2]),  # one id short of three
        msgspec.msgpack.encode([1, 2, 3]) + b"\x00",  # a byte after the list
        msgspec.msgpack.encode([1, 2, 3])[:-1],  # cut short
        msgspec.msgpack.encode({"a": 1}),  # not an array
    ],
)
def test_the_id_reader_takes_nothing_but_the_whole_list(body: bytes) -> None:
    kernel = jit.compiled()
    assert kernel is not None
    assert kernel.ids_read(body, 3, 2**31 - 1) is None


def test_the_id_reader_takes_every_length_header() -> None:
    kernel = jit.compiled()
    assert kernel is not None
    for n in (0, 15, 16, 65535, 65536):  # fixarray, array16, array32
        ids = list(range(n))
        got = kernel.ids_read(msgspec.msgpack.encode(ids), n, 2**31 - 1)
        assert got is not None and got.tolist() == ids
    assert kernel.ids_read(msgspec.msgpack.encode([4, 5]), 2, 4) is None  # above max_id


def test_the_logprob_reader_takes_nothing_but_the_whole_list() -> None:
    kernel = jit.compiled()
    assert kernel is not None
    body = msgspec.msgpack.encode([-0.5, -1.0])
    assert kernel.logprobs_read(body, 2, 1e-4) is not None
    assert kernel.logprobs_read(body, 3, 1e-4) is None
    assert kernel.logprobs_read(body + b"\x00", 2, 1e-4) is None
    assert kernel.logprobs_read(body[:-1], 2, 1e-4) is None
    assert kernel.logprobs_read(msgspec.msgpack.encode([-0.5, 0]), 2, 1e-4) is None  # an int

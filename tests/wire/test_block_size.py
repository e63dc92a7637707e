"""Blocked id scoring's automatic block size (``id_block_size = 0``).

The choice is checked against what actually crosses the wire: for each candidate block
size the request is built and answered by the mock, and the bytes are counted.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import (
    AUTO_BLOCK_SIZES,
    ScoreRequest,
    auto_block_size,
    resolved_block_size,
)

VOCAB = 50_000


def _ids(rng: np.random.Generator, r: int, k: int, overlap: float) -> npt.NDArray[np.int64]:
    """``r`` rows of ``k`` distinct ids; about ``overlap`` of each row repeats the last one."""
    rows = [rng.choice(VOCAB, k, replace=False)]
    for _ in range(r - 1):
        keep = rows[-1][: round(overlap * k)]
        fresh = rng.choice(VOCAB, 3 * k, replace=False)
        fresh = fresh[~np.isin(fresh, keep)][: k - keep.size]
        rows.append(np.concatenate((keep, fresh)))
    return np.stack(rows).astype(np.int64)


def _wire_bytes(server: InProcessSGLang, req: ScoreRequest) -> int:
    payload = build_score_payload(req)
    answer = server.handle("POST", "/generate", payload)
    assert answer.status == 200
    decode_score_response(answer.body, req)  # a valid answer
    return len(payload) + len(answer.body)


@pytest.mark.parametrize(
    ("prompt", "r", "k", "overlap"),
    [(256, 16, 16, 0.3), (256, 256, 16, 0.3), (2048, 256, 8, 0.5), (16, 200, 4, 0.0)],
)
def test_auto_block_size_is_within_15_percent_of_the_fewest_wire_bytes(
    prompt: int, r: int, k: int, overlap: float
) -> None:
    rng = np.random.default_rng(prompt + r + k)
    tokens = rng.integers(0, VOCAB, prompt + r).astype(np.int64)
    ids = _ids(rng, r, k, overlap)
    server = InProcessSGLang("teacher", 3, per_position="unpatched", vocab_size=VOCAB)
    base = {"tokens": tokens, "response_length": r, "ids": ids, "id_form": "blocked"}
    measured = {
        b: _wire_bytes(server, ScoreRequest(**base, block_size=b))  # type: ignore[arg-type]
        for b in AUTO_BLOCK_SIZES
        if b <= r
    }
    chosen = auto_block_size(tokens, r, ids)
    assert chosen in measured
    assert measured[chosen] <= 1.15 * min(measured.values())


def test_identical_rows_make_one_block_per_64_positions() -> None:
    # no new ids per row: bigger blocks only save re-sent prefixes
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, 300).astype(np.int64)
    ids = np.tile(rng.choice(VOCAB, 8, replace=False), (200, 1)).astype(np.int64)
    assert auto_block_size(tokens, 200, ids) == max(AUTO_BLOCK_SIZES)


def test_disjoint_rows_after_a_tiny_prompt_make_small_blocks() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, 202).astype(np.int64)
    ids = _ids(rng, 200, 16, 0.0)
    assert auto_block_size(tokens, 200, ids) <= 2


def test_a_longer_prompt_never_makes_smaller_blocks() -> None:
    rng = np.random.default_rng(2)
    ids = _ids(rng, 128, 16, 0.3)
    sizes = [
        auto_block_size(rng.integers(0, VOCAB, p + 128).astype(np.int64), 128, ids)
        for p in (1, 64, 512, 4096, 32768)
    ]
    assert sizes == sorted(sizes)
    assert sizes[-1] > sizes[0]


def test_one_response_token_is_one_block() -> None:
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    assert auto_block_size(np.arange(10, dtype=np.int64), 1, ids) == 1


def test_an_explicit_block_size_is_kept_and_zero_resolves_to_the_auto_choice() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, VOCAB, 100).astype(np.int64)
    ids = _ids(rng, 40, 4, 0.2)
    base = {"tokens": tokens, "response_length": 40, "ids": ids, "id_form": "blocked"}
    assert resolved_block_size(ScoreRequest(**base, block_size=3)) == 3  # type: ignore[arg-type]
    auto = ScoreRequest(**base, block_size=0)  # type: ignore[arg-type]
    assert resolved_block_size(auto) == auto_block_size(tokens, 40, ids)
    explicit = ScoreRequest(**base, block_size=resolved_block_size(auto))  # type: ignore[arg-type]
    assert build_score_payload(auto) == build_score_payload(explicit)

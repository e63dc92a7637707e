"""``meta_info.cached_tokens`` (what a server served from its prefix cache) is read from every
answer by each parser, summed over a batch's items, and ``None`` when no item reports it."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from opd_stream.scanner._loader import prepare
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import PARSERS, Parser, decode_score_response
from opd_stream.wire._decode_columns import decode_segments_columns
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest, layout
from opd_stream.wire._scan_reader import read_answers_jit

_RNG = np.random.default_rng(11)
_TOKENS = _RNG.integers(0, 30000, 30 + 20, dtype=np.int64)
_IDS = np.stack([_RNG.choice(150000, 3, replace=False) for _ in range(20)]).astype(np.int64)
REQUESTS = {
    "single": ScoreRequest(tokens=_TOKENS, response_length=20, top_k=2),
    "batch": ScoreRequest(
        tokens=_TOKENS, response_length=20, ids=_IDS, id_form="blocked", block_size=6
    ),
}


def _decode(body: bytes, req: ScoreRequest, parser: Parser) -> ScoreRows:
    """The parser's own answer (a fast reader that handed the body back fails the test)."""
    if parser == "msgspec":
        return decode_score_response(body, req, parser="msgspec")
    lay = layout(req)
    rows = decode_segments_columns(
        body,
        batch=lay.batch,
        segments=lay.segments,
        tokens=lay.tokens,
        top_k=req.top_k,
        reader=read_answers_jit,
    )
    assert rows is not None, f"the {parser} reader handed a valid answer back"
    return rows


def _answer(req: ScoreRequest) -> bytes:
    return InProcessSGLang("teacher", 1).handle("POST", "/generate", build_score_payload(req)).body


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    # prepare() answers False at once while another thread (a stream of an earlier test)
    # compiles: wait for that compile, and fail only when it failed
    from opd_stream.scanner import _loader

    while not prepare():
        assert not _loader._failed, "numba could not compile the scanner"
        time.sleep(0.05)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_cached_tokens_are_summed_over_the_items(name: str, parser: Parser) -> None:
    req = REQUESTS[name]
    items = len(layout(req).segments)
    body = _answer(req)
    assert body.count(b'"cached_tokens":0') == items
    counter = iter(range(1, items + 1))
    body = re.sub(rb'"cached_tokens":0', lambda _: b'"cached_tokens":%d' % next(counter), body)
    rows = _decode(body, req, parser)
    assert rows.cached_tokens == items * (items + 1) // 2


@pytest.mark.parametrize("parser", PARSERS)
def test_an_answer_without_cached_tokens_reports_none(parser: Parser) -> None:
    req = REQUESTS["single"]
    body = _answer(req).replace(b'"cached_tokens":0,', b"")
    assert b"cached_tokens" not in body
    assert _decode(body, req, parser).cached_tokens is None

"""The answer codec: a scoring request's answer decoded, by whichever parser is ready.

Plain sync functions; which step runs in a worker thread, and its timing, is the fetch
stage's (:mod:`opd_stream.fetch._threads`).

Which parser (:func:`parser_for`): the compiled scanner (:mod:`opd_stream.wire._scan_reader`,
numba, GIL released) wherever it is ready (compiled once per process in the background,
:mod:`opd_stream.scanner._loader`); until then, or where numba cannot run, msgspec (GIL
held). The scanner hands an answer it does not accept to msgspec, which raises the precise
error. Their costs: ``docs/design-notes.md``, "opd_stream/wire/_codec.py".
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from typing import Final, Literal, get_args

from ..scanner._loader import available
from ._answers import Body, ScoreRows
from ._columns import Reader
from ._decode_columns import decode_segments_columns
from ._decode_score import decode_segments
from ._payloads import build_block_payloads
from ._request import Layout, ScoreRequest, layout
from ._scan_reader import read_answers_jit, read_scanned, scan_slices
from ._vllm_decode import decode_vllm

__all__ = (
    "PARSERS",
    "Answer",
    "Parser",
    "answer_size",
    "build_block_payloads",
    "decode",
    "decode_block_answers",
    "decode_in_slices",
    "decode_score_response",
    "parser_for",
)

Parser = Literal["scanner", "msgspec"]
"""The parsers of a scoring answer: the compiled scanner, and msgspec (its fallback)."""
#: The same names as a tuple (the fields of ``StreamStats.decoded``, in this order).
PARSERS: Final[tuple[Parser, ...]] = get_args(Parser)
#: An answer: one body, or (the ``"blocks"`` id form) one body per block, in block order.
Answer = Body | Sequence[Body]


def answer_size(answer: Answer) -> int:
    """The bytes of an answer (all its blocks)."""
    if isinstance(answer, Body):
        return len(answer)
    return sum(map(len, answer))


def parser_for() -> Parser:
    """The parser for a decode, on the loop or in a thread: the compiled scanner once it
    is ready (never waited for), else msgspec."""
    return "scanner" if available() else "msgspec"


def decode(
    answer: Answer, req: ScoreRequest, *, lay: Layout | None = None
) -> tuple[ScoreRows, Parser]:
    """Decode an answer with the parser of the moment (:func:`parser_for`): the rows,
    and the parser that gave them (``"msgspec"`` where the fast one handed it on). ``lay``:
    ``layout(req)`` where the caller has it (from the body's build). A vLLM request's
    answer is decoded by :func:`~opd_stream.wire._vllm_decode.decode_vllm` (msgspec; a
    request split into column chunks, :func:`~opd_stream.wire._request.multi_body`, gives a
    list of answers like the ``"blocks"`` id form)."""
    if req.engine != "sglang":
        return decode_vllm(answer, req, lay if lay is not None else layout(req)), "msgspec"
    parser = parser_for()
    if isinstance(answer, Body):
        return _decode_one(answer, req, parser, lay)
    return _decode_blocks(answer, req, parser)


def decode_score_response(
    body: Body, req: ScoreRequest, *, parser: Parser = "msgspec"
) -> ScoreRows:
    """Decode and validate the HTTP 200 answer to ``build_score_payload(req)``.

    ``parser`` picks how the JSON is read; both give the same arrays and the same errors.
    ``"msgspec"`` holds the GIL for the whole decode (~4-10 ns per byte). ``"scanner"`` uses the
    compiled scanner (GIL released, ~1.5-3 ns per byte; both with every check, see the
    module's docstring) when it is ready
    (:func:`opd_stream.scanner._loader.prepare`). An answer the scanner does not accept is decoded
    again with msgspec, which raises the precise error (see
    :mod:`opd_stream.wire._decode_columns`).

    Checks, per item (messages name the field as a ``$.meta_info.…`` path and the absolute
    / response position, never payload values): ``finish_reason.type != "abort"``; every
    requested field present; ``input_token_logprobs`` has ``L - s`` entries and echoes
    ``tokens[s+1:]``; top-k rows in the response range are non-null with ``top_k`` entries
    (or the b64 fields are consistent); requested-id rows return exactly the requested ids
    in order (per-position: ``ids[t]``; flat / blocked: the sorted union); a batch answer has
    one item per block. Stitched blocked results equal per-position ones exactly.

    Raises:
        MalformedResponseError: not JSON, truncated, wrong types, missing field, bad b64.
        MisalignedResponseError: counts, echoed token ids or requested ids differ.
        ServerAbortError: ``finish_reason.type == "abort"`` (with the server's message).
        CapabilityError: ``"per_position"`` when a per-position request is answered
            without ``input_token_ids_logprobs`` (the server ignored the field).
        InvalidSampleError: ``req`` itself is malformed.
    """
    return _decode_one(body, req, parser)[0]


def _decode_one(
    body: Body, req: ScoreRequest, parser: Parser, lay: Layout | None = None
) -> tuple[ScoreRows, Parser]:
    if lay is None:
        lay = layout(req)
    if req.engine != "sglang":
        return decode_vllm(body, req, lay), "msgspec"
    per_position = _per_position(req)
    return _decode_laid(body, lay, lay.batch, req.top_k, parser, per_position)


def _per_position(req: ScoreRequest) -> bool:
    """Whether ``req`` asks for its ids per position (the msgspec decoder's last word)."""
    return req.ids is not None and req.id_form == "per-position"


def decode_in_slices(
    answer: Answer, req: ScoreRequest, nbytes: int, *, lay: Layout | None = None
) -> Generator[None, None, tuple[ScoreRows, Parser]]:
    """:func:`decode`, its scan a slice of about ``nbytes`` at a time: a generator that
    yields between two slices (the GIL released in each) and returns what :func:`decode`
    returns (or raises what it raises), for a caller that wants its thread back between
    them (the event loop: :mod:`opd_stream.fetch._attempts`). What the scanner does not
    take, and a decode without it (not ready yet, a vLLM answer, blocks), runs whole."""
    if req.engine != "sglang" or not isinstance(answer, Body):
        return decode(answer, req, lay=lay)
    if lay is None:
        lay = layout(req)
    slices = scan_slices(answer, lay.batch)
    if slices is None:
        return decode(answer, req, lay=lay)
    while (scanned := slices.step(nbytes)) is None:
        yield
    per_position = _per_position(req)
    reader = functools.partial(read_scanned, scanned=scanned)
    return _decode_laid(answer, lay, lay.batch, req.top_k, "scanner", per_position, reader)


def _decode_laid(
    body: Body,
    lay: Layout,
    batch: bool,
    top_k: int,
    parser: Parser,
    per_position: bool,
    reader: Reader = read_answers_jit,
) -> tuple[ScoreRows, Parser]:
    """``parser``'s reader first (unless msgspec), msgspec for what it hands back."""
    if parser == "scanner":
        rows = decode_segments_columns(
            body, batch=batch, segments=lay.segments, tokens=lay.tokens, top_k=top_k, reader=reader
        )
        if rows is not None:
            return rows, parser
    got = decode_segments(
        body,
        batch=batch,
        segments=lay.segments,
        tokens=lay.tokens,
        top_k=top_k,
        per_position=per_position,
    )
    return got, "msgspec"


def decode_block_answers(
    bodies: Sequence[Body], req: ScoreRequest, *, parser: Parser = "msgspec"
) -> ScoreRows:
    """Decode the answers to :func:`build_block_payloads` (in order) and stitch them.

    The answers are checked together as the items of one batch answer (item ``n`` is block
    ``n``: every check of :func:`decode_score_response`, in one vectorised pass); the result
    equals the per-position one exactly.
    """
    return _decode_blocks(bodies, req, parser)[0]


def _decode_blocks(
    bodies: Sequence[Body], req: ScoreRequest, parser: Parser
) -> tuple[ScoreRows, Parser]:
    lay = layout(req)
    if req.engine != "sglang":
        return decode_vllm(bodies, req, lay), "msgspec"
    if len(bodies) != len(lay.segments):
        raise ValueError(f"{len(bodies)} answers for {len(lay.segments)} blocks")
    joined = b"[" + b",".join(bodies) + b"]"
    return _decode_laid(joined, lay, True, req.top_k, parser, False)

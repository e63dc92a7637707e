"""The probe's requests: one cold and one warm scoring request per replica of every teacher
(the comparison and the report: :mod:`opd_stream.fleet._probe`)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import anyio
import numpy as np
import numpy.typing as npt

from .._errors import OPDStreamError, ServerError, ServerHTTPError
from ..transport._transports import Transport
from ..wire._codec import decode_score_response
from ..wire._error_body import parse_error_message
from ..wire._payloads import build_score_payload
from ..wire._request import ScoreRequest, layout
from ._discovery import FleetDirectory
from ._probe import UNANSWERED, Answer, ProbeReport, compare
from ._router import generate_url

__all__ = ("run_probe",)


async def _ask(
    transport: Transport,
    url: str,
    req: ScoreRequest,
    *,
    max_bytes: int,
    secret: str | None,
) -> tuple[npt.NDArray[np.float64], str | None]:
    resp = await transport.post(generate_url(url), build_score_payload(req), max_bytes=max_bytes)
    if resp.status != 200:
        raise ServerHTTPError(resp.status, parse_error_message(resp.body, secret=secret), url=url)
    rows = decode_score_response(resp.body, req)
    return rows.token_logprobs.astype(np.float64), rows.weight_version


async def _probe_replica(
    transport: Transport,
    teacher: str,
    url: str,
    tokens: npt.NDArray[np.int64],
    response_length: int,
    *,
    start: str,
    deadline_s: float,
    max_bytes: int,
    secret: str | None,
) -> Answer:
    salt = secrets.token_hex(8)  # fresh: nothing cached under it
    req = ScoreRequest(
        tokens=tokens,
        response_length=response_length,
        start="zero" if start == "zero" else "prompt",
        cache_salt=salt,
    )
    answer = Answer(teacher=teacher, url=url)
    try:
        with anyio.fail_after(deadline_s):
            answer.cold, answer.weight_version = await _ask(
                transport, url, req, max_bytes=max_bytes, secret=secret
            )
            answer.warm, _ = await _ask(transport, url, req, max_bytes=max_bytes, secret=secret)
    except TimeoutError:
        answer.error = UNANSWERED
        answer.cold = answer.warm = None
    except ServerError as exc:
        answer.error = exc.reason
        answer.cold = answer.warm = None
    return answer


async def run_probe(
    transport: Transport,
    fleets: FleetDirectory,
    teachers: Mapping[str, tuple[str, ...]],
    tokens: npt.NDArray[np.int64],
    response_length: int,
    *,
    tolerance: float,
    start: str,
    deadline_s: float,
    max_bytes: int,
    secret: str | None = None,
) -> ProbeReport:
    """Probe every replica of every teacher at once (routers expanded to their workers);
    each replica's cold and warm requests within ``deadline_s`` (``probe_deadline_s``: one
    that does not answer in time is reported with error ``deadline_exceeded``, and the
    probe ends at that deadline). Raises only for a probe request the caller's sample
    cannot make (:class:`InvalidSampleError`)."""
    layout(ScoreRequest(tokens=tokens, response_length=response_length))  # checks the sample
    targets: list[tuple[str, str]] = []
    for name, urls in teachers.items():
        targets.extend((name, url) for url in await fleets.expand(urls))
    answers: list[Answer | None] = [None] * len(targets)
    errors: list[BaseException] = []

    async def one(i: int, teacher: str, url: str) -> None:
        try:
            answers[i] = await _probe_replica(
                transport,
                teacher,
                url,
                tokens,
                response_length,
                start=start,
                deadline_s=deadline_s,
                max_bytes=max_bytes,
                secret=secret,
            )
        except OPDStreamError as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, (teacher, url) in enumerate(targets):
            tg.start_soon(one, i, teacher, url)
    if errors:
        raise errors[0]
    done = [a for a in answers if a is not None]
    return compare(done, tolerance, response_length)

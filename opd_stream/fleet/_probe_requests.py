"""The probe's requests: one cold and one warm scoring request per replica of every teacher
(the comparison and the report: :mod:`opd_stream.fleet._probe`)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import anyio
import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import OPDStreamError, ServerError, ServerHTTPError
from ..transport._transports import Request, Transport
from ..wire._codec import decode
from ..wire._error_body import parse_error_message
from ..wire._payloads import build_laid
from ..wire._request import ScoreRequest, layout
from ..wire._vllm import ENGINE_PATHS
from ._discovery import FleetDirectory
from ._engines import DETECT_STATUSES, EngineDirectory
from ._probe import UNANSWERED, Answer, ProbeReport, compare
from ._routing import endpoint_url

__all__ = ("run_probe",)


async def _ask(
    transport: Transport,
    url: str,
    req: ScoreRequest,
    *,
    max_bytes: int,
    secret: str | None,
    engines: EngineDirectory | None,
) -> tuple[npt.NDArray[np.float64], str | None, ScoreRequest]:
    """One probe request in ``url``'s engine (detected first when its ``/generate``
    answers 404/405 under ``engine="auto"``): its logprobs, weight version, and the request
    as sent (in the engine found)."""
    if engines is not None:
        req = msgspec.structs.replace(req, engine=engines.engine(url))
    lay = layout(req)
    body = build_laid(req, lay)
    resp = await transport.send(
        Request(url=endpoint_url(url, ENGINE_PATHS[req.engine]), max_bytes=max_bytes, body=body)
    )
    if (
        resp.status in DETECT_STATUSES
        and engines is not None
        and req.engine == "sglang"
        and engines.detects(url)
    ):
        await engines.detect("teacher", url, resp.status)
        return await _ask(transport, url, req, max_bytes=max_bytes, secret=secret, engines=engines)
    if resp.status != 200:
        raise ServerHTTPError(resp.status, parse_error_message(resp.body, secret=secret), url=url)
    rows, _ = decode(resp.body, req, lay=lay)
    if engines is not None:
        engines.answered(url, req.engine)
    return rows.token_logprobs.astype(np.float64), rows.weight_version, req


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
    engines: EngineDirectory | None,
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
            answer.cold, answer.weight_version, req = await _ask(
                transport, url, req, max_bytes=max_bytes, secret=secret, engines=engines
            )
            answer.engine = req.engine
            answer.warm, _, _ = await _ask(
                transport, url, req, max_bytes=max_bytes, secret=secret, engines=engines
            )
    except TimeoutError:
        answer.error = UNANSWERED
        answer.cold = answer.warm = None
    except ServerError as exc:
        answer.error = exc.reason
        answer.cold = answer.warm = None
    if engines is not None:
        answer.engine = engines.known(url)
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
    engines: EngineDirectory | None = None,
    others: tuple[str, ...] = (),
) -> ProbeReport:
    """Probe every replica of every teacher at once (routers expanded to their workers);
    each replica's cold and warm requests within ``deadline_s`` (``probe_deadline_s``: one
    that does not answer in time is reported with error ``deadline_exceeded``, and the
    probe ends at that deadline). ``engines``: the stream's (each replica is asked in its
    engine, detected first where ``auto`` finds its ``/generate`` missing; the report
    names each replica's engine); ``others``: servers (the student) whose engine alone is
    found (:meth:`EngineDirectory.discover`) and reported in ``servers``. Raises only for
    a probe request the caller's sample cannot make (:class:`InvalidSampleError`)."""
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
                engines=engines,
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
    report = compare(done, tolerance, response_length)
    if engines is None or not others:
        return report
    found = dict(report.servers)
    with anyio.move_on_after(deadline_s):
        for url in others:
            try:
                found[url] = await engines.discover("student", url)
            except ServerError:
                found[url] = None
    for url in others:
        found.setdefault(url, None)
    return msgspec.structs.replace(report, servers=found)

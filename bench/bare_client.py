"""A bare client: the work of scoring a sample, with no pipeline around it.

``bench.cpu_burst`` runs it beside ``opd_stream`` on the same samples and the same mock
servers, so a run shows what the pipeline (overlap, channels, tasks, deadlines, retries,
balancing, stats, the full candidate set) costs on top of the work itself. The work, one
sample after another, each step the fastest known way:

* the sample checked and converted (``opd_stream``'s ``prepare_sample``: every check);
* the request body (``opd_stream``'s compiled ids writer), its ids not checked again;
* one ``POST /generate`` over a kept-alive ``http.client`` connection (the standard
  library's client: one request at a time, no event loop), the body read into one buffer
  sized by its ``Content-Length``;
* the answer parsed by ``opd_stream``'s compiled scanner with every check;
* the reverse KL over the student's candidates in four torch calls on one intra-op
  thread: ``sum(softmax(s) * (s - t))`` (``only-student``, ``weight_mode="student_p"``).

No deadline, no retry, nothing overlapped (the next request waits for this one's KL), no
candidate tensors, no stats: it is not a client anyone should run, only a floor of the work.
"""

from __future__ import annotations

import http.client
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt
import torch

from opd_stream import Sample
from opd_stream._sample import prepare_sample, request_ids
from opd_stream.kl._threads import one_intraop_thread
from opd_stream.wire._codec import decode
from opd_stream.wire._payloads import build_laid
from opd_stream.wire._request import ScoreRequest, layout

__all__ = ("bare_reverse_kl",)


def _one(
    conn: http.client.HTTPConnection, sample: Sample, index: int, k: int
) -> npt.NDArray[np.float32]:
    p = prepare_sample(sample, index, teacher="default", top_k=k)
    if p.student_top_ids is None or p.student_top_logprobs is None:
        raise ValueError("the bare client scores samples that carry their student top-k")
    req = ScoreRequest(
        tokens=p.tokens,
        response_length=p.response_length,
        ids=request_ids(p.student_top_ids),
        ids_checked=True,
    )
    lay = layout(req)
    conn.request("POST", "/generate", build_laid(req, lay), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the bare client got HTTP {resp.status}")
    size = int(resp.headers["Content-Length"])
    body = bytearray(size)
    view, got = memoryview(body), 0
    while got < size:
        n = resp.readinto(view[got:])
        if not n:
            raise RuntimeError("the answer was cut short")
        got += n
    rows, parser = decode(body, req, lay=lay)
    if parser != "scanner" or rows.id_logprobs is None:
        raise RuntimeError(f"the bare client needs the compiled scanner (got {parser})")
    s = torch.from_numpy(p.student_top_logprobs)
    t = torch.from_numpy(rows.id_logprobs)
    kl: npt.NDArray[np.float32] = (torch.softmax(s, dim=-1) * (s - t)).sum(-1).numpy()
    return kl


def bare_reverse_kl(
    samples: Sequence[Sample], teacher_url: str, k: int
) -> list[npt.NDArray[np.float32]]:
    """Each sample's per-token reverse KL (only-student, top-``k``), one after another."""
    url = urlsplit(teacher_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port)

    def run() -> list[npt.NDArray[np.float32]]:
        return [_one(conn, s, i, k) for i, s in enumerate(samples)]

    try:
        return one_intraop_thread(run)
    finally:
        conn.close()

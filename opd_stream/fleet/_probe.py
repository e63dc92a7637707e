"""The probe: one scoring request asked of every replica of every teacher, cold and warm,
to see whether the fleet gives one signal (:meth:`OPDStream.probe`, ``opd-stream probe``).

Each replica gets the same request cold (a fresh random ``cache_salt``) and warm (the same
salt again); the report gives, per teacher, the largest difference between replicas (cold
answers) and between each replica's cold and warm answers, naming the replicas beyond the
tolerance. This module is the sans-IO part (the report types, :func:`compare`,
:func:`ejectable`); the requests are :func:`opd_stream.fleet._probe_requests.run_probe`'s.
Why: ``docs/design-notes.md``, "opd_stream/fleet/_probe.py".
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from ..wire._request import Engine

__all__ = (
    "PROBE_RESPONSE_LENGTH",
    "UNANSWERED",
    "Answer",
    "ProbeReport",
    "ReplicaProbe",
    "compare",
    "default_probe_tokens",
    "ejectable",
)

UNANSWERED = "deadline_exceeded"
"""``ReplicaProbe.error`` of a replica that did not answer within the probe's deadline."""

PROBE_RESPONSE_LENGTH = 32
"""Scored positions of the default probe request (the last 32 of 64 tokens)."""

_PROBE_LENGTH = 64
_PROBE_SEED = 26


def default_probe_tokens() -> npt.NDArray[np.int64]:
    """The default probe sequence: 64 fixed ids in ``[100, 1000)`` (present in every real
    vocabulary), the same in every process. A real sample (``probe(sample)``) probes with
    the numbers training will see; this one needs nothing from the caller."""
    rng = np.random.default_rng(_PROBE_SEED)
    return rng.integers(100, 1000, _PROBE_LENGTH).astype(np.int64)


class ReplicaProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What the probe found about one replica.

    Attributes:
        teacher: the teacher name.
        url: the replica (a router's worker when discovery found one).
        engine: the dialect it was asked in (configured, or detected under
            ``engine="auto"``); ``None`` where not known (it did not answer).
        weight_version: the cold answer's ``meta_info.weight_version``.
        vs_replicas: the largest difference, in nats over the scored positions, between
            this replica's cold logprobs and the teacher's replicas' median (with two
            replicas there is no majority: their difference); ``None`` when it did not
            answer, ``0`` for a teacher's only replica.
        cold_vs_warm: the largest difference between its cold and warm answers.
        error: the failure's reason when a request failed (then not compared):
            ``deadline_exceeded`` when it did not answer within the probe's deadline
            (``probe_deadline_s``), else the reason of the failed request (such as
            ``teacher_http_500``).
        outlier: ``vs_replicas`` or ``cold_vs_warm`` is beyond the tolerance.
        ejected: the probe took it out of the stream's rotation (an outlier, or a replica
            that did not answer in time).
    """

    teacher: str
    url: str
    engine: Engine | None = None
    weight_version: str | None = None
    vs_replicas: float | None = None
    cold_vs_warm: float | None = None
    error: str | None = None
    outlier: bool = False
    ejected: bool = False


class ProbeReport(msgspec.Struct, frozen=True, kw_only=True):
    """The probe's result (also what ``opd-stream probe`` prints, as JSON).

    Attributes:
        tolerance: the largest difference accepted, in nats (``probe_tolerance``).
        positions: logprobs compared per answer.
        replicas: one entry per replica of every teacher.
        max_replica_diff: the largest difference between two replicas of one teacher at
            one position (cold answers), over every teacher; 0 with one replica each.
        max_cold_warm_diff: the largest difference between a replica's cold and warm
            answers at one position, over every replica.
        outliers: the URLs of the replicas beyond the tolerance.
        failed: the URLs of the replicas whose requests failed or did not answer in time
            (each one's ``error`` says which).
        servers: the engine of every server the probe looked at (each replica, and the
            student): ``sglang``, ``vllm`` or ``vllm-completions``, configured or detected
            (``engine="auto"``); ``None`` where it could not be told (no answer).
    """

    tolerance: float
    positions: int
    replicas: tuple[ReplicaProbe, ...]
    max_replica_diff: float
    max_cold_warm_diff: float
    outliers: tuple[str, ...]
    failed: tuple[str, ...]
    servers: dict[str, Engine | None] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every replica answered and none is beyond the tolerance."""
        return not self.outliers and not self.failed


class Answer(msgspec.Struct, kw_only=True):
    """One replica's two answers (logprobs of the scored positions), or its failure."""

    teacher: str
    url: str
    engine: Engine | None = None
    cold: npt.NDArray[np.float64] | None = None
    warm: npt.NDArray[np.float64] | None = None
    weight_version: str | None = None
    error: str | None = None


def _max_diff(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    """``max |a - b|`` where two ``-inf`` agree (0) and one ``-inf`` is infinitely off."""
    both = np.isneginf(a) & np.isneginf(b)
    with np.errstate(invalid="ignore"):  # -inf - -inf, masked just below
        diff = np.where(both, 0.0, np.abs(a - b))
    return float(diff.max(initial=0.0))


def compare(answers: Sequence[Answer], tolerance: float, positions: int) -> ProbeReport:
    """The report of a probe's answers (see :class:`ProbeReport`). Sans-IO."""
    by_teacher: dict[str, list[Answer]] = {}
    for a in answers:
        by_teacher.setdefault(a.teacher, []).append(a)
    out: list[ReplicaProbe] = []
    max_replicas = 0.0
    max_warm = 0.0
    for group in by_teacher.values():
        ok = [a for a in group if a.cold is not None and a.warm is not None]
        colds = np.stack([a.cold for a in ok if a.cold is not None]) if ok else None
        if colds is not None and len(ok) >= 2:
            hi, lo = colds.max(axis=0), colds.min(axis=0)
            with np.errstate(invalid="ignore"):  # -inf - -inf: every replica agrees
                spread = np.where(np.isneginf(hi), 0.0, hi - lo)
            max_replicas = max(max_replicas, float(spread.max(initial=0.0)))
            center = np.median(colds, axis=0)
        for a in group:
            if a.cold is None or a.warm is None:
                out.append(
                    ReplicaProbe(teacher=a.teacher, url=a.url, engine=a.engine, error=a.error)
                )
                continue
            if len(ok) == 2:
                other = ok[1] if ok[0] is a else ok[0]
                assert other.cold is not None
                vs = _max_diff(a.cold, other.cold)
            elif len(ok) > 2:
                vs = _max_diff(a.cold, center)
            else:
                vs = 0.0
            warm = _max_diff(a.cold, a.warm)
            max_warm = max(max_warm, warm)
            out.append(
                ReplicaProbe(
                    teacher=a.teacher,
                    url=a.url,
                    engine=a.engine,
                    weight_version=a.weight_version,
                    vs_replicas=vs,
                    cold_vs_warm=warm,
                    outlier=vs > tolerance or warm > tolerance,
                )
            )
    return ProbeReport(
        tolerance=tolerance,
        positions=positions,
        replicas=tuple(out),
        max_replica_diff=max_replicas,
        max_cold_warm_diff=max_warm,
        outliers=tuple(r.url for r in out if r.outlier),
        failed=tuple(r.url for r in out if r.error is not None),
        servers={r.url: r.engine for r in out},
    )


def ejectable(report: ProbeReport) -> tuple[str, ...]:
    """The replicas to take out: the outliers, and those that did not answer within the
    probe's deadline (a replica that hangs on scoring may still answer ``/health``), of a
    teacher that keeps at least one replica the probe found good (when every replica is
    off there is no telling which is right). A replica whose request failed at once (an
    HTTP error, a refused connection) is left to the stream's own health checks."""
    keep: set[str] = set()
    for r in report.replicas:
        if not r.outlier and r.error is None:
            keep.add(r.teacher)
    return tuple(
        r.url for r in report.replicas if (r.outlier or r.error == UNANSWERED) and r.teacher in keep
    )

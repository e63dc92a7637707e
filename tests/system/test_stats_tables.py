"""Each fact behind ``OPDStream.stats()`` is declared once: the CPU steps, the parsers and
the endpoint counters (the snapshot's keys and fields are read from those declarations)."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from opd_stream import EndpointStats
from opd_stream._stats import CPU_STEPS, CpuSeconds, EndpointTraffic, StatsRecorder
from opd_stream.fleet._endpoints import Endpoint
from opd_stream.wire._codec import PARSERS, Parser


def test_the_cpu_steps_are_the_fields_of_one_struct() -> None:
    rec = StatsRecorder()
    rec.cpu.align += 1.5
    rec.cpu.kl += 0.25
    cpu_s = rec.snapshot().cpu_s
    assert tuple(cpu_s) == CPU_STEPS == CpuSeconds.__struct_fields__
    assert cpu_s["align"] == 1.5 and cpu_s["kl"] == 0.25
    assert sum(cpu_s.values()) == 1.75


def test_a_misspelt_cpu_step_is_an_error_not_a_new_key() -> None:
    rec = StatsRecorder()
    with pytest.raises(AttributeError):
        rec.cpu.algin = 1.0  # type: ignore[attr-defined]
    assert tuple(rec.snapshot().cpu_s) == CPU_STEPS


def test_the_parsers_of_the_stats_are_the_parser_literal() -> None:
    assert get_args(Parser) == PARSERS
    rec = StatsRecorder()
    rec.decoded["jit"] += 2
    assert rec.snapshot().decoded == {"jit": 2, "msgspec": 0}
    assert tuple(rec.snapshot().decoded) == PARSERS


def test_endpoint_stats_carry_every_traffic_counter_of_the_endpoint() -> None:
    traffic = EndpointTraffic.__struct_fields__
    assert set(traffic) <= set(EndpointStats.__struct_fields__)
    ep = Endpoint()
    for i, name in enumerate(traffic, start=1):
        setattr(ep.traffic, name, i)
    snap = ep.stats()
    assert {name: getattr(snap, name) for name in traffic} == {
        name: i for i, name in enumerate(traffic, start=1)
    }
    # the snapshot is a copy: counting on goes on in the endpoint only
    ep.traffic.requests += 10
    assert snap.requests == traffic.index("requests") + 1


def test_endpoint_stats_are_frozen_and_the_counters_are_not_slots_of_the_endpoint() -> None:
    snap = Endpoint().stats()
    with pytest.raises(AttributeError):
        snap.requests = 1  # type: ignore[misc]
    assert hash(snap) == hash(Endpoint().stats())
    assert not set(Endpoint.__slots__) & set(EndpointTraffic.__struct_fields__)
    assert msgspec.structs.asdict(snap)["requests"] == 0

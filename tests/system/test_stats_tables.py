"""Each fact behind ``OPDStream.stats()`` is declared once: the CPU steps, the parsers, the
channels, the stages and the endpoint counters (the snapshot's keys and fields are read from
those declarations); the tables that were dicts before 1.0 are structs, still readable as
dicts for one release (deprecated)."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from opd_stream import EndpointStats
from opd_stream._stats import (
    CHANNELS,
    CPU_STEPS,
    STAGES,
    ChannelName,
    CpuSeconds,
    ParserCounts,
    PipelineChannels,
    StageActivity,
    StageName,
    StatsRecorder,
)
from opd_stream.fleet._endpoints import Endpoint
from opd_stream.fleet._records import EndpointTraffic
from opd_stream.wire._codec import PARSERS, Parser


def test_the_cpu_steps_are_the_fields_of_one_struct() -> None:
    rec = StatsRecorder()
    rec.cpu.align += 1.5
    rec.cpu.kl += 0.25
    cpu_s = rec.snapshot().cpu_s.as_dict()
    assert tuple(cpu_s) == CPU_STEPS == CpuSeconds.__struct_fields__
    assert cpu_s["align"] == 1.5 and cpu_s["kl"] == 0.25
    assert sum(cpu_s.values()) == 1.75


def test_a_misspelt_cpu_step_is_an_error_not_a_new_key() -> None:
    rec = StatsRecorder()
    with pytest.raises(AttributeError):
        rec.cpu.algin = 1.0  # type: ignore[attr-defined]
    assert tuple(rec.snapshot().cpu_s.as_dict()) == CPU_STEPS


def test_the_parsers_of_the_stats_are_the_parser_literal() -> None:
    assert get_args(Parser) == PARSERS == ParserCounts.__struct_fields__
    rec = StatsRecorder()
    rec.record_decode("scanner", 100)
    rec.record_decode("scanner", 20)
    snap = rec.snapshot()
    assert snap.decoded == ParserCounts(scanner=2, msgspec=0)
    assert snap.decoded_bytes.as_dict() == {"scanner": 120, "msgspec": 0}


def test_the_channels_and_stages_of_the_stats_are_their_literals() -> None:
    assert get_args(ChannelName) == CHANNELS == PipelineChannels.__struct_fields__
    assert get_args(StageName) == STAGES == StageActivity.__struct_fields__
    rec = StatsRecorder()
    rec.channel("kl", 8)
    rec.put("kl")
    rec.put("kl")
    rec.take("kl")
    rec.stage_active["teacher_fetch"] += 3
    snap = rec.snapshot()
    assert (snap.channels.kl.depth, snap.channels.kl.high_water, snap.channels.kl.capacity) == (
        1,
        2,
        8,
    )
    assert snap.channels.intake.depth == 0
    assert snap.stages == StageActivity(teacher_fetch=3)


def test_the_stats_tables_as_json_keep_their_shape() -> None:
    rec = StatsRecorder()
    rec.stage_active["decode"] += 1
    rec.record_decode("msgspec", 7)
    snap = msgspec.to_builtins(rec.snapshot())
    assert snap["stages"] == {"teacher_fetch": 0, "student_fetch": 0, "decode": 1, "kl": 0}
    assert snap["decoded"] == {"scanner": 0, "msgspec": 1}
    assert list(snap["channels"]) == list(CHANNELS)


def test_reading_a_stats_table_like_a_dict_is_deprecated_but_works() -> None:
    rec = StatsRecorder()
    rec.stage_active["kl"] += 2
    rec.channel("emit", 4)
    snap = rec.snapshot()
    with pytest.deprecated_call(match="StageActivity like a dict"):
        assert snap.stages["kl"] == 2
    with pytest.deprecated_call():
        assert dict(snap.stages.items()) == snap.stages.as_dict()
    with pytest.deprecated_call():
        assert snap.channels["emit"].capacity == 4
    with pytest.deprecated_call():
        assert list(snap.channels) == list(CHANNELS)
    with pytest.deprecated_call():
        assert "decode" in snap.stages and "nope" not in snap.stages
    with pytest.deprecated_call(match="CpuSeconds like a dict"):
        assert snap.cpu_s["kl"] == snap.cpu_s.kl == 0.0
    with pytest.deprecated_call(), pytest.raises(KeyError):
        snap.stages["nope"]


def test_the_old_parser_key_jit_reads_the_scanner_with_a_warning() -> None:
    rec = StatsRecorder()
    rec.record_decode("scanner", 5)
    snap = rec.snapshot()
    assert snap.decoded.scanner == 1 and snap.decoded_bytes.scanner == 5
    for read, expected in (
        (lambda: snap.decoded["jit"], 1),
        (lambda: snap.decoded_bytes.get("jit"), 5),
    ):
        with pytest.deprecated_call() as caught:
            assert read() == expected
        messages = [str(w.message) for w in caught]
        assert "the key 'jit' is deprecated: it is 'scanner' now" in " ".join(messages)


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

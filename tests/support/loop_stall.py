"""A host, in a fresh process, whose event loop keeps a heartbeat while it uses a stream:
how long did any of our calls hold its loop? Run by tests/system/test_loop_stall.py as

    python tests/support/loop_stall.py BACKEND TEACHER_URL STUDENT_URL
    python tests/support/loop_stall.py BACKEND TEACHER_URL --xtok SAMPLES_JSON
    python tests/support/loop_stall.py BACKEND - --torch-floor

(BACKEND ``asyncio`` or ``trio``); it prints one JSON object (see :func:`report`).

With ``--xtok``, the host's teacher has another tokenizer: SAMPLES_JSON holds the two
tokenizer paths (``student_tokenizer``, ``teacher_tokenizer``) and the samples (student
ids, the teacher prompt in the teacher's ids); the stream loads both tokenizers as it
starts, scores the samples in sampled-token mode, and leaves.

With ``--torch-floor``, the host only imports torch off its loop, as a stream does as it is
entered (its libraries preloaded without the GIL, then ``import torch`` in a worker thread):
the floor of a cold host's stall, torch's own C initialiser and module code, which no code of
ours can split.

The host imports what it uses at the top of its module, as hosts do, before its loop runs;
torch is not imported (the process is cold: nothing of torch, numba or the tokenizers is
loaded). Then, on the running loop, with a task that sleeps 5 ms again and again: it
builds an ``OPDStream`` (the default transport, ``kl_device="auto"``), enters it, runs 16
samples (top-k against a student), scores 4 at once with ``score()``, asks
``teacher_rows()``, waits for the compiled scanner (loaded in the background), runs 4 more
samples, and leaves.

The measure of one stall (the heartbeat's interval between two wake-ups, less the 5 ms
asked for) holds on a busy machine. Work of ours that holds the loop runs on the loop's
thread or holds the GIL elsewhere, so it burns this process's CPU all along; a busy
machine only keeps the loop's thread waiting for a core. So a stall is the interval's wall
time less the time the loop's thread waited for a core (Linux's ``schedstat``), and at
most the CPU time the whole process spent in it (``time.process_time``). The garbage
collector's passes are counted apart (``gc.callbacks``) and taken out: a full pass walks
every object of the process (torch's ~150k included), 0.1 s here, whoever allocated last
and whether or not we loaded torch; the report gives the longest pass too.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from typing import Any

import anyio
import anyio.to_thread

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig

SLEEP_S = 0.005

#: (wall start, wall end, CPU start, CPU end, the loop thread's CPU, the loop thread's
#: wait for a CPU) of each heartbeat interval
_beats: list[tuple[float, float, float, float, float, float]] = []
#: (start, end) of each garbage collection
_collections: list[tuple[float, float]] = []
#: (start time, name) of each phase of the host's work
_phases: list[tuple[float, str]] = []
_gc_start = [0.0]


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        _collections.append((_gc_start[0], time.perf_counter()))


def _waited(schedstat: str) -> float:
    """The seconds this thread has waited for a CPU while ready to run (Linux's
    ``schedstat``; 0 where there is none to read)."""
    try:
        with open(schedstat) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def _heartbeat() -> None:
    schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    wall, cpu, mine = time.perf_counter(), time.process_time(), time.thread_time()
    waited = _waited(schedstat)
    while True:
        await anyio.sleep(SLEEP_S)
        now, cpu_now, mine_now = time.perf_counter(), time.process_time(), time.thread_time()
        waited_now = _waited(schedstat)
        _beats.append((wall, now, cpu, cpu_now, mine_now - mine, waited_now - waited))
        wall, cpu, mine, waited = now, cpu_now, mine_now, waited_now


def _phase(name: str) -> None:
    _phases.append((time.perf_counter(), name))


def _samples(n: int, seed: int) -> list[Sample]:
    out = []
    for i in range(n):
        tokens = [(seed * 7919 + i * 31 + j * 17) % 5000 + 10 for j in range(256)]
        out.append(Sample(tokens, 64))
    return out


async def _use(teacher: str, student: str) -> None:
    _phase("construct")
    config = StreamConfig.from_env(
        {}, teachers=teacher, student_url=student, top_k=8, strategy="union", kl_batch_size=4
    )
    stream = OPDStream(config)
    _phase("enter")
    async with stream:
        _phase("run")
        async with stream.run(_samples(16, 1)) as results:
            got = [item async for item in results]
        assert len(got) == 16 and stream.stats().completed == 16, stream.stats()
        _phase("score")
        async with anyio.create_task_group() as tg:
            for sample in _samples(4, 2):
                tg.start_soon(stream.score, sample)
        _phase("teacher_rows")
        await stream.teacher_rows(_samples(1, 3)[0])
        _phase("kernels")
        from opd_stream.scanner import _loader

        loader = _loader._thread  # (the background thread, when it still runs)
        if loader is not None:
            await anyio.to_thread.run_sync(loader.join, 180)
        _phase("run_again")
        async with stream.run(_samples(4, 4)) as results:
            got = [item async for item in results]
        assert len(got) == 4
        _phase("exit")
    _phase("after")
    await anyio.sleep(0.05)


async def _use_xtok(teacher: str, given: dict[str, Any]) -> None:
    samples = [Sample(**fields) for fields in given["samples"]]
    _phase("construct")
    config = StreamConfig.from_env(
        {},
        teachers=teacher,
        student_tokenizer=given["student_tokenizer"],
        teacher_tokenizers={"default": given["teacher_tokenizer"]},
    )
    stream = OPDStream(config)
    _phase("enter")
    async with stream:
        _phase("run")
        async with stream.run(samples) as results:
            got = [item async for item in results]
        failed = [item for item in got if not isinstance(item, ScoredSample)]
        assert len(got) == len(samples) and not failed, failed
        _phase("score")
        scored = await stream.score(samples[0])
        assert scored.reverse_kl is not None, scored
        _phase("exit")
    _phase("after")
    await anyio.sleep(0.05)


def _gc_within(start: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in _collections)


def _phases_of(start: float, end: float) -> list[str]:
    names = []
    for k, (at, name) in enumerate(_phases):
        until = _phases[k + 1][0] if k + 1 < len(_phases) else float("inf")
        if at < end and until > start:
            names.append(name)
    return names


def report() -> dict[str, object]:
    """``stall_s``: the largest stall, garbage collection taken out; ``phases``: the host's
    work it fell in; ``with_gc_s``: the same with the collections left in; ``max_gap_s``:
    the largest interval, less the 5 ms (no CPU bound); ``max_gc_s``: the longest
    collection; ``beats``; ``kernels``: whether the compiled scanner got ready."""
    from opd_stream.scanner import _loader

    stalls, with_gc, gap = [], 0.0, 0.0
    for start, end, cpu0, cpu1, loop_cpu, loop_waited in _beats:
        wall, cpu = end - start, cpu1 - cpu0
        collected = _gc_within(start, end)
        held = min(wall - loop_waited, cpu) - SLEEP_S
        stalls.append((held - collected, start, end, loop_cpu))
        with_gc = max(with_gc, held)
        gap = max(gap, wall - SLEEP_S)
    stalls.sort(reverse=True)
    worst, start, end, loop_cpu = stalls[0] if stalls else (0.0, 0.0, 0.0, 0.0)
    return {
        "stall_s": worst,
        "phases": _phases_of(start, end),
        "loop_cpu_s": loop_cpu,
        "next_s": [(round(s, 4), _phases_of(a, b), round(c, 4)) for s, a, b, c in stalls[1:5]],
        "with_gc_s": with_gc,
        "max_gap_s": gap,
        "max_gc_s": max((b - a for a, b in _collections), default=0.0),
        "long_gcs": [(round(b - a, 4), _phases_of(a, b)) for a, b in _collections if b - a > 0.02],
        "beats": len(_beats),
        "kernels": _loader.available(),
        "torch_loaded": "torch" in sys.modules,
    }


async def _torch_only() -> None:
    from opd_stream._loading import import_off_loop

    _phase("enter")
    await import_off_loop(("torch",))
    _phase("after")
    await anyio.sleep(0.3)


async def main(teacher: str, student: str, xtok: dict[str, Any] | None) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_heartbeat)
        await anyio.sleep(0.05)
        if teacher == "-":
            await _torch_only()
        elif xtok is None:
            await _use(teacher, student)
        else:
            await _use_xtok(teacher, xtok)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    backend, teacher_url = sys.argv[1:3]
    xtok = None
    if sys.argv[3] == "--torch-floor":
        student_url = ""
    elif sys.argv[3] == "--xtok":
        student_url = ""
        with open(sys.argv[4], encoding="utf-8") as f:
            xtok = json.load(f)
    else:
        student_url = sys.argv[3]
    gc.callbacks.append(_on_gc)
    anyio.run(main, teacher_url, student_url, xtok, backend=backend)
    print(json.dumps(report()))

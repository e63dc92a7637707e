"""Where the work runs: ``kl_device`` and ``decode_threads`` resolved to concrete values.

``decode_threads`` is resolved when an :class:`~opd_stream.OPDStream` is built;
``kl_device`` then too, in the caller's thread, when it is ``cpu`` or CUDA is initialized
already, else when the stream loads (see ``_kl_device_now`` in :mod:`opd_stream._stream`).
"""

from __future__ import annotations

import os
import re
from typing import Final, Protocol

from .._errors import ConfigError

__all__ = ("KL_DEVICE_PATTERN", "resolve_decode_threads", "resolve_kl_device")

KL_DEVICE_PATTERN: Final = re.compile(r"auto|cpu|cuda|cuda:\d+")
"""Accepted spellings of ``kl_device`` (matched in full, after lower-casing)."""

_AUTO_DECODE_THREADS_MAX: Final = 8


class _DeviceSettings(Protocol):
    @property
    def kl_device(self) -> str: ...


class _ThreadSettings(Protocol):
    @property
    def decode_threads(self) -> int: ...


def resolve_decode_threads(cfg: _ThreadSettings) -> int:
    """``decode_threads``, or for 0 (auto) the CPUs this process may run on, at most 8.

    Eight threads parse up to eight answers at once, each ~0.3-0.7 GB/s with the compiled
    scanner (~1.5-3 ns per byte; ``docs/performance.md``, "Threads for parsing"); more
    rarely pays, as the event loop and the KL stage need cores too.
    """
    if cfg.decode_threads > 0:
        return cfg.decode_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_AUTO_DECODE_THREADS_MAX, cpus))


def resolve_kl_device(cfg: _DeviceSettings | str) -> str:
    """Resolve ``kl_device`` to a concrete torch device string, in the calling thread.

    ``auto`` gives the calling thread's current CUDA device, ``"cuda:N"`` with ``N =
    torch.cuda.current_device()``, when CUDA is available, else ``"cpu"``; ``cuda`` gives
    the same ``"cuda:N"``; ``cuda:N`` is returned as it is once checked; ``cpu`` is always
    ``"cpu"``. torch's current device is a per-thread setting (a new thread starts on device
    0), and the KL runs in a worker thread: a bare ``"cuda"`` there would mean GPU 0 on every
    rank of a job whose ranks called ``torch.cuda.set_device(local_rank)``. So
    :class:`~opd_stream.OPDStream` calls this in its constructor, in the caller's thread,
    once CUDA is initialized (a thread can have chosen a device only then; before, every
    thread's current device is the same, and the stream calls this as it loads, in a
    worker thread), and the KL thread uses the explicit index. torch is imported only
    when CUDA has to be probed.

    Args:
        cfg: a configuration (a :class:`~opd_stream.StreamConfig`), or a ``kl_device`` string.

    Returns:
        ``"cpu"`` or ``"cuda:N"``.

    Raises:
        ConfigError: an invalid spelling; CUDA asked for but unavailable; ``cuda:N`` with
            N not below the number of visible CUDA devices.
    """
    device = (cfg if isinstance(cfg, str) else cfg.kl_device).strip().lower()
    if not KL_DEVICE_PATTERN.fullmatch(device):
        raise ConfigError(f"kl_device: must be auto, cpu, cuda or cuda:N; got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    available = bool(torch.cuda.is_available())
    if device == "auto" and not available:
        return "cpu"
    if not available:
        raise ConfigError(f"kl_device: {device!r} was requested but CUDA is not available")
    if device in ("auto", "cuda"):
        return f"cuda:{int(torch.cuda.current_device())}"
    index = int(device.removeprefix("cuda:"))
    count = int(torch.cuda.device_count())
    if index >= count:
        raise ConfigError(
            f"kl_device: {device!r} was requested but only {count} CUDA device(s) are visible"
        )
    return device

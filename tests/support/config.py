"""The one ``StreamConfig`` builder of the tests.

:func:`stream_config` is ``StreamConfig.from_env({}, teachers=..., kl_device="cpu", **fields)``:
no ``OPD_STREAM_*`` variable of the test process is read, the KL runs on the CPU, and every
keyword (``kl_device`` and ``teachers`` included) overrides. A test module binds its own
defaults once with :func:`functools.partial`, e.g.
``_cfg = partial(stream_config, T, **FAST_BACKOFF)``; a call's keywords win over the bound
ones. :data:`FAST_BACKOFF` is the millisecond backoff of tests that retry against local
servers; :func:`one_pool` is the teacher ``default`` served by several replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opd_stream import StreamConfig

__all__ = ("FAST_BACKOFF", "one_pool", "stream_config")

FAST_BACKOFF: dict[str, Any] = {"backoff_initial_s": 0.001, "backoff_max_s": 0.002}
"""Retries within milliseconds (the servers are local)."""


def stream_config(teachers: Any, /, **fields: Any) -> StreamConfig:
    """``StreamConfig.from_env({})`` of ``teachers`` on the CPU, ``fields`` overriding."""
    return StreamConfig.from_env({}, **({"teachers": teachers, "kl_device": "cpu"} | fields))


def one_pool(urls: Iterable[str]) -> dict[str, list[str]]:
    """Teacher ``default`` served by the replicas ``urls`` (one balanced pool)."""
    return {"default": list(urls)}

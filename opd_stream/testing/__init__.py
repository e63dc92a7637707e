"""Testing helpers for users of opd_stream (see :mod:`opd_stream.testing.mock_sglang` and
:mod:`opd_stream.testing.mock_vllm`).

:func:`capture_events` collects the library's log events (the ``"opd_stream"`` stdlib
logger) while a block runs.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

from __future__ import annotations

from .._logging import capture_events

__all__: tuple[str, ...] = ("capture_events",)

"""Testing helpers for users of opd_stream (see :mod:`opd_stream.testing.mock_sglang`).

:func:`capture_events` collects the library's log events (the ``"opd_stream"`` stdlib
logger) while a block runs.

``_process`` stops the server subprocesses these tools start (mock servers, sglang-router).
"""

from __future__ import annotations

from .._logging import capture_events

__all__: tuple[str, ...] = ("capture_events",)

"""Testing helpers for users of opd_stream (see :mod:`opd_stream.testing.mock_sglang` and
:mod:`opd_stream.testing.mock_vllm`).

:func:`capture_events` collects the library's log events (the ``"opd_stream"`` stdlib
logger) while a block runs.

``_process`` stops the server subprocesses these tools start (mock servers, sglang-router).
``_trl_source`` loads TRL's own client and trainer from the source the set-up step unpacks
(for the tests and ``bench/trl_teacher.py``, from a source checkout).
"""

from __future__ import annotations

from .._logging import capture_events

__all__: tuple[str, ...] = ("capture_events",)

"""Testing helpers for users of opd_stream (see :mod:`opd_stream.testing.mock_sglang`)."""

from __future__ import annotations

__all__: tuple[str, ...] = ()

"""TRL drop-in: the server teacher of TRL 1.16.0's distillation trainers, through opd_stream.

:class:`TeacherClient` has TRL's ``get_sequence_logprobs(sequences, prompt_lengths,
top_logprobs, temperature)`` and gives the same lists, value for value, computed through
one :class:`~opd_stream.OPDStream` per ``top_logprobs`` value on an event loop of its own,
on any teacher engine. The swap: ``trainer.teacher_client = TeacherClient(url)``.

* ``_client``: :class:`TeacherClient`, :class:`SequenceScoringError`.
* ``_rows``: TRL's contract, sans IO (argument checks, one sequence's result lists).
* ``_loop``: the client's event loop in a thread of its own.
"""

from __future__ import annotations

from ._client import SequenceScoringError, TeacherClient

__all__ = ("SequenceScoringError", "TeacherClient")

"""TRL drop-in: the server teacher of TRL 1.16.0's distillation trainers, through opd_stream.

TRL's ``ServerDistillationTrainer`` (and the experimental SDPO, SDFT and IW-OPD trainers)
call ``self.teacher_client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs,
temperature)`` once per training step, synchronously. :class:`TeacherClient` has that
method with TRL's signature and gives the same lists, value for value (ranks, padding,
vLLM's ``-9999.0``), computed through one :class:`~opd_stream.OPDStream` per
``top_logprobs`` value on an event loop of its own: each sequence is a sample, scored from
its prompt's end only, with the stream's bounds, deadlines, retries and replicas, on any
teacher engine (vLLM scale-out, vLLM completions, SGLang). The swap, once the trainer is
built::

    from opd_stream.integrations.trl import TeacherClient
    trainer.teacher_client = TeacherClient(args.teacher_model_server_url)

* ``_client``: :class:`TeacherClient`, :class:`SequenceScoringError`.
* ``_rows``: TRL's contract, sans IO (argument checks, one sequence's result lists).
* ``_loop``: the client's event loop in a thread of its own.
"""

from __future__ import annotations

from ._client import SequenceScoringError, TeacherClient

__all__ = ("SequenceScoringError", "TeacherClient")

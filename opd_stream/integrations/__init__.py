"""Drop-in adapters for RL frameworks.

* :mod:`opd_stream.integrations.miles`: Miles / slime ``reward_func`` and
  ``post_process_rewards`` (the ``--use-opd --opd-type sglang`` path), streaming through
  one shared :class:`~opd_stream.OPDStream`.
* :mod:`opd_stream.integrations.verl`: teacher logprobs from SGLang answers in verl's
  vLLM ``prompt_logprobs`` contract.
* :mod:`opd_stream.integrations.trl`: TRL's server teacher (``get_sequence_logprobs``),
  synchronous, on streams of its own event-loop thread.

The adapters are imported explicitly (``from opd_stream.integrations import miles``); this
package imports neither.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()

"""Teachers with another tokenizer: every token's bytes, the alignment of two tokenizations,
chat templates, a faster exact encoder, and what the pipeline does for such a teacher.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_vocab``: :class:`Vocab`: a tokenizer as alignment sees it
* ``_encoder``: an exact tiktoken encoder rebuilt from ``tokenizer.json``
* ``_align``: one response aligned, and the signal per span
* ``_chat``: a teacher's chat template
* ``_worker``: a tokenizer loaded and run in a process of its own (what a stream uses)
* ``_process``: that process, the host's end (:class:`~opd_stream.xtok._process.EncoderProcess`)
* ``_tokenizers``: a stream's tokenizers (:class:`~opd_stream.xtok._tokenizers.CrossTokenizers`)
  and what the fetch stage asks of them: the teacher's request input, its top-k candidates
"""

__all__: tuple[str, ...] = ()

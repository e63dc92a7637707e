"""Teachers with another tokenizer: every token's bytes, the alignment of two tokenizations,
chat templates, a faster exact encoder, and what the pipeline does for such a teacher.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()

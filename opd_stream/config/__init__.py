"""The settings: every knob declared once, read from keywords or ``OPD_STREAM_*``
variables, and checked once.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()

"""The ``opd-stream`` command. Nothing here runs inside a host's process: the library
never imports this room.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()

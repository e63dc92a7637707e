"""The running async library, named once in each of the stream's own tasks.

Each anyio call that reaches the backend (a checkpoint, a channel's send or receive, an
``Event``, a ``CancelScope``) first asks which library runs it. Where sniffio is installed
(trio and httpx bring it), anyio asks sniffio, which finds asyncio only by sniffing:
~0.6 us a call, ~0.13 once its context variable names the library (~19 calls a sample).

:func:`name_async_library` sets that variable in the calling task's own context (each
task runs in a copy of its spawner's): the tasks it spawns see it, the host's tasks do not.
It names what sniffio reports, and does nothing without sniffio (anyio then asks asyncio
directly) or where the library is named already (trio names itself).
"""

from __future__ import annotations

from types import ModuleType

sniffio: ModuleType | None
try:
    import sniffio
except ModuleNotFoundError:  # pragma: no cover - anyio then needs no sniffing
    sniffio = None

__all__ = ("name_async_library",)


def name_async_library() -> None:
    """Name the running async library in this task's context (see the module doc)."""
    if sniffio is None or sniffio.thread_local.name is not None:
        return
    cvar = sniffio.current_async_library_cvar
    if cvar.get() is None:
        cvar.set(sniffio.current_async_library())

"""``gc_paused()``: pause Python's cyclic GC around one allocation-heavy step."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ("gc_paused",)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC for the block (re-enabled after, if it was on).

    Decoding an answer, building a payload or converting a rollout's top-k rows allocates
    one Python object per entry; with the default thresholds that triggers many
    collections, and in a process that holds many live objects (rollouts' Python top-k
    rows, other answers) each older-generation pass walks all of them: measured 2-5x on
    such steps (``perf-facts.md`` §2). Nothing built there is cyclic, so nothing is lost;
    the allocations are counted and collected at the next regular pass.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

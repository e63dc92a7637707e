"""Signal faults of a mock server: answers that arrive fine but carry other numbers.

One :class:`SignalState` per server (the aiohttp mock's ``/generate`` and the in-process
server share it): which ``meta_info.weight_version`` the next item reports (a weight update
at a set point of a run), and how far an item's logprobs move (a replica off by a set
amount; warm answers that drift from cold ones).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from ._prefix_cache import CacheItem

__all__ = ("SEEN_ITEMS", "SignalState")

SEEN_ITEMS = 4096
"""Items a server remembers to tell a warm (repeated) item from a cold one."""


class SignalState:
    """The per-server state behind ``weight_versions``, ``logprob_offset``, ``warm_drift``."""

    def __init__(self) -> None:
        self._answered = 0
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def weight_version(self, default: str, versions: Sequence[str]) -> str:
        """The version the next item reports: ``versions[min(n, len - 1)]`` for the
        server's ``n``-th item, or ``default`` when ``versions`` is empty."""
        n = self._answered
        self._answered += 1
        if not versions:
            return default
        return versions[min(n, len(versions) - 1)]

    def shift(self, item: CacheItem, offset: float, warm_drift: float) -> float:
        """What ``item``'s logprobs move by: ``offset``, plus ``warm_drift`` when the same
        ``input_ids`` under the same ``cache_salt`` were answered before."""
        if not warm_drift:
            return offset
        h = hashlib.blake2b(digest_size=16)  # a digest: long inputs are not kept
        h.update((item.cache_salt or "").encode() + b"\0")
        h.update(item.input_ids.tobytes())
        key = h.digest()
        if key in self._seen:
            self._seen.move_to_end(key)
            return offset + warm_drift
        self._seen[key] = None
        if len(self._seen) > SEEN_ITEMS:
            self._seen.popitem(last=False)
        return offset

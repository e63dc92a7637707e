"""The mock's prefix cache: what ``meta_info.cached_tokens`` reports, and how much a replica
computes, as SGLang's radix cache would have it.

Per replica, in pages of ``--page-size`` tokens: a request reuses the longest cached prefix
of whole pages (at least one input token is computed; at most ``logprob_start_len`` tokens
are reused when input logprobs are returned); afterwards its whole input is cached; over
capacity, the least recently used leaves go first; different ``cache_salt`` share nothing.
:class:`PrefixCache`: one node per page, named by a hash chained over the pages before it,
in an LRU order where a page is more recent than its descendants. Sans-IO; a 64-bit hash
collision is ignored, as a mock may.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ("CacheItem", "PrefixCache", "reusable_limit")


class CacheItem(Protocol):
    """What the prefix cache, the compute model and the signal faults read of one request
    item (an SGLang ``/generate`` item, or a vLLM mock's request)."""

    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...

    @property
    def return_logprob(self) -> bool: ...

    @property
    def logprob_start_len(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def max_new_tokens(self) -> int: ...


def reusable_limit(length: int, return_logprob: bool, logprob_start_len: int) -> int:
    """The longest prefix SGLang may reuse for an input of ``length`` tokens: all but the
    last token, and no more than ``logprob_start_len`` when input logprobs are returned."""
    limit = max(length - 1, 0)
    if return_logprob:
        limit = min(limit, max(logprob_start_len, 0))
    return limit


class PrefixCache:
    """A per-replica prefix cache of ``capacity_tokens`` tokens in pages of ``page_size``.

    Args:
        capacity_tokens: tokens the cache holds (rounded down to whole pages; > 0).
        page_size: SGLang's ``--page-size``: matches and evictions are whole pages.
    """

    def __init__(self, capacity_tokens: int, page_size: int = 1) -> None:
        if capacity_tokens <= 0 or page_size <= 0:
            raise ValueError("capacity_tokens and page_size must be > 0")
        self.page_size = page_size
        self.capacity_pages = capacity_tokens // page_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted_tokens = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens held now."""
        return len(self._lru) * self.page_size

    def _chain(self, tokens: npt.NDArray[np.int64], salt: str | None) -> list[int]:
        """The chained hash of each whole page of ``tokens``."""
        p = self.page_size
        data = np.ascontiguousarray(tokens, dtype="<i8")
        h = hash(("opd-mock-prefix", salt))
        out = []
        for start in range(0, len(data) - p + 1, p):
            h = hash((h, data[start : start + p].tobytes()))
            out.append(h)
        return out

    def match(self, tokens: npt.NDArray[np.int64], limit: int, salt: str | None = None) -> int:
        """Tokens of ``tokens[:limit]`` served from the cache (whole pages); the matched
        pages become the most recently used."""
        hits: list[int] = []
        for h in self._chain(tokens[:limit], salt):
            if h not in self._lru:
                break
            hits.append(h)
        for h in reversed(hits):  # leaf first: an ancestor stays more recent
            self._lru.move_to_end(h)
        return len(hits) * self.page_size

    def insert(self, tokens: npt.NDArray[np.int64], salt: str | None = None) -> None:
        """``tokens`` (whole pages) were computed: cache them, evicting the least recently
        used pages beyond capacity."""
        chain = self._chain(tokens, salt)
        for h in reversed(chain):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_pages:
            self._lru.popitem(last=False)
            self.evicted_tokens += self.page_size

    def clear(self) -> None:
        """Forget everything (``/flush_cache``)."""
        self._lru.clear()

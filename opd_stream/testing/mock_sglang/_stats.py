"""Counters a mock server keeps so tests can check what a client saw."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ("MockStats",)


class MockStats(msgspec.Struct, kw_only=True):
    """Mutable counters of one mock server (``GET /mock/stats`` serves :meth:`snapshot`).

    Attributes:
        requests: HTTP requests received (every endpoint).
        generate_requests: ``/generate`` requests received (any outcome).
        generate_items: sequences in ``/generate`` requests that were answered normally.
        by_endpoint: requests per route path.
        by_status: answers per HTTP status (as a string key); hangs and resets have none.
        bytes_received: request body bytes read.
        bytes_sent: response body bytes written (for faults: what was actually written).
        faults: injected faults per kind (see ``FAULT_KINDS``).
        disconnects: requests whose client went away before the answer was complete.
        in_flight: ``/generate`` requests currently inside the handler.
        max_in_flight: the maximum of ``in_flight`` seen.
        running: requests currently holding a capacity slot.
        queued: requests currently waiting for a slot.
        rejected_queue_full: 503 "The request queue is full." answers.
        rejected_invalid: 4xx answers to invalid requests (all three error shapes).
        auth_failures: 401 answers.
        aborted: 200-abort answers, from the fault or from ``/abort_request``.
        prompt_tokens: input tokens of the ``/generate`` items answered normally.
        cached_tokens: those served from the prefix cache (their ``cached_tokens``).
        computed_tokens: tokens the replica computed: input not served from the prefix
            cache, plus ``max_new_tokens``.
        compute_s: seconds of simulated compute (``compute_*`` options).
        salted_items: answered items that carried a ``cache_salt``.
        cache_salts: the last 1024 salts received (one per salted item, in order).
    """

    requests: int = 0
    generate_requests: int = 0
    generate_items: int = 0
    by_endpoint: dict[str, int] = msgspec.field(default_factory=dict)
    by_status: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_received: int = 0
    bytes_sent: int = 0
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    disconnects: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    running: int = 0
    queued: int = 0
    rejected_queue_full: int = 0
    rejected_invalid: int = 0
    auth_failures: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    compute_s: float = 0.0
    salted_items: int = 0
    cache_salts: list[str] = msgspec.field(default_factory=list)

    def record_salt(self, salt: str) -> None:
        """Record one item's ``cache_salt`` (the last 1024 kept)."""
        self.salted_items += 1
        self.cache_salts.append(salt)
        if len(self.cache_salts) > 1024:
            del self.cache_salts[0]

    def count_fault(self, kind: str) -> None:
        """Record one injected fault of ``kind``."""
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def count_status(self, status: int) -> None:
        """Record one answer with HTTP ``status``."""
        key = str(status)
        self.by_status[key] = self.by_status.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready deep copy of every counter."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def reset(self) -> None:
        """Zero every counter except the live gauges (in_flight, running, queued)."""
        keep = (self.in_flight, self.running, self.queued)
        for name in self.__struct_fields__:
            value = getattr(self, name)
            empty: Any = (
                {} if isinstance(value, dict) else [] if isinstance(value, list) else type(value)(0)
            )
            setattr(self, name, empty)
        self.in_flight, self.running, self.queued = keep
        self.max_in_flight = self.in_flight

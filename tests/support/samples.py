"""Sample builders shared by several test modules."""

from __future__ import annotations

import numpy as np

from opd_stream import Sample

__all__ = ("prefix_groups",)


def prefix_groups(
    groups: int, per_group: int, prompt: int, response: int, *, seed: int
) -> list[Sample]:
    """``groups`` groups of ``per_group`` samples sharing one ``prompt``-token head (a group's
    samples share a prefix; ``sample_id`` is the group), each with its own response."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        head = rng.integers(0, 3000, prompt).tolist()
        for _ in range(per_group):
            tail = rng.integers(0, 3000, response).tolist()
            out.append(Sample(head + tail, response, sample_id=g))
    return out

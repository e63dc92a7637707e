"""Runtime options of a mock SGLang server: model knobs, protocol mode, latency, capacity, faults.

Every field is also a CLI flag (``--field-name VALUE``, generated from this Struct; the
command's default ``--vocab-size`` is :data:`CLI_VOCAB_SIZE`) and can be
changed at runtime, programmatically (``MockServer.set_options``) or over HTTP
(``POST /mock/options`` with a JSON object of fields).
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

__all__ = ("CLI_VOCAB_SIZE", "FAULT_KINDS", "FaultKind", "MockOptions")

CLI_VOCAB_SIZE = 248_320
"""The command's default ``--vocab-size`` (``python -m opd_stream.testing.mock_sglang``): the
largest vocabulary the README names (Qwen 3.5's 248,070 ids) rounded up to a multiple of
256, so that the server takes the ids of any of them. :attr:`MockOptions.vocab_size`
keeps Qwen 2.5 / 3's 151,936 for Python use."""

FaultKind = Literal[
    "http_500",
    "http_503",
    "http_429",
    "abort",
    "hang",
    "reset",
    "truncated",
    "malformed",
    "misaligned",
    "missing_rows",
    "oversized",
    "slow_drip",
]

#: Fault kinds in the order their rates are laid out on ``[0, 1)`` (a request hits at most one).
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)


class MockOptions(msgspec.Struct, kw_only=True, frozen=True):
    """Options of one mock server (replace with :func:`msgspec.structs.replace`).

    Model (changing one rebuilds the model):
        vocab_size: full vocabulary size.
        head_size: explicit candidates per position (see ``MockModel``).
        divergence: role-noise weight in ``[0, 1]`` (teacher/student top-k overlap knob).
        masked_ids: ids with logprob ``-inf`` (``None``: the two largest ids).

    Protocol:
        per_position: ``"patched"`` validates and answers ``token_ids_logprob_positions``;
            ``"unpatched"`` ignores it silently (like every SGLang release).
        api_key: when set, every endpoint but ``/health*``, ``/ready``, ``/metrics`` and
            ``/mock/*`` needs ``Authorization: Bearer <api_key>`` (else 401).
        weight_version: ``meta_info.weight_version``.
        weight_versions: when not empty, item ``n`` answered (counted over the server's
            life, every request) reports ``weight_versions[min(n, len - 1)]`` instead: a
            weight update at a set point of a run (``("v1", "v2")``: the first item v1, the
            rest v2).
        context_length: longer inputs (or input + max_new_tokens) are rejected with 400.
        info_endpoints: serve ``/model_info`` and ``/server_info`` (else 404).
        startup_delay_s: ``/health`` and ``/generate`` answer 503 for this long after start.

    Latency (seconds) of each ``/generate``: ``latency_fixed_s + latency_per_token_s * tokens +
    min(latency_tail_cap_s, latency_tail_scale_s * (Pareto(latency_tail_alpha) - 1))``, where
    ``tokens`` counts input and generated tokens of all items.

    Capacity:
        max_running: requests served concurrently (0: unlimited).
        max_queued: requests waiting for a slot beyond which 503 "The request queue is full."
            is answered (-1: unlimited).

    Signal faults (a replica that answers, but not what its peers answer):
        logprob_offset: added to every logprob of every answer (a replica off by a set
            amount; keep it <= 0, clients reject positive logprobs).
        warm_drift: added to every logprob of an item the server has answered before (the
            same ``input_ids`` and ``cache_salt``; the last 4096 remembered): warm answers
            that move, like a prefix-cache reuse that changes the numbers.
    Prefix cache and compute (a GPU-bound fleet simulated on CPU):
        prefix_cache_tokens: > 0 gives the replica a prefix cache of this many tokens
            (SGLang's radix cache: LRU, whole pages, at most ``logprob_start_len`` reused by
            a logprob request; see ``_prefix_cache``), which sets ``meta_info.cached_tokens``.
            0: off (``cached_tokens`` is 0).
        prefix_cache_page: SGLang's ``--page-size``: a prefix is reused in whole pages.
        compute_fixed_s / compute_per_token_s: > 0 makes the replica one GPU: it computes
            one ``/generate`` at a time (after the latency above), for ``compute_fixed_s +
            compute_per_token_s * tokens computed`` (input tokens not served from the
            prefix cache, plus ``max_new_tokens``). 0: no compute time. An answer from the
            replay cache (below) skips both.

    Benchmarks:
        replay_cache_bytes: > 0 keeps the bodies of successful scoring answers (every item
            with ``max_new_tokens == 0``, not streamed, no fault drawn), keyed by the exact
            request bytes, up to this many bytes (oldest dropped first); a repeated request
            is answered from the cache after the usual latency, so a benchmark can take the
            (Python) mock's CPU out of what it measures. Answers then repeat ``meta_info.id``
            and ``e2e_latency``. 0: off.

    Faults (``fault_*``: probability per ``/generate`` request; at most one per request,
    drawn from a RNG seeded with ``fault_seed``, or the server seed when ``None``):
        http_500 / http_503 / http_429: an error answer in the ErrorResponse shape.
        abort: HTTP 200 whose ``finish_reason`` is ``{"type": "abort", ...}``.
        hang: never answers until the client disconnects (counted in ``disconnects``).
        reset: sends part of the body, then resets the connection (RST).
        truncated: announces the full Content-Length, sends part, closes cleanly (FIN).
        malformed: HTTP 200 whose body is invalid JSON (correct Content-Length).
        misaligned: ``input_token_logprobs`` carries wrong token ids (shifted by one row).
        missing_rows: every ``input_*`` list has one row fewer.
        oversized: the body is padded with an unknown field of ``oversized_bytes`` bytes.
        slow_drip: the body is sent in ``drip_chunk_bytes`` chunks, ``drip_delay_s`` apart.
    """

    vocab_size: int = 151936
    head_size: int = 128
    divergence: float = 0.35
    masked_ids: tuple[int, ...] | None = None

    per_position: Literal["patched", "unpatched"] = "patched"
    api_key: str | None = None
    weight_version: str = "default"
    weight_versions: tuple[str, ...] = ()
    context_length: int = 131072
    info_endpoints: bool = True
    startup_delay_s: float = 0.0

    latency_fixed_s: float = 0.0
    latency_per_token_s: float = 0.0
    latency_tail_scale_s: float = 0.0
    latency_tail_alpha: float = 1.5
    latency_tail_cap_s: float = 5.0

    max_running: int = 0
    max_queued: int = -1

    prefix_cache_tokens: int = 0
    prefix_cache_page: int = 1
    compute_fixed_s: float = 0.0
    compute_per_token_s: float = 0.0
    logprob_offset: float = 0.0
    warm_drift: float = 0.0

    replay_cache_bytes: int = 0

    fault_seed: int | None = None
    fault_http_500: float = 0.0
    fault_http_503: float = 0.0
    fault_http_429: float = 0.0
    fault_abort: float = 0.0
    fault_hang: float = 0.0
    fault_reset: float = 0.0
    fault_truncated: float = 0.0
    fault_malformed: float = 0.0
    fault_misaligned: float = 0.0
    fault_missing_rows: float = 0.0
    fault_oversized: float = 0.0
    fault_slow_drip: float = 0.0
    oversized_bytes: int = 64 * 1024 * 1024
    drip_chunk_bytes: int = 4096
    drip_delay_s: float = 0.005

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            rate = getattr(self, f"fault_{kind}")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault_{kind} must be in [0, 1]")
        if self.max_running < 0:
            raise ValueError("max_running must be >= 0 (0: unlimited)")
        if self.prefix_cache_tokens < 0 or self.prefix_cache_page < 1:
            raise ValueError("prefix_cache_tokens must be >= 0 and prefix_cache_page >= 1")
        if self.compute_fixed_s < 0 or self.compute_per_token_s < 0:
            raise ValueError("compute_fixed_s and compute_per_token_s must be >= 0")
        if self.replay_cache_bytes < 0:
            raise ValueError("replay_cache_bytes must be >= 0 (0: off)")
        if self.max_queued < -1:
            raise ValueError("max_queued must be >= -1 (-1: unlimited)")
        if self.per_position not in ("patched", "unpatched"):
            raise ValueError("per_position must be 'patched' or 'unpatched'")

    def fault_rates(self) -> dict[FaultKind, float]:
        """The rate of every fault kind, in :data:`FAULT_KINDS` order."""
        return {kind: float(getattr(self, f"fault_{kind}")) for kind in FAULT_KINDS}

"""Options of a mock vLLM server: the SGLang mock's :class:`MockOptions` (model, latency,
capacity, prefix cache, compute model, faults, weight versions) plus vLLM's own server flags.

``context_length`` is vLLM's ``--max-model-len``; ``prefix_cache_page`` its ``--block-size``.
"""

from __future__ import annotations

from ..mock_sglang import MockOptions

__all__ = ("VllmMockOptions",)


class VllmMockOptions(MockOptions, kw_only=True, frozen=True):
    """:class:`MockOptions` plus vLLM 0.34.0 server flags.

    Attributes:
        max_logprobs: ``--max-logprobs`` (vLLM's default 20; -1: the vocabulary size): the
            most ids per row of ``prompt_logprob_token_ids``, and the most ``prompt_logprobs``
            / ``logprobs`` a request may ask for (more: vLLM's 400).
        prompt_tokens_details: ``--enable-prompt-tokens-details`` (on by default in the mock,
            off in vLLM): answers carry ``usage.prompt_tokens_details.cached_tokens``.
    """

    max_logprobs: int = 20
    prompt_tokens_details: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_logprobs < -1:
            raise ValueError("max_logprobs must be >= -1 (-1: the vocabulary size)")

    def effective_max_logprobs(self) -> int:
        """``max_logprobs`` with -1 resolved to the vocabulary size (as vLLM does)."""
        return self.vocab_size if self.max_logprobs == -1 else self.max_logprobs

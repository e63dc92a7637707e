"""One sample's requests: which logical requests it needs, each sent with its deadline,
retried, hedged and checked, until the sample's logprobs are fetched.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()

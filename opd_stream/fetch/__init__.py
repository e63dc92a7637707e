"""One sample's requests: which logical requests it needs, each sent with its deadline,
retried, hedged and checked, until the sample's logprobs are fetched.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_fetcher``: :class:`SampleFetcher`, a sample's request plan carried out
* ``_attempts``: one HTTP attempt at a time: a replica chosen, hedged when slow, the answer read
* ``_mixture``: an ensemble teacher's answer, mixed from its members' (sans-IO)
* ``_retry``: :class:`RetryPolicy`, exponential backoff with full jitter
* ``_threads``: which step of an attempt runs in a worker thread, and its CPU time
"""

__all__: tuple[str, ...] = ()

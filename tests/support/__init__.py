"""Helpers shared by the test modules (no test imports another test module, nor ``bench``).

pytest puts ``tests/`` on ``sys.path`` (rootdir-relative "prepend" import mode), so a test
imports these as ``from support.<module> import ...``:

* ``config``: :func:`~support.config.stream_config`, the one ``StreamConfig`` builder;
* ``cli``: ``opd-stream`` in-process and as a subprocess, and the isolated environment;
* ``kl_reference``: the independent float64 per-position KL reference;
* ``pipeline_reference``: expected pipeline results from the mock's closed-form model;
* ``kl_padding``: per-sample arrays padded into one batch (padding must be ignored);
* ``kl_rows``: candidate rows for the tail and divergence tests;
* ``sglang_api``: SGLang's contract module (by path) and a tiny JSON client;
* ``fake_generate``: a deterministic fake ``/generate`` scorer for the wire tests;
* ``fuzz_corpus``: the answer and request corpora the decoders are fuzzed with;
* ``threaded_mock``: the mock servers in a thread, for tests on any anyio backend;
* ``routers``: sglang-router / smg launched on free ports in front of mock workers;
* ``xtok_vocabs``: small and real tokenizers for the cross-tokenizer tests.
"""

"""Helpers shared by the test modules (no test imports another test module, nor ``bench``).

The tests live in one folder per room (``tests/kl/``, ``tests/wire/`` ...) and
``tests/system/``, each a package (an ``__init__.py``; ``tests/`` itself has none), so pytest's
default ``prepend`` import mode puts ``tests/`` on ``sys.path`` (a test module is ``kl.test_kl``:
same-named files in two folders do not clash), and a test imports these as
``from support.<module> import ...``:

* ``config``: :func:`~support.config.stream_config`, the one ``StreamConfig`` builder;
* ``cli``: ``opd-stream`` in-process and ``python -m`` (``bench`` included) as a subprocess,
  and the isolated environment of ``conftest.cli_env``;
* ``kl_reference``: the independent float64 per-position KL reference;
* ``pipeline_reference``: expected pipeline results from the mock's closed-form model, and
  ``assert_all_scored`` (every result scored and equal to them);
* ``kl_padding``: per-sample arrays padded into one batch (padding must be ignored);
* ``kl_rows``: candidate rows for the tail and divergence tests;
* ``sglang_api``: SGLang's contract module (by path) and a tiny JSON client;
* ``fake_generate``: a deterministic fake ``/generate`` scorer for the wire tests;
* ``fuzz_corpus``: the answer and request corpora the decoders are fuzzed with;
* ``threaded_mock``: the mock servers in a thread, for tests on any anyio backend;
* ``routers``: sglang-router / smg launched on free ports in front of mock workers;
* ``samples``: sample builders several modules use (groups sharing a prefix);
* ``xtok_vocabs``: small and real tokenizers for the cross-tokenizer tests;
* ``fault_matrix``: the fault matrix runner (``system/test_fault_matrix.py`` asserts on its
  rows, ``bench/reliability.py`` reads it by path and renders them).
"""

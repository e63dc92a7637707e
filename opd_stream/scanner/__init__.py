"""The compiled kernels (numba, ``nogil``): the answer scanner, the payload id writer, the
student top-k checks and the rollout-rows reader, with their loader. Nothing here knows the
wire's schema: :mod:`opd_stream.wire` hands the scanner the fields it parses.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_loader``: made ready once per process in a background thread; :func:`compiled` gives ``None``
until then
* ``_calls``: the kernels as typed Python calls (the :class:`~opd_stream.scanner._types.Kernels`
facade)
* ``_types``: what the other modules share: the scan's result and schema, the kernels' Protocol
* ``_scan``: the scoring-answer scanner
* ``_ids``: the per-position id rows of a request payload, written as JSON
* ``_checks``: a student top-k's checks, and a request's ids checked
* ``_rows``: a rollout's Python top-k rows (msgpack) read into arrays
* ``_shared``: what every kernel file shares: decorators, byte constants, the cache digest
* ``_warm``: the compiling process: fills numba's cache, one at a time
"""

__all__: tuple[str, ...] = ()

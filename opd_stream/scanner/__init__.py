"""The compiled kernels (numba, ``nogil``): the answer scanner, the payload id writer, the
student top-k checks and the rollout-rows reader, with their loader. Nothing here knows the
wire's schema: :mod:`opd_stream.wire` hands the scanner the fields it parses.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()

"""Whether this interpreter lays out its lists, tuples, floats and ints as
:mod:`opd_stream.scanner._objects` reads them, and the layout array it is given.

Known: CPython 3.11 to 3.14 with the GIL (a free-threaded build's objects have another
header, and its lists may change under a reader), 64-bit, little-endian, an object header
of 16 bytes (no debug build's extra links), 30-bit digits. Anything else (PyPy, a newer
CPython, an odd build) gets ``None``: the rows are written as msgpack and read from it,
as before. :func:`opd_stream.scanner._calls.warm` also reads known rows and compares before
the first use (:func:`opd_stream.scanner._calls._check_layout`).
"""

from __future__ import annotations

import sys
import sysconfig

import numpy as np
import numpy.typing as npt

__all__ = ("known_layout",)

#: The CPython versions whose layout is known here (the tuple's items moved in 3.14, after
#: its cached hash: :attr:`tuple.__basicsize__` says where they start).
_VERSIONS = ((3, 11), (3, 12), (3, 13), (3, 14))


def known_layout() -> npt.NDArray[np.int64] | None:
    """The layout array (``_objects.L_*`` fields) on an interpreter whose objects are laid
    out as the reader expects, else ``None``."""
    if (
        sys.implementation.name != "cpython"
        or sys.version_info[:2] not in _VERSIONS
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or sys.maxsize != 2**63 - 1
        or sys.byteorder != "little"
        or object.__basicsize__ != 16
        or list.__basicsize__ != 40
        or float.__basicsize__ != 24
        or tuple.__itemsize__ != 8
        or tuple.__basicsize__ not in (24, 32)
        or int.__basicsize__ != 24
        or int.__itemsize__ != 4
        or sys.int_info.bits_per_digit != 30
    ):
        return None
    tagged = sys.version_info >= (3, 12)
    types = (list, tuple, float, int, None, str)  # (the order of _objects' L_* fields)
    return np.array([*map(id, types), tuple.__basicsize__, tagged], dtype=np.int64)

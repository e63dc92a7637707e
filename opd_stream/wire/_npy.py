"""A ``.npy`` float32 matrix from an untrusted answer, checked before it is read.

vLLM's scale-out answer carries ``prompt_token_id_logprobs`` as ``base64(np.save(array,
allow_pickle=False))`` (``vllm/utils/serial_utils.py``, ``numpy2base64``); msgspec reads the
base64 (in C, ~3x cheaper than ``base64.b64decode(validate=True)``; invalid or truncated
base64 is a malformed answer, and the bytes are 3/4 of the answer's own text). This reader
takes nothing on trust: the size is bounded by the expected shape, the header (format 1.0,
2.0 or 3.0) is parsed by hand (its dict by ``ast.literal_eval`` on at most
:data:`MAX_HEADER` characters), its dtype must be little-endian float32, its order C, its
shape the one the request implies, and the data the exact number of bytes that shape needs;
the values are then a view of the decoded bytes (no allocation sized by the header). Never
``np.load``, never a pickle.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import MalformedResponseError, MisalignedResponseError

__all__ = ("MAX_HEADER", "read_npy_f32")

_MAGIC = b"\x93NUMPY"
#: The longest header dict accepted (``np.save`` writes ~118 bytes, padded to 64).
MAX_HEADER = 4096


def read_npy_f32(raw: bytes, shape: tuple[int, int], field: str) -> npt.NDArray[np.float32]:
    """The float32 ``shape`` matrix in the ``.npy`` file ``raw`` (a read-only view; the
    answer's decoder has read it from base64, which fails as malformed where invalid or
    truncated).

    Raises:
        MalformedResponseError: not a ``.npy``, a header that does not parse or
            lies about the length, another dtype (big-endian, pickled objects, ...), Fortran
            order, data of another length, NaN.
        MisalignedResponseError: a well-formed array of another shape.
    """
    rows, cols = shape
    data_bytes = 4 * rows * cols
    # bounded before the header is read: a header and exactly the data, nothing more
    most = 12 + MAX_HEADER + data_bytes
    if len(raw) > most:
        raise MalformedResponseError(
            f"`{field}` is {len(raw)} bytes, more than a float32 [{rows}, {cols}] .npy "
            f"can take ({most})"
        )
    start, header = _header(raw, field)
    got = _shape(header, field)
    if got != (rows, cols):
        raise MisalignedResponseError(
            f"`{field}` has shape {list(got)}, expected [{rows}, {cols}] "
            "(response rows x id columns sent)"
        )
    if len(raw) - start != data_bytes:
        raise MalformedResponseError(
            f"`{field}` holds {len(raw) - start} data bytes, its header's shape "
            f"[{rows}, {cols}] needs {data_bytes}"
        )
    values = np.frombuffer(raw, dtype="<f4", count=rows * cols, offset=start)
    if np.isnan(values).any():
        raise MalformedResponseError(f"`{field}` holds NaN, which is not a logprob")
    return values.reshape(rows, cols)


def _header(raw: bytes, field: str) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the header dict (checked to be one)."""
    if len(raw) < 10 or raw[:6] != _MAGIC:
        raise MalformedResponseError(f"`{field}` is not a .npy file (no magic string)")
    major, minor = raw[6], raw[7]
    if major not in (1, 2, 3) or minor != 0:
        raise MalformedResponseError(f"`{field}` is .npy format {major}.{minor}, not 1.0-3.0")
    size_bytes = 2 if major == 1 else 4
    begin = 8 + size_bytes
    hlen = int.from_bytes(raw[8:begin], "little")
    if hlen > MAX_HEADER or begin + hlen > len(raw):
        raise MalformedResponseError(
            f"`{field}`'s .npy header claims {hlen} bytes: more than "
            f"{'the file holds' if hlen <= MAX_HEADER else MAX_HEADER}"
        )
    try:
        text = raw[begin : begin + hlen].decode("utf-8" if major == 3 else "latin-1")
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise MalformedResponseError(f"`{field}`'s .npy header does not parse") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise MalformedResponseError(
            f"`{field}`'s .npy header is not a dict of descr, fortran_order and shape"
        )
    descr = header["descr"]
    if descr != "<f4":
        raise MalformedResponseError(f"`{field}` has {_dtype_words(descr)}, expected '<f4'")
    if header["fortran_order"] is not False:
        raise MalformedResponseError(f"`{field}` is in Fortran order, expected C order")
    return begin + hlen, header


def _dtype_words(descr: object) -> str:
    """What is wrong with a dtype, in words (never the value itself where unknown)."""
    if descr == ">f4":
        return "big-endian float32 ('>f4')"
    if isinstance(descr, str) and descr.lstrip("<>|=").startswith("O"):
        return "an object dtype (a pickle)"
    if not isinstance(descr, str):
        return "a structured dtype"
    return "another dtype than little-endian float32"


def _shape(header: dict[str, Any], field: str) -> tuple[int, int]:
    shape = header["shape"]
    if (
        not isinstance(shape, tuple)
        or len(shape) != 2
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise MalformedResponseError(
            f"`{field}`'s .npy shape is not two non-negative integers (a [rows, ids] matrix)"
        )
    return shape[0], shape[1]

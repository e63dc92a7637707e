"""What every compiled kernel file shares (numba): the decorators, the byte-access
intrinsics, and the bytes of JSON by name.

numba's disk cache keys a compiled function on its own source file only, so every kernel
file that imports from this one (:mod:`opd_stream.scanner._scan`, ``_ids``, ``_rows``,
``_lists``, ``_checks``) carries ``SHARED_DIGEST``, :func:`digest` of this file's bytes;
``tests/scanner/test_scanner_cache.py`` fails until each holds the current one (it prints the new
value), so an edit here recompiles them, and checks that no kernel file takes anything else
from another kernel file. Why: ``docs/design-notes.md``, "opd_stream/scanner/_shared.py".
"""

from __future__ import annotations

import hashlib
from typing import Any

import numba
from numba import types as _types
from numba.extending import intrinsic as _intrinsic

__all__ = (
    "BACKSLASH",
    "CLOSE_BRACE",
    "CLOSE_BRACKET",
    "COLON",
    "COMMA",
    "DOT",
    "EQUALS",
    "LOWER_A",
    "LOWER_E",
    "LOWER_L",
    "LOWER_N",
    "LOWER_U",
    "LOWER_Z",
    "MINUS",
    "NEWLINE",
    "NINE",
    "OPEN_BRACE",
    "OPEN_BRACKET",
    "PLUS",
    "QUOTE",
    "RETURN",
    "SLASH",
    "SPACE",
    "TAB",
    "UPPER_A",
    "UPPER_E",
    "UPPER_Z",
    "ZERO",
    "digest",
    "load_be16",
    "load_be32",
    "load_be64",
    "load_byte",
    "load_bits_at",
    "load_le64",
    "load_u32_at",
    "load_word_at",
    "njit_cached",
    "njit_held",
    "njit_leaf",
    "njit_once",
    "store_le64",
)

# The bytes the kernels compare against, by name (module-level ints: numba freezes them
# into the compiled code as constants).
TAB = ord("\t")
NEWLINE = ord("\n")
RETURN = ord("\r")
SPACE = ord(" ")
QUOTE = ord('"')
PLUS = ord("+")
COMMA = ord(",")
MINUS = ord("-")
DOT = ord(".")
SLASH = ord("/")
ZERO = ord("0")
NINE = ord("9")
COLON = ord(":")
EQUALS = ord("=")
UPPER_A = ord("A")
UPPER_E = ord("E")
UPPER_Z = ord("Z")
OPEN_BRACKET = ord("[")
BACKSLASH = ord("\\")
CLOSE_BRACKET = ord("]")
LOWER_A = ord("a")
LOWER_E = ord("e")
LOWER_L = ord("l")
LOWER_N = ord("n")
LOWER_U = ord("u")
LOWER_Z = ord("z")
OPEN_BRACE = ord("{")
CLOSE_BRACE = ord("}")


def digest() -> str:
    """The digest of this file's bytes that each kernel file carries as ``SHARED_DIGEST``."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def njit_cached(fn):  # type: ignore[no-untyped-def]
    """``numba.njit(nogil=True)``, cached on disk where numba finds a writable place (next
    to the module, else the user's cache directory, or ``NUMBA_CACHE_DIR``); without one,
    numba refuses ``cache=True`` outright, so compile uncached."""
    return _njit(fn, nogil=True)


def njit_leaf(fn):  # type: ignore[no-untyped-def]
    """:func:`njit_cached` for a function that allocates nothing (nor do its callees):
    compiled without numba's reference counting, which otherwise increments and
    decrements (atomically) every array passed at each call, ~10% of the scan.

    Callees are compiled apart and LLVM inlines the small ones at link time. Inlining every
    helper at numba's IR level (``inline="always"``) more than doubled the scan's cold
    compile (11.7 s of CPU against 4.7 s, ``bench/jit_startup.py``): each call site is
    typed and lowered again. A constant argument is passed as ``np.int64(c)`` and a counter
    starts as one: numba compiles a callee once more for each literal value it is given."""
    return _njit(fn, nogil=True, _nrt=False)


def njit_once(fn):  # type: ignore[no-untyped-def]
    """:func:`njit_leaf`, inlined at numba's IR level into its one caller: the number
    parsers of the scan's entries (~15% of the general path, ~4% of the compact one, for
    no more compile time, there being one call site each)."""
    return _njit(fn, nogil=True, _nrt=False, inline="always")


def njit_held(fn):  # type: ignore[no-untyped-def]
    """:func:`njit_leaf` that keeps the GIL: for a kernel reading Python objects in place
    (:mod:`opd_stream.scanner._objects`), which no other thread may change meanwhile."""
    return _njit(fn, _nrt=False)


def _njit(fn: Any, **options: Any) -> Any:
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:
        return numba.njit(**options)(fn)


def _load_byte_typer(typingctx: Any, arr: Any, idx: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load(builder.gep(ary.data, [args[1]]))

    return _types.uint8(arr, idx), codegen


def _load_le64_typer(typingctx: Any, arr: Any, idx: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        p64 = builder.bitcast(ptr, context.get_value_type(_types.uint64).as_pointer())
        return builder.load(p64, align=1)

    return _types.uint64(arr, idx), codegen


def _load_be64_typer(typingctx: Any, arr: Any, idx: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bswap(_load_le64_typer(typingctx, arr, idx)[1](context, builder, sig, args))

    return _types.uint64(arr, idx), codegen


def _load_be_typer(bits: int) -> Any:
    """The typer of a big-endian load of ``bits`` (16 or 32) bits, widened to uint64."""

    def typer(typingctx: Any, arr: Any, idx: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            word = _types.uint16 if bits == 16 else _types.uint32
            p = builder.bitcast(ptr, context.get_value_type(word).as_pointer())
            value = builder.bswap(builder.load(p, align=1))
            return builder.zext(value, context.get_value_type(_types.uint64))

        return _types.uint64(arr, idx), codegen

    return typer


def _load_at_typer(word: Any) -> Any:
    """The typer of a load of one ``word`` (uint32, int64, uint64) at an address (an
    int64)."""

    def typer(typingctx: Any, addr: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = builder.inttoptr(args[0], context.get_value_type(word).as_pointer())
            return builder.load(ptr)

        return word(_types.int64), codegen

    return typer


def _store_le64_typer(typingctx: Any, arr: Any, idx: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        p64 = builder.bitcast(ptr, context.get_value_type(_types.uint64).as_pointer())
        builder.store(args[2], p64, align=1)
        return context.get_dummy_value()

    return _types.none(arr, idx, _types.uint64), codegen


#: ``b[i]`` of a uint8 array without numba's negative-index wraparound, which every
#: signed index otherwise pays (and which keeps LLVM from merging loads): the scan's
#: reads, whose callers keep ``0 <= i < len(b)``.
load_byte: Any = _intrinsic(_load_byte_typer)
#: The eight bytes ``b[i : i + 8]`` as one little-endian uint64, one unaligned load
#: (callers keep ``i + 8 <= len(b)``).
load_le64: Any = _intrinsic(_load_le64_typer)
#: The eight bytes ``b[i : i + 8]`` as one big-endian uint64 (msgpack's byte order).
load_be64: Any = _intrinsic(_load_be64_typer)
#: The two bytes ``b[i : i + 2]`` as a big-endian uint16, as uint64 (msgpack's uint16).
load_be16: Any = _intrinsic(_load_be_typer(16))
#: The four bytes ``b[i : i + 4]`` as a big-endian uint32, as uint64 (msgpack's uint32).
load_be32: Any = _intrinsic(_load_be_typer(32))
#: The int64 at the address ``a`` (a Python object's field: callers keep ``a`` inside an
#: object they hold, the GIL held).
load_word_at: Any = _intrinsic(_load_at_typer(_types.int64))
#: The eight bytes at the address ``a`` as a uint64 (a Python float's IEEE bits).
load_bits_at: Any = _intrinsic(_load_at_typer(_types.uint64))
#: The uint32 at the address ``a`` (one digit of a Python int).
load_u32_at: Any = _intrinsic(_load_at_typer(_types.uint32))
#: ``out[i : i + 8] = value``'s eight little-endian bytes, one unaligned store (callers
#: keep ``i + 8 <= len(out)``).
store_le64: Any = _intrinsic(_store_le64_typer)

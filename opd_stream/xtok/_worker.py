"""A tokenizer loaded and run in a process of its own: the process's end of its pipe.

Building a tokenizer holds the GIL for long stretches, so the host loads none: the host's
end (:class:`~opd_stream.xtok._process.EncoderProcess`) starts
``python -m opd_stream.xtok._worker PATH SETTING`` (the host's ``__main__`` is never
imported again), which loads the file as :func:`~opd_stream.xtok._vocab.load_vocab` does,
sends back every token's bytes, then encodes each text the host sends. The pipe carries
frames (a 4-byte little-endian length, then the payload). The worker prints nothing,
ignores SIGINT, and exits when its standard input closes (the host closes it, or ends).
The frames and the measurements: ``docs/design-notes.md``, "opd_stream/xtok/_worker.py".
"""

from __future__ import annotations

import signal
import sys
from typing import IO

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._process import Loaded, read_frame, write_frame
from ._vocab import Vocab, load_vocab

__all__ = ("main",)


def _with_specials(vocab: Vocab, text: str) -> npt.NDArray[np.int64]:
    """``tokenizers``' ids of ``text`` with special-token strings recognised as those
    tokens (a rendered chat template's text), none added. (The worker is single-threaded:
    the setting is switched back before the next text.)"""
    tokenizer = vocab.tokenizer
    assert tokenizer is not None
    tokenizer.encode_special_tokens = False
    try:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    finally:
        tokenizer.encode_special_tokens = True


def _serve(path: str, setting: str, inp: IO[bytes], out: IO[bytes]) -> None:
    try:
        vocab = load_vocab(setting, path)
    except ConfigError as exc:
        write_frame(out, b"C" + str(exc).encode("utf-8"))
        return
    special = vocab.special_texts()
    loaded = Loaded(
        size=vocab.size,
        flat=b"".join(vocab.token_bytes),
        lengths=vocab.lengths.astype("<i8").tobytes(),
        textless=vocab.textless.tobytes(),
        encoder=vocab.encoder,
        special=special,
    )
    write_frame(out, b"L" + msgspec.msgpack.encode(loaded))
    while (frame := read_frame(inp)) is not None:
        op, text = frame[:1], frame[1:].decode("utf-8", "surrogatepass")
        try:
            if op == b"s":
                ids = _with_specials(vocab, text)
            else:
                ids = vocab.encode_reference(text) if op == b"r" else vocab.encode(text)
        except Exception as exc:  # the libraries' own: the host raises it as EncoderError
            write_frame(out, b"E" + f"{type(exc).__name__}: {exc}".encode())
            continue
        write_frame(out, b"I" + ids.astype("<i8").tobytes())


def main(argv: list[str] | None = None) -> None:
    """``python -m opd_stream.xtok._worker PATH SETTING``."""
    path, setting = (sys.argv[1:] if argv is None else argv)[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(path, setting, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()

"""A tokenizer loaded and run in a process of its own: both ends of its pipe.

Building a tokenizer holds the GIL for long stretches, so the host loads none:
:class:`EncoderProcess` starts ``python -m opd_stream.xtok._worker PATH SETTING`` (the host's
``__main__`` is never imported again), which loads the file as
:func:`~opd_stream.xtok._vocab.load_vocab` does, sends back every token's bytes, then encodes
each text the host sends. The pipe carries frames (a 4-byte little-endian length, then the
payload). The worker prints nothing, ignores SIGINT, and exits when its standard input
closes (:meth:`EncoderProcess.close`, or the host's end). The frames and the measurements:
``docs/design-notes.md``, "opd_stream/xtok/_worker.py".
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import threading
import weakref
from typing import IO, TYPE_CHECKING, Final

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, OPDStreamError

if TYPE_CHECKING:
    from ._vocab import Vocab

__all__ = ("EncoderError", "EncoderProcess", "Loaded", "main")

_LENGTH: Final = struct.Struct("<I")
#: Seconds :meth:`EncoderProcess.close` waits for the worker to exit before killing it.
STOP_S: Final = 5.0


class EncoderError(OPDStreamError, RuntimeError):
    """The encoder process failed: it exited (killed, out of memory), or could not encode a
    text. The samples that need it fail with reason ``encoder_failed``; it is not restarted
    (a new stream starts a new one)."""

    reason = "encoder_failed"


class Loaded(msgspec.Struct, frozen=True):
    """A loaded tokenizer's tables, as the worker sends them."""

    size: int
    flat: bytes
    """Every token's bytes, concatenated in id order."""
    lengths: bytes
    """int64 ``[size]``: each token's byte count."""
    textless: bytes
    """bool ``[size]``."""
    encoder: str
    """``"tiktoken"`` or ``"tokenizers"``."""
    special: dict[int, str]
    """The textless (special) tokens' texts, by id."""


def _read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = stream.read(n)
    return body if len(body) == n else None


def _write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


# ----------------------------------------------------------------------------- the worker


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
    from ._vocab import load_vocab

    try:
        vocab = load_vocab(setting, path)
    except ConfigError as exc:
        _write_frame(out, b"C" + str(exc).encode("utf-8"))
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
    _write_frame(out, b"L" + msgspec.msgpack.encode(loaded))
    while (frame := _read_frame(inp)) is not None:
        op, text = frame[:1], frame[1:].decode("utf-8", "surrogatepass")
        try:
            if op == b"s":
                ids = _with_specials(vocab, text)
            else:
                ids = vocab.encode_reference(text) if op == b"r" else vocab.encode(text)
        except Exception as exc:  # the libraries' own: the host raises it as EncoderError
            _write_frame(out, b"E" + f"{type(exc).__name__}: {exc}".encode())
            continue
        _write_frame(out, b"I" + ids.astype("<i8").tobytes())


def main(argv: list[str] | None = None) -> None:
    """``python -m opd_stream.xtok._worker PATH SETTING``."""
    path, setting = (sys.argv[1:] if argv is None else argv)[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(path, setting, sys.stdin.buffer, sys.stdout.buffer)


# ------------------------------------------------------------------------------- the host


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Close the worker's input (it exits), wait for it, kill it if it does not."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(OSError, ValueError):
            if pipe is not None:
                pipe.close()
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class EncoderProcess:
    """One tokenizer in a worker process (see the module's doc): its tables, and
    :meth:`encode`. Blocking calls; thread-safe (one text at a time on the pipe).

    Raises:
        ConfigError: (on construction) the file does not load, or the worker cannot
            start; the message names the setting and the path.
    """

    def __init__(self, setting: str, path: str) -> None:
        self.setting = setting
        self.path = path
        env = dict(os.environ)
        root = _package_root()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "opd_stream.xtok._worker", path, setting]
        try:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot start the tokenizer process: {exc}") from None
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self._proc)
        frame = self._receive()
        if frame is None:
            raise ConfigError(f"{setting}: {path}: {self._died()}")
        kind, body = frame[:1], frame[1:]
        if kind != b"L":
            self.close()
            message = body.decode("utf-8", "replace")
            raise ConfigError(message if kind == b"C" else f"{setting}: {path}: {message}")
        self.loaded = msgspec.msgpack.decode(body, type=Loaded)

    def _receive(self) -> bytes | None:
        assert self._proc.stdout is not None
        try:
            return _read_frame(self._proc.stdout)
        except (OSError, ValueError):
            return None

    def _died(self) -> str:
        _stop(self._proc)
        tail = b""
        if self._proc.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                tail = self._proc.stderr.read()[-2000:]
        lines = tail.decode("utf-8", "replace").strip().splitlines()
        why = f": {lines[-1]}" if lines else ""
        return f"the tokenizer process exited (code {self._proc.returncode}){why}"

    def encode(
        self, text: str, *, reference: bool = False, specials: bool = False
    ) -> npt.NDArray[np.int64]:
        """The ids of ``text``: as :meth:`~opd_stream.xtok._vocab.Vocab.encode`; with
        ``reference``, as :meth:`~opd_stream.xtok._vocab.Vocab.encode_reference`; with
        ``specials``, ``tokenizers``' with special-token strings recognised as those
        tokens (a chat template's text).

        Raises:
            EncoderError: the worker exited, or its tokenizer raised.
        """
        op = b"s" if specials else b"r" if reference else b"e"
        payload = op + text.encode("utf-8", "surrogatepass")
        with self._lock:
            assert self._proc.stdin is not None
            try:
                _write_frame(self._proc.stdin, payload)
            except (OSError, ValueError):
                frame = None
            else:
                frame = self._receive()
            if frame is None:
                raise EncoderError(f"{self.setting}: {self._died()}")
        if frame[:1] != b"I":
            raise EncoderError(f"{self.setting}: {frame[1:].decode('utf-8', 'replace')}")
        return np.frombuffer(frame, dtype="<i8", offset=1).astype(np.int64)

    def close(self) -> None:
        """Stop the worker (blocking: until it exits, at most :data:`STOP_S` s)."""
        self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the worker process is running."""
        return self._proc.poll() is None


if __name__ == "__main__":
    main()

"""A tokenizer's process, the host's end: :class:`EncoderProcess` starts
``python -m opd_stream.xtok._worker PATH SETTING`` (the process's own end:
:mod:`opd_stream.xtok._worker`) and encodes through it. The pipe's frames
(:func:`read_frame`, :func:`write_frame`) serve both ends.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import threading
import weakref
from typing import IO, Final

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, OPDStreamError

__all__ = ("STOP_S", "EncoderError", "EncoderProcess", "Loaded", "read_frame", "write_frame")

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


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = stream.read(n)
    return body if len(body) == n else None


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


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
            return read_frame(self._proc.stdout)
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
                write_frame(self._proc.stdin, payload)
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

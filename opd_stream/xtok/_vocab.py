"""A tokenizer as cross-tokenizer scoring sees it: :class:`Vocab`, every token id's bytes.

Loaded once per stream from a Hugging Face ``tokenizer.json`` (a file, or a model directory
holding one) with ``tokenizers`` (the ``[xtok]`` extra); never downloaded. A stream loads it
in a process of its own (:func:`load_vocab_process`, :mod:`opd_stream.xtok._worker`). Only
byte-level BPE tokenizers are accepted (every token id has exact bytes). A *special* added
token is **textless** (no bytes); a non-special one is its text, UTF-8 encoded. Nothing here
does I/O but :func:`load_vocab` (one file) and :func:`load_vocab_process` (a process that
does). In full: ``docs/design-notes.md``, "opd_stream/xtok/_vocab.py".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._encoder import FastEncoder, fast_encoder

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ._process import EncoderProcess

__all__ = (
    "Vocab",
    "byte_symbols",
    "load_vocab",
    "load_vocab_process",
    "normalize_teacher_tokenizers",
    "normalize_tokenizer_path",
    "resolve_tokenizer_path",
)

TOKENIZER_FILE: Final = "tokenizer.json"


def byte_symbols() -> dict[str, int]:
    """The byte-level alphabet: the printable character that stands for each byte value.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 byte
    values are given, in increasing order, the characters from U+0100 on (the convention
    of GPT-2's byte-level BPE, which every byte-level ``tokenizer.json`` uses).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    keep = set(printable)
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _tokenizer_file(path: Any) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"expected a path to a tokenizer.json file, got {path!r}")
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"{path} (no {TOKENIZER_FILE} in it)" if file != path else path
        raise ConfigError(f"tokenizer file not found: {where}")
    return file


def resolve_tokenizer_path(setting: str, path: str) -> str:
    """The ``tokenizer.json`` file that ``path`` names (the file, or a directory holding
    one), checked to exist.

    Raises:
        ConfigError: naming ``setting`` and the path.
    """
    try:
        return _tokenizer_file(path)
    except ConfigError as exc:
        raise ConfigError(f"{setting}: {exc}") from None


def normalize_tokenizer_path(value: Any) -> str:
    """A tokenizer setting's value: a path to a ``tokenizer.json`` or a directory holding
    one, which must exist (kept as given, surrounding whitespace stripped).

    Raises:
        ConfigError: the problem, without the setting's name (the caller adds it).
    """
    _tokenizer_file(value.strip() if isinstance(value, str) else value)
    return str(value).strip()


def normalize_teacher_tokenizers(value: Any) -> dict[str, str] | None:
    """``teacher_tokenizers``: teacher name -> tokenizer path, each path checked to exist.

    Accepts a mapping, ``NAME=PATH`` entries (a list, or one string of comma-separated
    entries, as in ``OPD_STREAM_TEACHER_TOKENIZERS``), or one plain path (the teacher
    ``default``). Empty: None (no teacher has its own tokenizer).

    Raises:
        ConfigError: the problem, without the setting's name.
    """
    if isinstance(value, str):
        entries: list[str] = [e.strip() for e in value.split(",") if e.strip()]
        single = len(entries) == 1 and "=" not in entries[0]
        value = {"default": entries[0]} if single else entries
    if isinstance(value, (list, tuple)):
        pairs: dict[str, str] = {}
        for entry in value:
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"expected NAME=PATH entries, got {entry!r}")
            if name.strip() in pairs:
                raise ConfigError(f"teacher {name.strip()!r} is listed twice")
            pairs[name.strip()] = path.strip()
        value = pairs
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"expected a mapping of teacher name to tokenizer path, got {type(value).__name__}"
        )
    out: dict[str, str] = {}
    for name, path in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"teacher names must be non-empty strings, got {name!r}")
        try:
            out[name] = normalize_tokenizer_path(path)
        except ConfigError as exc:
            raise ConfigError(f"teacher {name!r}: {exc}") from None
    return out or None


class Vocab:
    """One tokenizer's ids as bytes, and its encoder.

    Attributes:
        setting: the setting it was loaded for (named in errors).
        path: the ``tokenizer.json`` file.
        size: ids are ``0 .. size - 1``.
        token_bytes: ``token_bytes[id]``: the bytes of that token (``b""`` if textless).
        lengths: int64 ``[size]``, ``len(token_bytes[id])``.
        textless: bool ``[size]``: special added tokens (no bytes).
        tokenizer: the ``tokenizers.Tokenizer``, set to encode special-token strings as
            plain text (a response's text is text, whatever it spells); None when the
            tokenizer runs in a process of its own (:attr:`process`).
        process: that process (:func:`load_vocab_process`), which encodes; else None.
    """

    def __init__(
        self,
        setting: str,
        path: str,
        token_bytes: list[bytes],
        textless: npt.NDArray[np.bool_],
        tokenizer: Tokenizer | None,
        fast: FastEncoder | None = None,
        *,
        process: EncoderProcess | None = None,
        packed: tuple[bytes, npt.NDArray[np.int64]] | None = None,
    ) -> None:
        self.setting = setting
        self.path = path
        self.size = len(token_bytes)
        self.token_bytes = token_bytes
        if packed is None:  # every token's bytes in one buffer, and each one's length
            packed = (
                b"".join(token_bytes),
                np.fromiter(map(len, token_bytes), dtype=np.int64, count=self.size),
            )
        flat, self.lengths = packed
        # token i's bytes are at _flat[_starts[i]:][:lengths[i]] (for join)
        self._flat = np.frombuffer(flat, dtype=np.uint8)
        self._starts = np.cumsum(self.lengths) - self.lengths
        self.textless = textless
        self.tokenizer = tokenizer
        self.fast = fast
        self.process = process

    @property
    def encoder(self) -> str:
        """What encodes text: ``"tiktoken"`` (the exact fast encoder of
        :mod:`opd_stream.xtok._encoder`) or ``"tokenizers"``."""
        if self.process is not None:
            return self.process.loaded.encoder
        return "tokenizers" if self.fast is None else "tiktoken"

    def special_texts(self) -> dict[int, str]:
        """The text that names each textless (special) token, by id (``<|im_end|>``)."""
        if self.process is not None:
            return dict(self.process.loaded.special)
        assert self.tokenizer is not None
        return {
            int(i): str(self.tokenizer.id_to_token(int(i)) or "")
            for i in np.flatnonzero(self.textless)
        }

    def close(self) -> None:
        """Stop :attr:`process`, if any (blocking, briefly); nothing otherwise."""
        if self.process is not None:
            self.process.close()

    def __repr__(self) -> str:
        return f"Vocab({self.setting}={self.path!r}, size={self.size})"

    def encode(self, text: str) -> npt.NDArray[np.int64]:
        """The ids of ``text`` (no special tokens added; special-token strings are text):
        :attr:`fast`'s when it can say, else ``tokenizers``' (the same ids).

        Raises:
            EncoderError: :attr:`process` exited.
        """
        if self.process is not None:
            return self.process.encode(text)
        if self.fast is not None:
            ids = self.fast.encode(text)
            if ids is not None:
                return ids
        return self.encode_reference(text)

    def encode_reference(self, text: str) -> npt.NDArray[np.int64]:
        """The ids of ``text`` from ``tokenizers`` itself."""
        if self.process is not None:
            return self.process.encode(text, reference=True)
        assert self.tokenizer is not None
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets: half the CPU
        fast = getattr(self.tokenizer, "encode_batch_fast", None)
        if fast is not None:
            ids = fast([text], add_special_tokens=False)[0].ids
        else:  # pragma: no cover  (older tokenizers)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def join(self, ids: npt.NDArray[np.int64], ends: npt.NDArray[np.int64] | None = None) -> bytes:
        """The bytes of ``ids`` (all below :attr:`size`), concatenated.

        ``ends``: ``cumsum(lengths[ids])`` when the caller has it. One gather from the
        buffer of all tokens' bytes (3-4x less CPU than joining the tokens' bytes objects).
        """
        lengths = self.lengths[ids]
        if ends is None:
            ends = np.cumsum(lengths)
        if ends.shape[0] == 0 or ends[-1] == 0:
            return b""
        at = np.repeat(self._starts[ids] - (ends - lengths), lengths)
        at += np.arange(at.shape[0])
        joined: bytes = self._flat[at].tobytes()
        return joined


def _decoder_is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, Mapping):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        return any(map(_decoder_is_byte_level, decoder.get("decoders") or ()))
    return False


def vocab_from_json(setting: str, path: str, text: str) -> Vocab:
    """A :class:`Vocab` from the text of a ``tokenizer.json`` (``path`` is for messages).

    Raises:
        ConfigError: the text is not a byte-level BPE tokenizer, or ``tokenizers`` is not
            installed; naming ``setting`` and ``path``.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"{setting}: a teacher with another tokenizer needs the 'tokenizers' package "
            "(pip install 'opd-stream[xtok]')"
        ) from None
    where = f"{setting}: {path}"
    try:
        data = json.loads(text)
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # json or the tokenizers parser: the file is not readable
        raise ConfigError(f"{where}: not a readable tokenizer.json ({exc})") from None
    if not isinstance(data, dict) or not _decoder_is_byte_level(data.get("decoder")):
        raise ConfigError(
            f"{where}: only byte-level BPE tokenizers are supported (decoder ByteLevel); "
            f"this one's decoder is {(data.get('decoder') or {}).get('type')!r}"
        )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    table: list[bytes | None] = [None] * size
    textless = np.zeros(size, dtype=np.bool_)
    added = {}
    for entry in data.get("added_tokens") or ():
        added[int(entry["id"])] = entry
    symbols = byte_symbols()
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if not 0 <= i < size:
            raise ConfigError(f"{where}: token id {i} is outside 0..{size - 1}")
        entry = added.get(i)
        if entry is not None:
            if entry.get("special"):
                textless[i] = True
                table[i] = b""
            else:
                table[i] = str(entry["content"]).encode("utf-8")
            continue
        try:
            table[i] = bytes(map(symbols.__getitem__, token))
        except KeyError:
            raise ConfigError(
                f"{where}: vocabulary entry {token!r} (id {i}) is not made of byte-level "
                "symbols; only byte-level BPE tokenizers are supported"
            ) from None
    holes = [i for i, b in enumerate(table) if b is None]
    if holes:
        raise ConfigError(f"{where}: no vocabulary entry for id {holes[0]} ({len(holes)} ids)")
    tokenizer.encode_special_tokens = True
    vocab = Vocab(setting, path, [b for b in table if b is not None], textless, tokenizer)

    def to_bytes(token: str) -> bytes | None:
        try:
            return bytes(map(symbols.__getitem__, token))
        except KeyError:
            return None

    def reference(text: str) -> list[int]:
        ids: list[int] = vocab.encode_reference(text).tolist()
        return ids

    def bpe(token: str) -> list[int]:
        return [t.id for t in tokenizer.model.tokenize(token)]

    vocab.fast = fast_encoder(data, to_bytes, reference, bpe)
    return vocab


def load_vocab(setting: str, path: str) -> Vocab:
    """Load the tokenizer that setting ``setting`` names (a ``tokenizer.json`` file or a
    directory holding one). Blocking (0.5-3 s for a 150k-250k vocabulary, the fast
    encoder's build and check included).

    Raises:
        ConfigError: a missing, unreadable or unsupported file; the message names the
            setting and the path.
    """
    file = resolve_tokenizer_path(setting, path)
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting}: cannot read tokenizer file {file}: {exc}") from None
    return vocab_from_json(setting, file, text)


#: tokens split per step by :func:`_split`: each of its C calls (``tolist``, ``cumsum``) then
#: holds the GIL well under a millisecond, so a host thread building a 250k vocabulary never
#: keeps the host's loop waiting for it (one call over all of them held it 10-30 ms)
_SPLIT_STEP = 8192


def _split(flat: bytes, lengths: npt.NDArray[np.int64]) -> list[bytes]:
    """Each token's bytes, cut out of their concatenation ``flat`` (``lengths`` per token)."""
    ends = np.cumsum(lengths)
    out: list[bytes] = []
    for at in range(0, lengths.shape[0], _SPLIT_STEP):
        stop = ends[at : at + _SPLIT_STEP].tolist()
        size = lengths[at : at + _SPLIT_STEP].tolist()
        out += [flat[e - n : e] for e, n in zip(stop, size, strict=True)]
    return out


def load_vocab_process(setting: str, path: str) -> Vocab:
    """:func:`load_vocab`'s :class:`Vocab`, its tokenizer loaded and run in a process of
    its own (:mod:`opd_stream.xtok._worker`): what a stream uses, so that no library's
    construction holds the host's GIL. Blocking (the process's start and load, 1-4 s);
    stop the process with :meth:`Vocab.close`. Where :data:`sys.executable` is empty (an
    embedded interpreter), :func:`load_vocab`'s, in this process.

    Raises:
        ConfigError: as :func:`load_vocab`, or the process cannot start.
    """
    import sys

    from ._process import EncoderProcess

    file = resolve_tokenizer_path(setting, path)
    if not sys.executable:  # an embedded interpreter with no Python to start: in-process
        return load_vocab(setting, file)
    process = EncoderProcess(setting, file)
    try:
        loaded = process.loaded
        lengths = np.frombuffer(loaded.lengths, dtype="<i8").astype(np.int64)
        textless = np.frombuffer(loaded.textless, dtype=np.bool_).copy()
        token_bytes = _split(loaded.flat, lengths)
        packed = (loaded.flat, lengths)
        return Vocab(setting, file, token_bytes, textless, None, process=process, packed=packed)
    except BaseException:
        process.close()
        raise

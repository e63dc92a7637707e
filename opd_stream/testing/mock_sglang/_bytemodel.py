"""A closed-form language model over **bytes**, for cross-tokenizer tests.

A token's logprob is the sum of its bytes' log-probabilities, each given all the bytes
before it, so a text's log-probability is the same in any tokenization (the same byte model
on both sides: a span signal of exactly 0). After a history ``h`` of ``n`` bytes the byte
law is geometric over the 256 values, rotated by a context byte::

    c(h) = (salt + 7 n + sum(h)) mod 256,    d = (b - c(h)) mod 256
    log p(b|h) = log(1 - q) + d log q - log(1 - q^256)

``q`` in ``(0, 1)`` and ``salt`` make two models differ. A textless token (a special token)
has the logprob ``textless_logprob`` and adds no byte to the history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ("ByteModel",)


class ByteModel:
    """Token logprobs from a byte model (see the module docstring).

    Args:
        token_bytes: ``token_bytes[id]``, the bytes of each token id of the server's
            tokenizer (``opd_stream.xtok._vocab.Vocab.token_bytes``); ``b""`` for textless ids.
        q: the geometric ratio in ``(0, 1)`` (the larger, the flatter).
        salt: shifts the context byte.
        textless_logprob: the logprob of a token with no bytes (<= 0).
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        *,
        q: float = 0.5,
        salt: int = 0,
        textless_logprob: float = -1.0,
    ) -> None:
        if not 0.0 < q < 1.0:
            raise ValueError("q must be in (0, 1)")
        if textless_logprob > 0:
            raise ValueError("textless_logprob must be <= 0")
        self.token_bytes = list(token_bytes)
        self.lengths = np.fromiter(map(len, self.token_bytes), np.int64, len(self.token_bytes))
        self.q = float(q)
        self.salt = int(salt)
        self.textless_logprob = float(textless_logprob)
        self._base = math.log1p(-self.q) - math.log1p(-(self.q**256))
        self._log_q = math.log(self.q)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def byte_logprobs(self, data: bytes, history: bytes = b"") -> npt.NDArray[np.float64]:
        """``log p(data[i] | history + data[:i])`` for every ``i`` (float64)."""
        h = np.frombuffer(history, np.uint8).astype(np.int64)
        b = np.frombuffer(data, np.uint8).astype(np.int64)
        before = int(h.sum()) + np.concatenate([[0], np.cumsum(b)[:-1]]) if b.size else b
        n = h.size + np.arange(b.size, dtype=np.int64)
        context = (self.salt + 7 * n + before) % 256
        d = (b - context) % 256
        out: npt.NDArray[np.float64] = self._base + d.astype(np.float64) * self._log_q
        return out

    def token_logprobs(
        self, tokens: npt.ArrayLike, positions: npt.ArrayLike
    ) -> npt.NDArray[np.float64]:
        """``log p(tokens[p] | tokens[:p])`` for each ``p`` of ``positions`` (float64)."""
        tok = np.asarray(tokens, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        upto = int(pos.max()) + 1 if pos.size else 0
        lengths = self.lengths[tok[:upto]]
        ends = np.cumsum(lengths)
        data = b"".join(map(self.token_bytes.__getitem__, tok[:upto].tolist()))
        running = np.concatenate([[0.0], np.cumsum(self.byte_logprobs(data))])
        out: npt.NDArray[np.float64] = running[ends[pos]] - running[(ends - lengths)[pos]]
        out[lengths[pos] == 0] = self.textless_logprob
        return out

"""A deterministic, seeded synthetic language model with a closed form.

The distribution at position ``p`` depends only on a context key (the two previous tokens,
``p`` and ``p // block_size``): a **head** of ``head_size`` distinct candidate ids with
float64 logits (half from the position block, so neighbouring top-k sets overlap, half from
the full key; membership of an id is O(1)), a **tail** where every other non-masked id
shares ``tail_logit``, and **masked ids** with ``-inf``. So every logprob is O(1), the
normalisation over the full vocabulary is exact and top-k is a sort of the head. The role
and the seed perturb the head logits with weight ``divergence`` in ``[0, 1]`` (0: identical
models), so teacher and student top-k overlap partly. All float64; callers that emit
values like SGLang round to float32.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._mixing import largest_prime_at_most, scalar_mix, splitmix

__all__ = ("HeadRows", "MockModel", "Role")

Role = Literal["teacher", "student"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_C2 = 0xC2B2AE3D27D4EB4F
_C3 = 0x165667B19E3779F9
_C4 = 0xD6E8FEB86659FD93
_GTABLE_SIZE = 65537  # prime
_NB = 1024  # number of progression steps available per half


class HeadRows(NamedTuple):
    """The explicit part of the distributions at ``n`` positions.

    Attributes:
        ids: int64 ``[n, H]`` head candidate ids (distinct within a row).
        logits: float64 ``[n, H]`` unnormalised logits (``-inf`` for masked ids).
        logz: float64 ``[n]`` log-normaliser over the full vocabulary.
        tail_lp: float64 ``[n]`` logprob of any non-head, non-masked id.
        a: int64 ``[n, 2]`` progression offsets of the two halves.
        b_index: int64 ``[n, 2]`` indices into the step table of the two halves.
    """

    ids: IntArray
    logits: FloatArray
    logz: FloatArray
    tail_lp: FloatArray
    a: IntArray
    b_index: IntArray


class MockModel:
    """Closed-form synthetic LM (see the module docstring for the construction).

    Args:
        role: ``"teacher"`` or ``"student"``; selects the role noise.
        seed: seeds the role noise (the candidate pool and base logits do not depend on it).
        vocab_size: full vocabulary size ``V`` (default Qwen's 151936).
        head_size: number of explicit candidates per position (even, default 128).
        divergence: weight in ``[0, 1]`` of role-specific noise in the head logits.
        logit_scale: spread of head logits (higher: peakier distributions).
        tail_logit: shared logit of every tail id (head logits are kept above it).
        block_size: positions ``p`` with equal ``p // block_size`` share half their head.
        block_bias: logit bonus of the block half (makes adjacent top-k sets overlap).
        masked_ids: ids with logprob ``-inf`` everywhere. ``None``: ``(V-1, V-2)``, which
            are never in a head. Custom ids may fall in heads; they are masked there too.
    """

    def __init__(
        self,
        role: Role = "teacher",
        seed: int = 0,
        vocab_size: int = 151936,
        *,
        head_size: int = 128,
        divergence: float = 0.35,
        logit_scale: float = 2.5,
        tail_logit: float = -6.0,
        block_size: int = 4,
        block_bias: float = 0.5,
        masked_ids: tuple[int, ...] | None = None,
    ) -> None:
        if role not in ("teacher", "student"):
            raise ValueError(f"role must be 'teacher' or 'student', got {role!r}")
        if head_size < 2 or head_size % 2:
            raise ValueError("head_size must be an even integer >= 2")
        if not 0.0 <= divergence <= 1.0:
            raise ValueError("divergence must be in [0, 1]")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.role: Role = role
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self.head_size = int(head_size)
        self.divergence = float(divergence)
        self.logit_scale = float(logit_scale)
        self.tail_logit = float(tail_logit)
        self.block_size = int(block_size)
        self.block_bias = float(block_bias)
        half = self.head_size // 2
        self._half = half
        reserved = 2 if masked_ids is None else 0
        self._m = largest_prime_at_most((self.vocab_size - reserved) // 2)
        if self._m < max(2 * half, 8):
            raise ValueError("vocab_size too small for head_size (need vocab_size >= 4*head_size)")
        if masked_ids is None:
            masked_ids = (self.vocab_size - 1, self.vocab_size - 2)
        masked = np.unique(np.asarray(masked_ids, dtype=np.int64))
        if masked.size and (masked.min() < 0 or masked.max() >= self.vocab_size):
            raise ValueError("masked_ids must lie in [0, vocab_size)")
        if masked.size >= self.vocab_size - self.head_size:
            raise ValueError("too many masked_ids")
        self.masked_ids: IntArray = masked
        self._masked_in_head_possible = bool(masked.size) and int(masked.min()) < 2 * self._m

        # Deterministic, seed-independent tables.
        table_rng = np.random.default_rng(0x0BD5_7EA1)
        g = table_rng.standard_normal(_GTABLE_SIZE)
        self._g: FloatArray = np.concatenate([g, g[: 2 * self.head_size]])
        steps = table_rng.integers(1, self._m, size=_NB, dtype=np.int64)
        self._steps: IntArray = steps
        self._steps_inv: IntArray = np.array(
            [pow(int(s), -1, self._m) for s in steps], dtype=np.int64
        )
        role_id = 1 if role == "teacher" else 2
        self._role_salt = np.uint64(scalar_mix((self.seed << 2) ^ role_id ^ 0x5EED))
        self._ar: IntArray = np.arange(half, dtype=np.int64)
        self._arh: IntArray = np.arange(self.head_size, dtype=np.int64)

    # ------------------------------------------------------------------ internals

    def _check(self, tokens: npt.ArrayLike, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 1 or pos.max() > tok.size):
            raise ValueError(
                f"positions must lie in [1, len(tokens)={tok.size}] (got range "
                f"[{int(pos.min())}, {int(pos.max())}])"
            )
        return tok, pos

    def head_rows(self, tokens: npt.ArrayLike, positions: npt.ArrayLike) -> HeadRows:
        """Head ids, logits and normalisers at ``positions`` (see :class:`HeadRows`).

        Args:
            tokens: int64 ``[L]`` token sequence.
            positions: int64 ``[n]`` absolute target positions, each in ``[1, L]``.
        """
        tok, pos = self._check(tokens, positions)
        n = pos.size
        half = self._half
        m = self._m
        prev1 = tok[pos - 1].astype(np.uint64)
        prev2 = np.where(pos >= 2, tok[np.maximum(pos - 2, 0)], -1).astype(np.uint64)
        upos = pos.astype(np.uint64)
        kc = splitmix(splitmix(prev1 * np.uint64(_C2) ^ prev2 * np.uint64(_C3)) ^ upos)
        kb = splitmix((pos // self.block_size).astype(np.uint64) * np.uint64(_C4))
        kr = splitmix(kc ^ self._role_salt)
        m64 = np.uint64(m)
        a = np.stack([(kb % m64).astype(np.int64), (kc % m64).astype(np.int64)], axis=1)
        bi = np.stack(
            [
                ((kb >> np.uint64(20)) % np.uint64(_NB)).astype(np.int64),
                ((kc >> np.uint64(20)) % np.uint64(_NB)).astype(np.int64),
            ],
            axis=1,
        )
        b = self._steps[bi]
        ids = np.empty((n, self.head_size), dtype=np.int64)
        ids[:, :half] = 2 * ((a[:, :1] + self._ar * b[:, :1]) % m)
        ids[:, half:] = 2 * ((a[:, 1:] + self._ar * b[:, 1:]) % m) + 1
        gsz = np.uint64(_GTABLE_SIZE)
        ub = (kb >> np.uint64(33)) % gsz
        uc = (kc >> np.uint64(33)) % gsz
        ur = (kr >> np.uint64(33)) % gsz
        g = self._g
        z = np.empty((n, self.head_size), dtype=np.float64)
        ctx = g[uc.astype(np.int64)[:, None] + self._arh]
        z[:, :half] = (g[ub.astype(np.int64)[:, None] + self._ar] + ctx[:, :half]) * (
            1.0 / math.sqrt(2.0)
        )
        z[:, half:] = ctx[:, half:]
        d = self.divergence
        if d > 0.0:
            noise = g[ur.astype(np.int64)[:, None] + self._arh]
            z = math.sqrt(1.0 - d * d) * z + d * noise
        logits = self.logit_scale * z
        logits[:, :half] += self.block_bias
        t = self.tail_logit
        # Fold: every head logit ends strictly above the tail logit (cheap, keeps ties rare).
        logits = t + 0.05 + np.abs(logits - t)
        n_tail = np.full(n, self.vocab_size - self.head_size - self.masked_ids.size, np.float64)
        if self._masked_in_head_possible:
            in_head = np.isin(ids, self.masked_ids)
            if in_head.any():
                logits = np.where(in_head, -np.inf, logits)
                n_tail += in_head.sum(axis=1)
        mx = logits.max(axis=1)
        lse_head = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
        logz = np.logaddexp(lse_head, t + np.log(n_tail))
        return HeadRows(ids, logits, logz, t - logz, a, bi)

    def _slot_of(self, rows: HeadRows, ids: IntArray) -> IntArray:
        """Head slot of ``ids[i, j]`` in row ``i``, or -1 when it is not in the head."""
        half = self._half
        m = self._m
        par = ids & 1
        x = ids >> 1
        a = np.where(par == 0, rows.a[:, :1], rows.a[:, 1:])
        binv = np.where(
            par == 0, self._steps_inv[rows.b_index[:, :1]], self._steps_inv[rows.b_index[:, 1:]]
        )
        j = ((x - a) % m) * binv % m
        inside = (x < m) & (j < half)
        return np.where(inside, j + par * half, -1)

    # ------------------------------------------------------------------ public API

    def logprobs(
        self, tokens: npt.ArrayLike, positions: npt.ArrayLike, ids: npt.ArrayLike
    ) -> FloatArray:
        """Logprob of ``ids[i, j]`` at absolute position ``positions[i]``.

        That is ``log p(x = ids[i, j] | tokens[:positions[i]])``, normalised over the full
        vocabulary.

        Args:
            tokens: int64 ``[L]``.
            positions: int64 ``[n]`` in ``[1, L]``.
            ids: int64 ``[n, m]`` token ids in ``[0, V)``.

        Returns:
            float64 ``[n, m]``; ``-inf`` for masked ids.

        Raises:
            ValueError: a position or an id is out of range.
        """
        return self.logprobs_in(self.head_rows(tokens, positions), ids)

    def logprobs_in(self, rows: HeadRows, ids: npt.ArrayLike) -> FloatArray:
        """:meth:`logprobs` on precomputed :meth:`head_rows` (saves recomputing them)."""
        idm = np.asarray(ids, dtype=np.int64)
        if idm.ndim != 2 or idm.shape[0] != rows.ids.shape[0]:
            raise ValueError(f"ids must have shape [n={rows.ids.shape[0]}, m], got {idm.shape}")
        if idm.size and (idm.min() < 0 or idm.max() >= self.vocab_size):
            raise ValueError("ids must lie in [0, vocab_size)")
        slot = self._slot_of(rows, idm)
        head_lp = np.take_along_axis(rows.logits, np.maximum(slot, 0), axis=1) - rows.logz[:, None]
        out = np.where(slot >= 0, head_lp, rows.tail_lp[:, None])
        if self.masked_ids.size:
            out = np.where(np.isin(idm, self.masked_ids), -np.inf, out)
        return out

    def token_logprobs(self, tokens: npt.ArrayLike, positions: npt.ArrayLike) -> FloatArray:
        """Logprob of ``tokens[p]`` at each ``p`` in ``positions`` (each in ``[1, L-1]``)."""
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and pos.max() >= tok.size:
            raise ValueError("token_logprobs positions must be < len(tokens)")
        return self.logprobs(tok, pos, tok[pos][:, None])[:, 0]

    def topk(
        self, tokens: npt.ArrayLike, positions: npt.ArrayLike, k: int
    ) -> tuple[IntArray, FloatArray]:
        """The ``k`` most likely ids at each position, best first, ties by smaller id.

        Returns:
            ``(ids int64 [n, k], logprobs float64 [n, k])``.
        """
        return self.topk_in(self.head_rows(tokens, positions), k)

    def topk_in(self, rows: HeadRows, k: int) -> tuple[IntArray, FloatArray]:
        """:meth:`topk` on precomputed :meth:`head_rows`."""
        n = rows.ids.shape[0]
        if k <= 0:
            return np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float64)
        kk = min(k, self.head_size)
        order = np.argsort(-rows.logits, axis=1)
        srt = np.take_along_axis(rows.logits, order[:, : min(kk + 1, self.head_size)], axis=1)
        ties = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if ties.any():  # exact ties (rare): order those rows by (-logit, id)
            order[ties] = np.lexsort((rows.ids[ties], -rows.logits[ties]), axis=1)
        sel = order[:, :kk]
        top_ids = np.take_along_axis(rows.ids, sel, axis=1)
        top_lp = np.take_along_axis(rows.logits, sel, axis=1) - rows.logz[:, None]
        if k <= self.head_size and bool(np.isfinite(top_lp).all()):
            return top_ids, top_lp
        return self._topk_with_tail(rows, top_ids, top_lp, k)

    def _topk_with_tail(
        self, rows: HeadRows, top_ids: IntArray, top_lp: FloatArray, k: int
    ) -> tuple[IntArray, FloatArray]:
        """Rare path: k exceeds the usable head, so tail ids (smallest first) fill in."""
        n = rows.ids.shape[0]
        out_ids = np.empty((n, k), np.int64)
        out_lp = np.empty((n, k), np.float64)
        masked = set(self.masked_ids.tolist())
        for i in range(n):
            fin = np.isfinite(top_lp[i])
            h_ids = top_ids[i][fin].tolist()
            h_lp = top_lp[i][fin].tolist()
            head_set = set(rows.ids[i].tolist())
            tail: list[int] = []
            cand = 0
            need = k - len(h_ids)
            while len(tail) < need and cand < self.vocab_size:
                if cand not in head_set and cand not in masked:
                    tail.append(cand)
                cand += 1
            ids_i = h_ids + tail
            lp_i = h_lp + [float(rows.tail_lp[i])] * len(tail)
            while len(ids_i) < k:  # only masked ids remain
                rest = sorted(set(range(self.vocab_size)) - set(ids_i))
                ids_i.append(rest[0])
                lp_i.append(-math.inf)
            out_ids[i] = ids_i[:k]
            out_lp[i] = lp_i[:k]
        return out_ids, out_lp

    def sample(
        self,
        tokens: npt.ArrayLike,
        max_new_tokens: int,
        rng: np.random.Generator,
        *,
        temperature: float = 1.0,
        stop_token_ids: tuple[int, ...] = (),
    ) -> IntArray:
        """Generate up to ``max_new_tokens`` ids after ``tokens`` (never a masked id).

        ``temperature`` scales every logit (head and tail); 0 means greedy (head top-1, ties
        by smaller id). Generation stops after emitting an id in ``stop_token_ids``.

        Returns:
            int64 ``[g]`` generated ids, ``g <= max_new_tokens``.
        """
        ctx = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not ctx.size:
            raise ValueError("sample needs at least one context token")
        buf = np.empty(ctx.size + max(max_new_tokens, 0), dtype=np.int64)
        buf[: ctx.size] = ctx
        pos = ctx.size
        stops = set(stop_token_ids)
        masked = set(self.masked_ids.tolist())
        for _ in range(max_new_tokens):
            rows = self.head_rows(buf[:pos], np.array([pos], dtype=np.int64))
            tok = self._draw(rows, rng, temperature, masked)
            buf[pos] = tok
            pos += 1
            if tok in stops:
                break
        return buf[ctx.size : pos].copy()

    def _draw(
        self, rows: HeadRows, rng: np.random.Generator, temperature: float, masked: set[int]
    ) -> int:
        ids = rows.ids[0]
        logits = rows.logits[0]
        if temperature <= 0.0:
            order = np.lexsort((ids, -logits))
            return int(ids[order[0]])
        inv_t = 1.0 / temperature
        scaled = logits * inv_t
        # Masked ids inside the head were excluded from the tail count in head_rows.
        n_tail = float(
            self.vocab_size - self.head_size - self.masked_ids.size + int(np.isinf(logits).sum())
        )
        lt = self.tail_logit * inv_t + math.log(n_tail)
        mx = max(float(scaled.max()), lt)
        w_head = np.exp(scaled - mx)
        w_tail = math.exp(lt - mx)
        total = float(w_head.sum()) + w_tail
        u = rng.random() * total
        if u < w_tail:
            head = set(ids.tolist())
            while True:
                c = int(rng.integers(0, self.vocab_size))
                if c not in head and c not in masked:
                    return c
        cdf = np.cumsum(w_head)
        j = int(np.searchsorted(cdf, u - w_tail, side="right"))
        return int(ids[min(j, ids.size - 1)])

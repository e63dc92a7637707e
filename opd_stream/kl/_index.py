"""The array operations of the KL selection's index work, on two backends:
:class:`NumpyIndex` (CPU) and :class:`TorchIndex` (any device). :mod:`opd_stream.kl._select`
writes its integer index work once against :data:`Index`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ("Index", "NumpyIndex", "TorchIndex")


class NumpyIndex:
    """The index work's array operations on numpy (CPU): numpy's row sort is SIMD and its
    integer and bool kernels are several times faster than torch's on one CPU thread."""

    i32: Any = np.int32
    i64: Any = np.int64
    f32: Any = np.float32
    b8: Any = np.bool_
    small_index = True  # int32 flat indices when they fit

    def asarray(self, x: Tensor) -> Any:
        return (x.detach() if x.requires_grad else x).numpy()

    def tensor(self, a: Any) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    def sort_rows(self, a: Any) -> Any:
        return np.sort(a, axis=1)

    def cat(self, parts: Sequence[Any]) -> Any:
        return np.concatenate(parts, axis=1)

    def cat_rows(self, parts: Sequence[Any]) -> Any:
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def clip_neg(self, a: Any) -> Any:
        return np.maximum(a, -1)

    def arange(self, start: int, stop: int, step: int, dtype: Any) -> Any:
        return np.arange(start, stop, step, dtype=dtype)

    def cast(self, a: Any, dtype: Any) -> Any:
        return a.astype(dtype)

    def zeros(self, shape: tuple[int, int], dtype: Any) -> Any:
        return np.zeros(shape, dtype=dtype)

    def any(self, a: Any, axis: int) -> Any:
        return a.any(axis=axis)

    def argmax(self, a: Any, axis: int) -> Any:
        return a.argmax(axis=axis)

    def minmax(self, a: Any) -> tuple[int, int]:
        return int(a.min()), int(a.max())

    def has(self, a: Any) -> bool:
        return bool(a.any())


class TorchIndex:
    """The same operations on torch tensors (any device)."""

    i32: Any = torch.int32
    i64: Any = torch.int64
    f32: Any = torch.float32
    b8: Any = torch.bool
    small_index = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def asarray(self, x: Tensor) -> Any:
        return x

    def tensor(self, a: Any) -> Tensor:
        return a.contiguous()  # type: ignore[no-any-return]

    def sort_rows(self, a: Any) -> Any:
        return torch.sort(a, dim=1).values

    def cat(self, parts: Sequence[Any]) -> Any:
        return torch.cat(list(parts), dim=1)

    def cat_rows(self, parts: Sequence[Any]) -> Any:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)

    def clip_neg(self, a: Any) -> Any:
        return a.clamp_min(-1)

    def arange(self, start: int, stop: int, step: int, dtype: Any) -> Any:
        return torch.arange(start, stop, step, dtype=dtype, device=self.device)

    def cast(self, a: Any, dtype: Any) -> Any:
        return a.to(dtype)

    def zeros(self, shape: tuple[int, int], dtype: Any) -> Any:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def any(self, a: Any, axis: int) -> Any:
        return a.any(dim=axis)

    def argmax(self, a: Any, axis: int) -> Any:
        return a.view(torch.uint8).argmax(dim=axis)

    def minmax(self, a: Any) -> tuple[int, int]:
        lo, hi = torch.aminmax(a)
        return int(lo), int(hi)

    def has(self, a: Any) -> bool:
        return bool(a.any())


Index = NumpyIndex | TorchIndex

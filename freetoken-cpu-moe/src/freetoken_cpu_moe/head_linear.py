"""Per-head projections read in their checkpoint format (multi-head latent attention's
absorbed up-projections: ``attn_k_b`` moves a query head into latent space, ``attn_v_b``
takes a head's latent output back to its values).

A ``[heads, out, in]`` tensor is a bank of one-matrix "experts", one per head; every head's
product runs in one call of the worker pool (``_core.linear_heads``), so a decode step reads
the matrices once in their file format (Q8_0: about a quarter of float32's bytes) instead of
a dequantized float copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from freetoken.loading.tensors import RawTensor
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.dense import ACT_FMT, weights_of
from freetoken_cpu_moe.pool import Pool


class HeadLinear:
    """``y[t, h] = W[h] @ x[t, h]`` for a ``[heads, out, in]`` weight kept as stored."""

    def __init__(self, raw: RawTensor, pool: Pool, huge_pages: bool = False) -> None:
        if len(raw.shape) != 3:
            raise ValueError(f"{raw.source}: {raw.name} should be [heads, out, in], has shape {raw.shape}")
        self.heads, self.out_features, self.in_features = (int(n) for n in raw.shape)
        self.nbytes = raw.nbytes
        self._raw = raw  # keeps the mapping alive
        self.weights = weights_of(raw, self.heads, self.out_features, self.in_features, huge_pages)
        self._pool = pool

    def __call__(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x`` ``[T, heads, in]`` -> ``[T, heads, out]`` (in ``out_dtype``, default ``x``'s)."""
        if x.dim() != 3 or x.shape[1:] != (self.heads, self.in_features):
            raise ValueError(f"HeadLinear: input of shape {tuple(x.shape)}, expected [T, {self.heads}, "
                             f"{self.in_features}]")  # fmt: skip
        x = x.contiguous()
        out_dtype = out_dtype or x.dtype
        y = torch.empty((x.shape[0], self.heads, self.out_features), dtype=out_dtype)
        _core.linear_heads(self.weights.address, x.data_ptr(), ACT_FMT[x.dtype], x.shape[0], y.data_ptr(),
                           ACT_FMT[out_dtype], self._pool._core, "")  # fmt: skip
        return y

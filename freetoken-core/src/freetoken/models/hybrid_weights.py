"""Weight reshaping at load time for the Qwen3-Next / Qwen3.5 hybrid families: rows of a
checkpoint matrix picked or reordered (packed GGUF rows stay packed), zero-centred norm
weights, and the rotary layout that lets partial RoPE run through the full-width kernels."""

from __future__ import annotations

import torch

from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor
from freetoken.models.layers import Rotary


#: the rows one block scale of FP8 block-quantized weights covers
FP8_SCALE_ROWS = 128


def take_rows(raw: RawTensor, idx: torch.Tensor, name: str) -> RawTensor:
    """The rows ``idx`` of a matrix, in that order. Packed and plain rows are copied as
    stored; so is block-scaled FP8 when every row stays in its 128-row scale block (a
    reordering within blocks, e.g. of a head's RoPE rows), else it is dequantized to
    float32 first."""
    rows = int(idx.numel())
    if raw.scale is not None and rows == raw.shape[0] and torch.equal(
            idx // FP8_SCALE_ROWS, torch.arange(rows) // FP8_SCALE_ROWS):
        t = raw.raw_torch().reshape(raw.shape[0], -1)
        return RawTensor(name, raw.shape, raw.fmt, t.index_select(0, idx).contiguous(), raw.source, raw.scale)
    if raw.scale is not None:
        data = raw.to_float(torch.float32).index_select(0, idx).contiguous()
        return RawTensor(name, (rows, *raw.shape[1:]), int(Fmt.F32), data, raw.source)
    t = raw.raw_torch().reshape(raw.shape[0], -1)
    return RawTensor(name, (rows, *raw.shape[1:]), raw.fmt, t.index_select(0, idx).contiguous(), raw.source)


def float_tensor(name: str, t: torch.Tensor, source: str) -> RawTensor:
    """A float32 tensor as a :class:`RawTensor` (for weights rebuilt at load)."""
    t = t.to(torch.float32).contiguous()
    return RawTensor(name, tuple(t.shape), int(Fmt.F32), t, source)


def offset_norm(raw: RawTensor) -> RawTensor:
    """A zero-centred RMSNorm weight ``w`` (the norm multiplies by ``1 + w``) as the plain
    multiplier ``1 + w``."""
    return float_tensor(raw.name, raw.to_float(torch.float32) + 1.0, raw.source)


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The per-head order of q/k dimensions that puts partial NeoX RoPE's pairs
    ``(i, i + rotary_dim/2)`` at ``(i, i + head_dim/2)``; the dimensions RoPE leaves alone
    fill the other places. Applied to the q and k rows (and their norm weights) alike, it
    leaves every q.k product unchanged."""
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or head_dim % 2:
        raise ValueError(f"rotary dim {rotary_dim} does not fit head dim {head_dim}")
    half, r = head_dim // 2, rotary_dim // 2
    order = [-1] * head_dim
    for i in range(r):
        order[i] = i
        order[half + i] = r + i
    rest = iter(range(rotary_dim, head_dim))
    for p in range(head_dim):
        if order[p] < 0:
            order[p] = next(rest)
    return torch.tensor(order, dtype=torch.int64)


class PartialRotary(Rotary):
    """NeoX RoPE on ``rotary_dim`` of ``head_dim`` dimensions, laid out (after
    :func:`rotary_permutation`) as full-width tables: the rotated pairs at ``(i, i + D/2)``
    for ``i < rotary_dim/2``, ``cos = 1`` and ``sin = 0`` on the others. Same interface
    (``cos``, ``sin_signed``, ``half``) as :class:`Rotary`, so the fused kernels apply it."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_positions: int,
                 device: torch.device) -> None:  # fmt: skip
        r = rotary_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, r]
        half = head_dim // 2
        cos = torch.ones(max_positions, head_dim)
        sin = torch.zeros(max_positions, head_dim)
        cos[:, :r] = freqs.cos()
        cos[:, half : half + r] = freqs.cos()
        sin[:, :r] = -freqs.sin()
        sin[:, half : half + r] = freqs.sin()
        self.half = half
        self.cos = cos.to(device)
        self.sin_signed = sin.to(device)
        self.max_positions = max_positions

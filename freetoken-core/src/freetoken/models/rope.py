"""Rotary embeddings with frequency scaling: the tables of :class:`freetoken.models.layers.Rotary`
(NeoX, rotate-half) built from any inverse frequencies and a cos/sin scale.

YaRN (``rope_type: yarn``): the inverse frequencies blend interpolated (divided by
``factor``) and original ones by a linear ramp over the dimensions between the correction
range ``[low, high]`` that ``beta_fast``/``beta_slow`` rotations over the original context
give; cos and sin are multiplied by ``attention_factor`` (default ``0.1 ln(factor) + 1``).
``truncate`` rounds the correction range outwards to whole dimensions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from freetoken.loading.hf import CheckpointError
from freetoken.models.layers import Rotary


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled (``kind`` "default": not at all)."""

    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = None


SUPPORTED = ("default", "yarn")


def hf_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """An HF config's RoPE parameters (``rope_parameters`` or the older ``rope_scaling``)."""
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def _hf_kind_theta(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[str, float]:
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    return kind, float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def default_rope_theta(cfg: dict[str, Any], family: str) -> float:
    """The RoPE base of an HF config of a family that runs unscaled RoPE only."""
    kind, theta = _hf_kind_theta(cfg, hf_rope_parameters(cfg))
    if kind != "default":
        raise CheckpointError(f"{family} with RoPE scaling {kind!r} is not supported (default RoPE only)")
    return theta


def scaling_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) of an HF config (``rope_parameters`` or the older ``rope_scaling``)."""
    rope = hf_rope_parameters(cfg)
    kind, theta = _hf_kind_theta(cfg, rope)
    if kind not in SUPPORTED:
        raise CheckpointError(f"RoPE type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if kind == "default":
        return theta, RopeScaling()
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise CheckpointError(f"YaRN RoPE with {key}={rope[key]} is not supported")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    return theta, RopeScaling(
        kind="yarn",
        factor=float(rope["factor"]),
        original_max_positions=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
    )


def yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies (float32 ``[dim/2]``) and the cos/sin scale."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    factor = s.attention_factor
    if factor is None:
        factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv_freq, float(factor)


def make_rotary(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int,
                device: torch.device) -> Rotary:  # fmt: skip
    """A :class:`Rotary` whose tables follow ``scaling``."""
    rot = Rotary(head_dim, theta, max_positions, device)
    if scaling.kind == "default":
        return rot
    inv_freq, mscale = yarn_inv_freq(head_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    rot.cos = (emb.cos() * mscale).to(device)
    rot.sin_signed = (emb.sin() * mscale * sign).to(device)
    return rot

"""Whether the Triton kernels run on a device: Triton where
:func:`freetoken.backends.triton_target.for_device` accepts the device and triton imports,
else the torch implementations. Callers read :func:`default_impl` through this module, so a
test may point it at Triton's interpreter. :func:`head_dim_support`: which of the kernels that
tile over attention heads take a model's head sizes (asked when the model is built)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


def default_impl(device: Any) -> tuple[str, str]:
    """(implementation, why) for kernels on ``device``: ``"triton"`` where
    :func:`freetoken.backends.triton_target.for_device` says it runs, else ``"torch"``."""
    from freetoken.backends import triton_target

    target = triton_target.for_device(device)
    if not target.usable:
        return "torch", target.reason
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return "torch", f"triton is not importable: {exc}"
    return "triton", target.reason


def check_triton(device: Any) -> None:
    """Raise ValueError when the Triton implementation cannot run on ``device``: triton does
    not import, or ``device`` is a GPU whose target Triton does not run on (CPU tensors run
    in Triton's interpreter)."""
    from freetoken.backends import triton_target

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"impl='triton' needs triton: {exc}") from exc
    target = triton_target.for_device(device)
    if target.backend != "none" and not target.usable:
        raise ValueError(f"impl='triton' on {device}: {target.reason}; use impl='torch' (or 'auto')")


#: the widest q/k head the decode attention kernel tiles: one tile of up to 512 values and
#: a second of up to 256 (MLA's latent queries with the up-projections absorbed: 512 + 64)
DECODE_ATTENTION_MAX_HEAD_DIM = 768
#: the widest v head it tiles (a program's ``[16, 512]`` float32 accumulator at the most)
DECODE_ATTENTION_MAX_V_HEAD_DIM = 512
#: the widest head the fused q/k norm + RoPE kernel takes (one head per program, in registers)
QK_NORM_ROPE_MAX_HEAD_DIM = 1024


@dataclasses.dataclass(frozen=True)
class HeadDimSupport:
    """Which Triton kernels that tile over attention heads take a model's head sizes
    (:func:`head_dim_support`); a part that does not runs its torch implementation."""

    head_dim: int
    v_head_dim: int
    qk_norm_rope: bool  # kernels.dense_ops.qk_norm_rope (per-head RMSNorm + NeoX RoPE + K/V cache write)
    qk_norm_rope_why: str
    decode_attention: bool  # kernels.decode_attention (paged split-K decode attention)
    decode_attention_why: str

    def torch_parts(self) -> list[str]:
        """One line per part that takes the torch implementation, with why (empty: none)."""
        parts = []
        if not self.qk_norm_rope:
            parts.append(f"q/k norm + RoPE: {self.qk_norm_rope_why}")
        if not self.decode_attention:
            parts.append(f"decode attention: {self.decode_attention_why}")
        return parts


def head_dim_support(head_dim: int, v_head_dim: Optional[int] = None) -> HeadDimSupport:
    """Whether the Triton kernels that tile over the attention head take ``head_dim``
    (q and k) and ``v_head_dim`` (default: ``head_dim``; MLA-shaped models: 192 and 128).
    Decided from the sizes alone, when a model is built, never mid-request: the kernels pad
    their tiles to the next power of two and mask the lanes past the head, so any size
    runs within these bounds:

    * q/k norm + RoPE: an even ``head_dim`` (NeoX pairs ``(i, i + head_dim/2)``) of at most
      :data:`QK_NORM_ROPE_MAX_HEAD_DIM`; any ``v_head_dim`` up to the same bound.
    * decode attention: ``head_dim`` of at most :data:`DECODE_ATTENTION_MAX_HEAD_DIM` and
      ``v_head_dim`` of at most :data:`DECODE_ATTENTION_MAX_V_HEAD_DIM`.
    """
    d = int(head_dim)
    dv = d if v_head_dim is None else int(v_head_dim)
    if d < 1 or dv < 1:
        raise ValueError(f"head sizes must be >= 1, got head_dim={d}, v_head_dim={dv}")
    if d % 2:
        rope, rope_why = False, f"head_dim {d} is odd (RoPE rotates pairs (i, i + head_dim/2))"
    elif max(d, dv) > QK_NORM_ROPE_MAX_HEAD_DIM:
        rope, rope_why = False, (f"head_dim {d}/v_head_dim {dv} wider than the kernel's "
                                 f"{QK_NORM_ROPE_MAX_HEAD_DIM}")  # fmt: skip
    else:
        rope, rope_why = True, f"head_dim {d}, v_head_dim {dv}: tile {_pow2(d)}/{_pow2(dv)}, masked"
    if d > DECODE_ATTENTION_MAX_HEAD_DIM or dv > DECODE_ATTENTION_MAX_V_HEAD_DIM:
        attn, attn_why = False, (f"head_dim {d}/v_head_dim {dv} wider than the kernel's "
                                 f"{DECODE_ATTENTION_MAX_HEAD_DIM}/{DECODE_ATTENTION_MAX_V_HEAD_DIM}")  # fmt: skip
    else:
        attn, attn_why = True, f"head_dim {d}, v_head_dim {dv}: tile {_attention_tiles(d)}/{max(16, _pow2(dv))}, masked"
    return HeadDimSupport(d, dv, rope, rope_why, attn, attn_why)


def _attention_tiles(d: int) -> str:
    """The decode attention kernel's q/k tiles for a head of ``d`` (kernels.decode_attention.split_d,
    without importing triton): one power of two (>= 16), or above 256 the largest power of two
    within ``d`` and one more for the rest."""
    if d <= 256 or d & (d - 1) == 0:
        return str(max(16, _pow2(d)))
    first = 1 << (d.bit_length() - 1)
    return f"{first}+{max(16, _pow2(d - first))}"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()

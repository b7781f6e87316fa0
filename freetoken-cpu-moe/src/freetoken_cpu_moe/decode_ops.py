"""The CPU backend's :class:`freetoken.models.dense_ops.DenseOps`: each per-token operation
of a decoder layer is one native call (``csrc/decode_ops.cpp``) on the calling thread instead
of several torch ops (a residual add and RMSNorm: 2 ops; q/k RMSNorm, RoPE and the K/V write:
about 12; the router's top-k: 3; a Gated DeltaNet layer's gates, convolution, recurrence and
gated norm: about 40), whose dispatch costs more than their arithmetic at decode sizes.
The DeltaNet step shares its value heads out across the worker pool; the others run on the
calling thread. Float32 inside, one rounding to the activation dtype, like the torch ops they replace
(:data:`freetoken.models.dense_ops.TORCH_OPS`, the reference they are tested against).
Tensors these calls do not take (other devices, strides, dtypes) go to the torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from freetoken.handoff import Fmt
from freetoken.models.dense_ops import TORCH_OPS, DenseOps
from freetoken.models.layers import Rotary
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.pool import Pool, default_pool

if TYPE_CHECKING:
    from freetoken.models.gated_deltanet import GatedDeltaNet

_FMT = {torch.float32: int(Fmt.F32), torch.bfloat16: int(Fmt.BF16), torch.float16: int(Fmt.F16)}


def _row_major(t: torch.Tensor) -> bool:
    """A CPU tensor whose last dimension is contiguous."""
    return t.device.type == "cpu" and t.stride(-1) == 1


class CpuDenseOps(DenseOps):
    name = "cpu-native"

    def __init__(self, pool: Optional[Pool] = None) -> None:
        self._pool = pool  # for the calls that use one (None: the package's default pool)

    @property
    def pool(self) -> Pool:
        return self._pool if self._pool is not None else default_pool()

    def add_rms_norm(self, h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        fmt, wfmt = _FMT.get(h.dtype), _FMT.get(weight.dtype)
        if (fmt is None or wfmt is None or h.dim() != 2 or h.device.type != "cpu" or not h.is_contiguous()
                or not weight.is_contiguous() or weight.numel() != h.shape[1]
                or (delta is not None and (delta.dtype != h.dtype or delta.shape != h.shape
                                           or not delta.is_contiguous()))):  # fmt: skip
            return TORCH_OPS.add_rms_norm(h, delta, weight, eps)
        T, n = h.shape
        x = torch.empty_like(h)
        h_out = h if delta is None else torch.empty_like(h)
        _core.add_rms_norm(h.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), wfmt,
                           h_out.data_ptr(), x.data_ptr(), fmt, T, n, float(eps))  # fmt: skip
        return h_out, x

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, qk_weight: Optional[torch.Tensor], rotary: Rotary,
                           positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
        fmt, kv_fmt = _FMT.get(q.dtype), _FMT.get(k_cache.dtype)
        wfmt = _FMT.get(q_weight.dtype) if q_weight is not None else int(Fmt.F32)
        T = q.shape[0]
        nb, bs, Hkv, D = k_cache.shape
        if (fmt is None or kv_fmt is None or wfmt is None or q.dim() != 2 or k.dtype != q.dtype
                or v.dtype != q.dtype or not (_row_major(q) and _row_major(k) and _row_major(v))
                or not k_cache.is_contiguous() or not v_cache.is_contiguous() or v_cache.dtype != k_cache.dtype
                or positions.dtype != torch.int64 or slots.dtype != torch.int64 or not positions.is_contiguous()
                or not slots.is_contiguous() or rotary.cos.dtype != torch.float32 or not rotary.cos.is_contiguous()
                or not rotary.sin_signed.is_contiguous()
                or (q_weight is not None and (k_weight is None or k_weight.dtype != q_weight.dtype
                                              or not q_weight.is_contiguous() or not k_weight.is_contiguous()))):
            return TORCH_OPS.qk_norm_rope_store(q, k, v, q_weight, k_weight, qk_weight, rotary, positions, k_cache,
                                                v_cache, slots, eps)  # fmt: skip
        Hq = q.shape[1] // D
        q_out = torch.empty((T, Hq, D), dtype=q.dtype)
        _core.qk_norm_rope_store(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), fmt, T, Hq, Hkv, D,
            0 if q_weight is None else q_weight.data_ptr(), 0 if k_weight is None else k_weight.data_ptr(), wfmt,
            float(eps), rotary.cos.data_ptr(), rotary.sin_signed.data_ptr(), rotary.cos.shape[0],
            positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_fmt, nb * bs,
            q_out.data_ptr(),
        )
        return q_out

    def bias_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rotary: Rotary,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        fmt, kv_fmt = _FMT.get(q.dtype), _FMT.get(k_cache.dtype)
        T = q.shape[0]
        nb, bs, Hkv, D = k_cache.shape
        if (fmt is None or kv_fmt is None or q.dim() != 2 or k.dtype != q.dtype or v.dtype != q.dtype
                or not (_row_major(q) and _row_major(k) and _row_major(v)) or not k_cache.is_contiguous()
                or not v_cache.is_contiguous() or v_cache.dtype != k_cache.dtype or positions.dtype != torch.int64
                or slots.dtype != torch.int64 or not positions.is_contiguous() or not slots.is_contiguous()
                or rotary.cos.dtype != torch.float32 or not rotary.cos.is_contiguous()
                or not rotary.sin_signed.is_contiguous()
                or (bias is not None and not all(b.dtype == torch.float32 and b.is_contiguous()
                                                 and b.device.type == "cpu" for b in bias))):
            return super().bias_rope_store(q, k, v, bias, rotary, cos, sin, positions, k_cache, v_cache, slots)
        Hq = q.shape[1] // D
        q_out = torch.empty((T, Hq, D), dtype=q.dtype)
        qb, kb, vb = (0, 0, 0) if bias is None else (b.data_ptr() for b in bias)
        _core.qk_norm_rope_store(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), fmt, T, Hq, Hkv, D,
            0, 0, int(Fmt.F32), 0.0, rotary.cos.data_ptr(), rotary.sin_signed.data_ptr(), rotary.cos.shape[0],
            positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_fmt, nb * bs,
            q_out.data_ptr(), qb, kb, vb,
        )
        return q_out

    def moe_bias_add(self, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                     hidden: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        fmt = _FMT.get(y.dtype)
        if (fmt is None or y.dtype != dtype or y.dim() != 2 or not _row_major(y) or y.shape[1] < hidden
                or ids.dtype != torch.int32 or w.dtype != torch.float32 or not ids.is_contiguous()
                or not w.is_contiguous() or ids.shape != w.shape or ids.shape[0] != y.shape[0]
                or bias.dtype != torch.float32 or not bias.is_contiguous() or bias.device.type != "cpu"
                or bias.dim() != 2 or bias.shape[1] != hidden):
            return super().moe_bias_add(y, ids, w, bias, hidden, dtype)
        T, K = ids.shape
        out = torch.empty((T, hidden), dtype=dtype)
        _core.moe_bias_add(y.data_ptr(), y.stride(0), fmt, T, hidden, ids.data_ptr(), w.data_ptr(), K,
                           bias.data_ptr(), bias.shape[0], out.data_ptr())  # fmt: skip
        return out

    def deltanet_decode(self, layer: "GatedDeltaNet", mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        s = layer.shape
        fmt, conv_fmt = _FMT.get(mixed.dtype), _FMT.get(conv_state.dtype)
        wfmt, nfmt = _FMT.get(layer.conv_weight.dtype), _FMT.get(layer.norm.dtype)
        T = mixed.shape[0]
        if (fmt is None or conv_fmt is None or wfmt is None or nfmt is None or mixed.dim() != 2
                or any(t.dtype != mixed.dtype or t.dim() != 2 or not _row_major(t) or t.shape[0] != T
                       for t in (mixed, z, b, a))
                or mixed.shape[1] != s.conv_channels or z.shape[1] != s.value_heads * s.value_dim
                or b.shape[1] != s.value_heads or a.shape[1] != s.value_heads
                or conv_state.device.type != "cpu" or not conv_state.is_contiguous()
                or tuple(conv_state.shape[1:]) != s.conv_state
                or ssm_state.device.type != "cpu" or ssm_state.dtype != torch.float32
                or not ssm_state.is_contiguous() or tuple(ssm_state.shape[1:]) != s.ssm_state
                or slots.device.type != "cpu" or slots.dtype != torch.int64 or not slots.is_contiguous()
                or not layer.conv_weight.is_contiguous() or layer.conv_weight.device.type != "cpu"
                or not layer.norm.is_contiguous() or layer.norm.numel() != s.value_dim
                or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
                       or t.numel() != s.value_heads for t in (layer.A, layer.dt_bias))
                # the padded rows of a decode graph's bucket (GPU sessions over CPU tensors) all
                # take the pool's scratch slot, its last row; the native op updates each slot
                # from one thread and refuses a shared one, so such steps take the torch form
                or (T > 1 and slots.tolist().count(ssm_state.shape[0] - 1) > 1)):
            return super().deltanet_decode(layer, mixed, z, b, a, conv_state, ssm_state, slots)
        out = torch.empty((T, s.value_heads * s.value_dim), dtype=mixed.dtype)
        _core.deltanet_decode(
            mixed.data_ptr(), z.data_ptr(), b.data_ptr(), a.data_ptr(), mixed.stride(0), z.stride(0), b.stride(0),
            a.stride(0), fmt, T, s.key_heads, s.value_heads, s.key_dim, s.value_dim, s.conv_kernel, s.tiled,
            layer.conv_weight.data_ptr(), wfmt, layer.A.data_ptr(), layer.dt_bias.data_ptr(), layer.norm.data_ptr(),
            nfmt, float(layer.eps), slots.data_ptr(), ssm_state.shape[0], conv_state.data_ptr(), conv_fmt,
            ssm_state.data_ptr(), out.data_ptr(), self.pool._core,
        )
        return out

    def router_top_k(self, logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu"
                or not logits.is_contiguous()):
            return TORCH_OPS.router_top_k(logits, k, norm)
        T, E = logits.shape
        ids = torch.empty((T, k), dtype=torch.int32)
        w = torch.empty((T, k), dtype=torch.float32)
        _core.router_top_k(logits.data_ptr(), T, E, k, bool(norm), ids.data_ptr(), w.data_ptr())
        return ids, w


CPU_OPS = CpuDenseOps()

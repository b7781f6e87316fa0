"""The native backends' one-token GEMV over packed blocks (``packed_gemv`` of the extension,
``freetoken/include/freetoken/gpu/packed_gemv.cuh``): Q4_K, Q6_K and Q8_0 rows times the token
quantized to int8 per 32 values, as the Triton int8 dots compute them, in one launch
without Triton's per-weight overhead; with ``packed_gemv_norm`` the decoder's pre-norm and
up to two matrices (q/k and a v of another format) in one launch; with ``packed_moe``
(``freetoken/gpu/packed_moe.cuh``) a decode step's routes through Q4_K/Q6_K/Q8_0/MXFP4 experts
with SiLU or GPT-OSS's clamped SwiGLU in two launches. NVIDIA builds only; a ROCm build has none.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import torch

from freetoken.backends.contract import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, PackedGemv

#: the extension's element type codes
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: the extension's codes of the routed experts' activations (``MOE_ACT_*`` of packed_moe.cuh)
_ACTIVATIONS = {"silu": 0, "swiglu_oai": 2}


class NativePackedGemv(PackedGemv):
    """:class:`~freetoken.backends.contract.PackedGemv` bound to a native extension module."""

    name: ClassVar[str] = "native"
    norm_parts: ClassVar[int] = 2

    def __init__(self, native: Any, current_stream: Any) -> None:
        self.native = native
        self.current_stream = current_stream  # () -> the device's current stream handle

    def refusal(self, fmt: int, cols: int, dtype: Any) -> str:
        if dtype not in _DTYPES:
            return f"activations of {dtype} (float32, float16 or bfloat16 are served)"
        return str(self.native.packed_gemv_refusal(int(fmt), int(cols)))

    def gemv(self, x: Any, data: Any, fmt: int, y: Any) -> None:
        rows, cols = int(y.shape[-1]), int(x.shape[-1])
        if x.numel() != cols or y.numel() != rows or not (x.is_contiguous() and y.is_contiguous()):
            raise ValueError(f"native GEMV: one contiguous token in and out, got x {tuple(x.shape)}, "
                             f"y {tuple(y.shape)}")
        if data.dim() != 2 or int(data.shape[0]) != rows or data.dtype != torch.uint8 or data.stride(1) != 1:
            raise ValueError(f"native GEMV: the weights must be [{rows}, row_bytes] uint8 rows, got "
                             f"{tuple(data.shape)} {data.dtype}")
        if not (x.is_cuda and y.is_cuda and data.is_cuda):
            raise ValueError("native GEMV: x, y and the weights must be on the GPU")
        if y.dtype not in _DTYPES or x.dtype not in _DTYPES:
            raise ValueError(f"native GEMV: x {x.dtype} / y {y.dtype}: float32, float16 or bfloat16 are served")
        self.native.packed_gemv(self.current_stream(), x.data_ptr(), _DTYPES[x.dtype], data.data_ptr(), int(fmt),
                                rows, cols, int(data.stride(0)), y.data_ptr(), _DTYPES[y.dtype])

    def norm_gemv(self, h: Any, delta: Any, weight: Any, eps: float,
                  parts: Sequence[tuple[Any, int]]) -> Optional[tuple[Any, Any, list[Any]]]:  # fmt: skip
        if not hasattr(self.native, "packed_gemv_norm") or not 1 <= len(parts) <= self.norm_parts:
            return None
        vectors = [t for t in (h, delta, weight) if t is not None]
        if (h.dim() != 2 or h.shape[0] != 1 or h.dtype not in _DTYPES
                or any(t.dtype != h.dtype or not t.is_cuda or not t.is_contiguous() or t.numel() != h.numel()
                       or t.data_ptr() % 16 for t in vectors)):
            return None
        cols = int(h.shape[1])
        for data, fmt in parts:
            if self.native.packed_gemv_refusal(int(fmt), cols) or not data.is_cuda or data.dim() != 2 \
                    or data.dtype != torch.uint8 or data.stride(1) != 1:
                return None
        h_out = torch.empty_like(h) if delta is not None else h
        x = torch.empty_like(h)
        ys = [torch.empty(1, int(data.shape[0]), dtype=h.dtype, device=h.device) for data, _ in parts]
        (wa, fa), yb = parts[0], ys[1] if len(parts) > 1 else None
        wb, fb = parts[1] if len(parts) > 1 else (wa, fa)
        self.native.packed_gemv_norm(
            self.current_stream(), h.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
            float(eps), h_out.data_ptr() if delta is not None else 0, x.data_ptr(), _DTYPES[h.dtype], cols,
            wa.data_ptr(), int(fa), int(wa.shape[0]), int(wa.stride(0)), ys[0].data_ptr(),
            wb.data_ptr(), int(fb), int(wb.shape[0]) if yb is not None else 0, int(wb.stride(0)),
            yb.data_ptr() if yb is not None else 0)  # fmt: skip
        return h_out, x, ys

    @property
    def serves_experts(self) -> bool:
        return hasattr(self.native, "packed_moe")

    def experts_refusal(self, formats: tuple[int, int, int], hidden: int, intermediate: int, top_k: int,
                        activation: str, dtype: Any) -> str:  # fmt: skip
        if not self.serves_experts:
            return "this build of the extension has no packed_moe"
        if activation not in _ACTIVATIONS:
            return f"activation {activation!r} (served: {', '.join(_ACTIVATIONS)})"
        if dtype is not None and dtype not in _DTYPES:
            return f"activations of {dtype} (float32, float16 or bfloat16 are served)"
        return str(self.native.packed_moe_refusal(*(int(f) for f in formats), int(hidden), int(intermediate),
                                                  int(top_k), _ACTIVATIONS[activation]))

    def experts(self, x: Any, ids: Any, w: Any, stacks: Sequence[Any], y: Any, table: Any = None,
                activation: str = "silu") -> None:  # fmt: skip
        gate, up, down = stacks
        tokens, top_k = (int(s) for s in ids.shape)
        hidden, inter = int(gate.cols), int(gate.rows)
        if tuple(x.shape) != (tokens, hidden) or tuple(y.shape) != (tokens, hidden) or tuple(w.shape) != (tokens, top_k):
            raise ValueError(f"native experts: x {tuple(x.shape)}, ids {tuple(ids.shape)}, w {tuple(w.shape)}, "
                             f"y {tuple(y.shape)}: expected [T, {hidden}], [T, K], [T, K], [T, {hidden}]")
        if not all(t.is_contiguous() and t.is_cuda for t in (x, ids, w, y)):
            raise ValueError("native experts: x, ids, w and y must be contiguous tensors on the GPU")
        if ids.dtype not in (torch.int32, torch.int64) or w.dtype not in _DTYPES or x.dtype not in _DTYPES \
                or y.dtype not in _DTYPES:
            raise ValueError(f"native experts: ids {ids.dtype} (int32/int64), w {w.dtype}, x {x.dtype}, y {y.dtype} "
                             "(float32, float16 or bfloat16)")
        if table is not None and (table.dtype != torch.int32 or not table.is_contiguous() or not table.is_cuda):
            raise ValueError(f"native experts: the slot table must be a contiguous int32 tensor on the GPU, got "
                             f"{table.dtype}")
        scratch = torch.empty(int(self.native.packed_moe_scratch_bytes(tokens * top_k, inter)), dtype=torch.uint8,
                              device=x.device)
        self.native.packed_moe(
            self.current_stream(), x.data_ptr(), _DTYPES[x.dtype], tokens, ids.data_ptr(), int(ids.dtype == torch.int64),
            0 if table is None else table.data_ptr(), w.data_ptr(), _DTYPES[w.dtype], top_k,
            gate.data.data_ptr(), int(gate.fmt), up.data.data_ptr(), int(up.fmt), down.data.data_ptr(), int(down.fmt),
            hidden, inter, _ACTIVATIONS[activation], SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, scratch.data_ptr(), y.data_ptr(),
            _DTYPES[y.dtype])  # fmt: skip

"""The native backends' one-token GEMV over packed blocks (``packed_gemv`` of the extension,
``freetoken/include/freetoken/gpu/packed_gemv.cuh``): Q4_K and Q6_K rows times the token
quantized to int8 per 32 values, as the Triton int8 dots compute them, in one launch
without Triton's per-weight overhead. NVIDIA builds only; a ROCm build has none.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from freetoken.backends.contract import PackedGemv

#: the extension's element type codes
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class NativePackedGemv(PackedGemv):
    """:class:`~freetoken.backends.contract.PackedGemv` bound to a native extension module."""

    name: ClassVar[str] = "native"

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

"""A checkpoint tensor as stored in its file: raw (possibly packed) bytes plus format.

Loaders (:mod:`freetoken.loading.hf`, :mod:`freetoken.loading.gguf`) hand the model
code :class:`RawTensor` objects that reference memory-mapped file data without
copying it. The model decides per tensor whether it stays packed (and runs through
``freetoken_cpu_moe``) or is turned into a float torch tensor.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Optional, Protocol

import numpy as np
import torch

from freetoken.handoff import Fmt

#: Block geometry of the packed formats: (values per block, bytes per block).
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    int(Fmt.Q8_0): (32, 34),
    int(Fmt.Q4_K): (256, 144),
    int(Fmt.Q5_K): (256, 176),
    int(Fmt.Q6_K): (256, 210),
    int(Fmt.MXFP4): (32, 17),
}

#: Element sizes of the plain formats.
ELEMENT_SIZES: dict[int, int] = {
    int(Fmt.F32): 4,
    int(Fmt.F16): 2,
    int(Fmt.BF16): 2,
    int(Fmt.FP8_E4M3_B128): 1,
}

_TORCH_FMT = {torch.float32: Fmt.F32, torch.float16: Fmt.F16, torch.bfloat16: Fmt.BF16}


def fmt_name(fmt: int) -> str:
    try:
        return Fmt(fmt).name.lower()
    except ValueError:
        return f"ggml type {fmt}"


def is_packed(fmt: int) -> bool:
    """Block-quantized (GGUF) formats."""
    return int(fmt) in BLOCK_SIZES


def row_bytes(fmt: int, cols: int) -> int:
    """Bytes one row of ``cols`` values takes in ``fmt``."""
    fmt = int(fmt)
    if fmt in BLOCK_SIZES:
        per, nbytes = BLOCK_SIZES[fmt]
        if cols % per:
            raise ValueError(f"{fmt_name(fmt)} needs rows that are a multiple of {per} values, got {cols}")
        return cols // per * nbytes
    if fmt in ELEMENT_SIZES:
        return cols * ELEMENT_SIZES[fmt]
    raise ValueError(f"unsupported tensor format {fmt_name(fmt)}")


@dataclasses.dataclass
class RawTensor:
    """One tensor of a checkpoint, referenced in place.

    ``shape`` is the logical row-major shape (``[rows, cols]`` for a matrix, HF
    order; GGUF shapes are reversed from ggml's ``ne`` order into this). ``data`` is
    a numpy array or CPU torch tensor over the file bytes: for packed formats a
    uint8 array whose last dimension is the packed row; for float formats an array of
    the elements (bf16 as uint16 / torch.bfloat16). ``scale`` holds the block scales
    of FP8 block-quantized weights (``weight_scale_inv``).
    """

    name: str
    shape: tuple[int, ...]
    fmt: int
    data: Any
    source: str = ""
    scale: Any = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return ELEMENT_SIZES.get(int(self.fmt), 4)
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        n = rows * row_bytes(self.fmt, self.shape[-1])
        if self.scale is not None:
            n += int(self.scale.numel() * self.scale.element_size()) if isinstance(self.scale, torch.Tensor) else int(self.scale.nbytes)
        return n

    def raw_torch(self) -> torch.Tensor:
        """The stored bytes/elements as a CPU torch tensor (no copy)."""
        d = self.data
        if isinstance(d, torch.Tensor):
            return d
        arr = np.asarray(d)
        if arr.flags.writeable:
            return torch.from_numpy(arr)
        # Read-only file mappings: torch warns that writes would be undefined; weight
        # memory is never written, so take the zero-copy view without the warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize (or view) into a float torch tensor of ``shape`` (a copy unless
        the stored dtype already equals ``dtype``)."""
        fmt = int(self.fmt)
        if fmt in BLOCK_SIZES:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            arr = dequantize(np.asarray(self.data), GGMLQuantizationType(fmt))
            return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.shape).to(dtype)
        t = self.raw_torch()
        if fmt == Fmt.BF16 and t.dtype != torch.bfloat16:
            t = t.view(torch.bfloat16)
        if fmt == Fmt.FP8_E4M3_B128:
            return _dequant_fp8(t, self.scale).reshape(self.shape).to(dtype)
        t = t.reshape(self.shape)
        return t if t.dtype == dtype else t.to(dtype)

    def rows_to_float(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize only the rows ``idx`` of a matrix (embedding lookups)."""
        fmt = int(self.fmt)
        if fmt in BLOCK_SIZES:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            rows = np.asarray(self.data)[idx.cpu().numpy()]
            arr = dequantize(rows, GGMLQuantizationType(fmt))
            return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype)
        return self.to_float(dtype)[idx]


def _dequant_fp8(w: torch.Tensor, scale: Optional[torch.Tensor], block: int = 128) -> torch.Tensor:
    w = w.view(torch.float8_e4m3fn).to(torch.float32)
    if scale is None:
        return w
    s = scale.to(torch.float32)
    *lead, rows, cols = w.shape
    s = s.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]
    return w * s


def torch_fmt(dtype: torch.dtype) -> Fmt:
    try:
        return _TORCH_FMT[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}") from None


class TensorSource(Protocol):
    """What a loader gives the model: named raw tensors."""

    def names(self) -> Iterable[str]: ...

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> RawTensor: ...

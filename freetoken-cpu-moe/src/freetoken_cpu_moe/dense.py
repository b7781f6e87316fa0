"""The CPU backend's weight policy: dense projections read in their checkpoint format.

A projection whose checkpoint format is not the activation dtype (GGUF blocks, BF16/FP16/FP8
in an FP32 run) stays in its file format and runs through :func:`freetoken_cpu_moe.linear`
-- a dense projection is a one-expert layer -- because decode reads every byte of it per
token and a dequantized copy would multiply those bytes. Small tensors (norms, biases) become
float tensors; the router runs on the worker pool as an F32 projection; a packed embedding
table stays packed (rows are dequantized as tokens need them).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Optional

import numpy as np
import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.handoff import Fmt
from freetoken.loading.host_pages import huge_empty
from freetoken.loading.memory import available_ram, gib
from freetoken.loading.tensors import RawTensor
from freetoken.models.layers import Embedding, TorchLinear
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.ops import linear as _linear
from freetoken_cpu_moe.pool import Pool, default_pool
from freetoken_cpu_moe.weights import Weights

log = logging.getLogger(__name__)

#: RAM (bytes) a huge-page copy of weights must leave available (MemAvailable after the copy)
HUGE_COPY_RESERVE = 4 << 30

FORMAT_NAMES = {
    int(Fmt.F32): "f32",
    int(Fmt.F16): "f16",
    int(Fmt.BF16): "bf16",
    int(Fmt.FP8_E4M3_B128): "fp8_e4m3_b128",
    int(Fmt.Q8_0): "q8_0",
    int(Fmt.Q4_K): "q4_k",
    int(Fmt.Q5_K): "q5_k",
    int(Fmt.Q6_K): "q6_k",
    int(Fmt.MXFP4): "mxfp4",
}


#: FT_FMT_* of the activation dtypes the kernels take
ACT_FMT = {torch.float32: int(Fmt.F32), torch.bfloat16: int(Fmt.BF16), torch.float16: int(Fmt.F16)}


def file_mapped(data: Any) -> bool:
    """Whether ``data`` (a RawTensor's data) is a view of a memory-mapped file."""
    obj = data
    while isinstance(obj, np.ndarray):
        if isinstance(obj, np.memmap):
            return True
        obj = obj.base
    return isinstance(obj, mmap.mmap)


def huge_page_copy(raw: RawTensor) -> Optional[torch.Tensor]:
    """The tensor's bytes copied into 2 MiB pages (:func:`freetoken.loading.host_pages.huge_empty`)
    when they sit in a file mapping (4 KiB pages: a page walk every 4 KiB of a stream that
    decode reads once per token) and the copy leaves at least :data:`HUGE_COPY_RESERVE` of
    RAM available; else None (read in place)."""
    if not file_mapped(raw.data):
        return None
    src = raw.raw_torch()
    nbytes = src.numel() * src.element_size()
    avail = available_ram()
    if avail is None or avail - nbytes < HUGE_COPY_RESERVE:
        log.info("%s: read in place from the file mapping (%s available, a copy needs %s + %s)", raw.name,
                 "?" if avail is None else gib(avail), gib(nbytes), gib(HUGE_COPY_RESERVE))
        return None
    out = huge_empty(tuple(src.shape), src.dtype)
    out.copy_(src)
    return out


def weights_of(raw: RawTensor, num_experts: int, rows: int, cols: int, huge_pages: bool = False) -> Weights:
    """A :class:`Weights` over the tensor's own bytes (no copy; ``huge_pages``: a copy in huge
    pages where :func:`huge_page_copy` makes one)."""
    try:
        fmt = FORMAT_NAMES[int(raw.fmt)]
    except KeyError:
        raise ValueError(f"{raw.source}: {raw.name} has a format the CPU kernels do not read ({raw.fmt})") from None
    data = huge_page_copy(raw) if huge_pages else None
    return Weights(raw.raw_torch() if data is None else data, fmt, num_experts, rows, cols, scale=raw.scale)


class PackedLinear:
    """A projection kept in its checkpoint format, run by the CPU kernels."""

    packed = True

    def __init__(self, raw: RawTensor, pool: Pool, out_dtype: Optional[torch.dtype] = None,
                 huge_pages: bool = False) -> None:  # fmt: skip
        rows, cols = raw.shape
        self.out_features, self.in_features = rows, cols
        self.fmt = int(raw.fmt)
        self.nbytes = raw.nbytes
        self._raw = raw  # keeps the mapping alive
        self.weights = weights_of(raw, 1, rows, cols, huge_pages)
        self._pool = pool
        self._out_dtype = out_dtype
        self._address = self.weights.address

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the engine's activations (2-D, contiguous, a kernel dtype) go straight to the kernel:
        # a decode step makes ~4 of these calls per layer, the checks of ops.linear cost more
        # than the call itself
        out_dtype = self._out_dtype or x.dtype
        fmt, out_fmt = ACT_FMT.get(x.dtype), ACT_FMT.get(out_dtype)
        if (fmt is None or out_fmt is None or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu"
                or x.shape[1] != self.in_features):
            return _linear(self.weights, x, out_dtype, self._pool)
        y = torch.empty((x.shape[0], self.out_features), dtype=out_dtype)
        _core.linear(self._address, x.data_ptr(), fmt, x.shape[0], y.data_ptr(), out_fmt, False, self._pool._core, "")
        return y


class DualLinear:
    """An FP32 projection: few rows (decode) through the CPU kernels' worker pool, many
    rows (prefill) through torch's GEMM; both read the same memory-mapped weight, no copy."""

    packed = True

    def __init__(self, raw: RawTensor, pool: Pool, max_kernel_rows: int = 16) -> None:
        self.torch = TorchLinear(raw.to_float(torch.float32))
        self.packed_lin = PackedLinear(raw, pool)
        self.out_features, self.in_features = self.torch.out_features, self.torch.in_features
        self.nbytes = self.torch.nbytes
        self.max_kernel_rows = max_kernel_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_kernel_rows:
            return self.packed_lin(x)
        return self.torch(x)


class GroupLinear:
    """Projections of the same input stacked along their rows (a layer's q/k/v, whatever
    their formats): for a few tokens one native call, one wake-up of the pool
    (``linear_group``: the input prepared once per activation kind, every matrix's row
    pieces handed out from one list, outputs side by side in one ``[T, sum of rows]``
    tensor); for more (prefill) each part runs as it would alone (the kernels' matrix path,
    or torch's GEMM for float32 weights) and the outputs are concatenated."""

    packed = True

    def __init__(self, parts: list[Any], pool: Pool, max_group_tokens: int = 7) -> None:
        self.parts = parts
        sizes = [p.out_features for p in parts]
        self.out_features, self.in_features = sum(sizes), parts[0].in_features
        self.nbytes = sum(p.nbytes for p in parts)
        self.max_group_tokens = max_group_tokens
        self._weights = [p.weights if isinstance(p, PackedLinear) else p.packed_lin.weights for p in parts]
        self._descs = np.array([w.address for w in self._weights], dtype=np.uint64)
        self._cols = np.array(np.cumsum([0] + sizes[:-1]), dtype=np.uint64)
        self._pool = pool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fmt = ACT_FMT.get(x.dtype)
        T = x.shape[0] if x.dim() == 2 else 0
        if (fmt is None or T == 0 or T > self.max_group_tokens or not x.is_contiguous() or x.device.type != "cpu"
                or x.shape[1] != self.in_features):
            return torch.cat([p(x) for p in self.parts], dim=-1)
        y = torch.empty((T, self.out_features), dtype=x.dtype)
        _core.linear_group(self._descs.ctypes.data, len(self.parts), x.data_ptr(), fmt, T, y.data_ptr(), fmt,
                           self.out_features, self._cols.ctypes.data, self._pool._core, "")  # fmt: skip
        return y


def kernel_desc(lin: Any) -> tuple[Optional[int], int]:
    """The one-expert descriptor address of a packed projection and the most tokens for which
    its call runs them through the kernels (None: not a kernel projection)."""
    if isinstance(lin, PackedLinear) and lin._out_dtype is None:
        return lin._address, 1 << 30
    if isinstance(lin, DualLinear):
        return lin.packed_lin._address, lin.max_kernel_rows
    return None, 0


class HeadLinear:
    """``y[t, h] = W[h] @ x[t, h]`` for a ``[heads, out, in]`` weight kept as stored: multi-head
    latent attention's absorbed up-projections (``attn_k_b`` takes a query head into latent
    space, ``attn_v_b`` a head's latent output back to its values). The tensor is a bank of
    one-matrix "experts", one per head, and every head's product runs in one call of the
    worker pool (``_core.linear_heads``), so a decode step reads the matrices once in their
    file format (Q8_0: about a quarter of float32's bytes) instead of a dequantized copy."""

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


class CpuWeightPolicy(WeightPolicy):
    """Dense weights in host memory, packed where the file is packed (see the module doc)."""

    def __init__(self, dtype: torch.dtype, pool: Optional[Pool] = None, huge_pages: bool = False) -> None:
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.pool = pool or default_pool()
        #: packed projections that sit in a file mapping are copied into huge pages (huge_page_copy)
        self.huge_pages = huge_pages

    def tensor(self, raw: RawTensor) -> torch.Tensor:
        return raw.to_float(self.dtype)

    def linear(self, raw: RawTensor) -> Any:
        if len(raw.shape) != 2:
            raise ValueError(f"{raw.source}: {raw.name} should be a matrix, has shape {raw.shape}")
        fmt = int(raw.fmt)
        if fmt == Fmt.F32 and self.dtype == torch.float32:
            return DualLinear(raw, self.pool)
        if fmt in FORMAT_NAMES:
            return PackedLinear(raw, self.pool, huge_pages=self.huge_pages)
        return TorchLinear(raw.to_float(self.dtype))

    def stacked_linear(self, raws: list[RawTensor]) -> Optional[GroupLinear]:
        parts = [self.linear(raw) for raw in raws]
        if all(isinstance(p, (PackedLinear, DualLinear)) for p in parts):
            return GroupLinear(parts, self.pool)
        return None

    def head_linear(self, raw: RawTensor) -> Any:
        if int(raw.fmt) not in FORMAT_NAMES or self.dtype not in ACT_FMT:
            return None
        return HeadLinear(raw, self.pool, huge_pages=self.huge_pages)

    def router(self, raw: RawTensor) -> Any:
        # a small dense projection: an F32 copy run on the same worker pool, float32 logits
        rows, cols = raw.shape
        f32 = raw.to_float(torch.float32).contiguous()
        return PackedLinear(RawTensor(raw.name, (rows, cols), Fmt.F32, f32, raw.source), self.pool, torch.float32)

    def embedding(self, raw: RawTensor) -> Embedding:
        return Embedding(raw, self.device, self.dtype, keep_packed=True)

    def describe(self) -> dict[str, Any]:
        return {"dense": "packed formats read in place by freetoken_cpu_moe kernels; float formats as stored",
                "embedding": "packed rows dequantized on demand"}

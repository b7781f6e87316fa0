"""Building blocks shared by the model families: linears, norms, rotary embeddings,
and :class:`DeviceWeightPolicy`, the weight policy that dequantizes the dense part onto
a device (backends whose dense weights stay packed bring their own policy through
:meth:`freetoken.backends.contract.ModelSession.weight_policy`; the GPU session keeps a GGUF
file's block formats packed on the device with
:class:`freetoken.models.packed_linear.PackedWeightPolicy` when memory is short)."""

from __future__ import annotations

import collections
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.tensors import RawTensor, is_packed

logger = logging.getLogger(__name__)

class TorchLinear:
    """``y = x @ W.T`` with a float weight on the dense device."""

    packed = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedLinears:
    """Several projections of the same input (q/k/v) run as few calls as possible: all
    of them as one matrix when the policy stacks any formats (:meth:`WeightPolicy.stacked_linear`,
    e.g. dequantized at load), else consecutive matrices with the same format concatenated
    along their rows once at load time (one copy of those bytes); split after the matmul."""

    def __init__(self, raws: list[RawTensor], policy: WeightPolicy) -> None:
        self.groups: list[tuple[Any, list[int]]] = []
        if len(raws) > 1 and len({r.shape[1:] for r in raws}) == 1:
            stacked = policy.stacked_linear(raws)
            if stacked is not None:  # e.g. dequantized at load: one matmul whatever the file formats
                self.groups.append((stacked, [r.shape[0] for r in raws]))
                self.nbytes = stacked.nbytes
                return
        i = 0
        while i < len(raws):
            j = i + 1
            while (j < len(raws) and raws[j].fmt == raws[i].fmt and raws[j].shape[1:] == raws[i].shape[1:]
                   and raws[j].scale is None and raws[i].scale is None):
                j += 1
            part = raws[i:j]
            if len(part) == 1:
                lin = policy.linear(part[0])
            else:
                data = torch.cat([r.raw_torch() for r in part], 0)
                rows = sum(r.shape[0] for r in part)
                lin = policy.linear(RawTensor("+".join(r.name for r in part), (rows, *part[0].shape[1:]),
                                              part[0].fmt, data, part[0].source))
            self.groups.append((lin, [r.shape[0] for r in part]))
            i = j
        self.nbytes = sum(lin.nbytes for lin, _ in self.groups)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self._split([lin(x) for lin, _ in self.groups])

    def _split(self, ys: list[torch.Tensor]) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for y, (_, sizes) in zip(ys, self.groups):
            if len(sizes) == 1:
                outs.append(y)
            else:
                outs.extend(y.split(sizes, dim=-1))
        return outs

    def add_norm_call(self, ops: Any, h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """The residual ``h + delta`` and these projections of its RMSNorm (times ``weight``):
        for one token through two or more groups that a backend's one-token GEMV serves
        (a packed linear's ``native``, :class:`~freetoken.backends.contract.PackedGemv`), its
        :meth:`~freetoken.backends.contract.PackedGemv.norm_gemv` (the norm and every group
        in one launch); else ``ops.add_rms_norm`` and a call per group. One group stays
        separate: measured on the H200 (Qwen3-30B-A3B's q/k/v as one Q4_K matrix, graph
        replay), the norm inside the GEMV took 8.21 us against 7.99 for the two launches; a
        Q4_K q/k with a Q6_K v took 7.85 us against 10.50 for three."""
        lins = [lin for lin, _ in self.groups]
        native = getattr(lins[0], "native", None)
        if (native is not None and h.dim() == 2 and h.shape[0] == 1 and 2 <= len(lins) <= native.norm_parts
                and all(getattr(lin, "native", None) is native for lin in lins)):
            fused = native.norm_gemv(h, delta, weight, eps, [(lin.data, lin.fmt) for lin in lins])
            if fused is not None:
                h_new, _, ys = fused
                return h_new, self._split(ys)
        h, x = ops.add_rms_norm(h, delta, weight, eps)
        return h, self(x)


class Embedding:
    """Token embedding lookup: a float table, or packed rows dequantized on demand
    (a packed table stays packed; recently used rows are kept in a small cache, since
    dequantizing a row through gguf-py costs a few hundred microseconds)."""

    def __init__(self, raw: RawTensor, device: torch.device, dtype: torch.dtype, keep_packed: bool,
                 cache_rows: int = 8192) -> None:
        self.raw = raw
        self.dtype = dtype
        self.device = device
        self.table: Optional[torch.Tensor] = None
        self.cache: "collections.OrderedDict[int, torch.Tensor]" = collections.OrderedDict()
        self.cache_rows = cache_rows
        if not (keep_packed and is_packed(raw.fmt)):
            self.table = raw.to_float(dtype).to(device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[ids]
        keys = ids.tolist()
        missing = sorted({t for t in keys if t not in self.cache})
        if missing:
            rows = self.raw.rows_to_float(torch.tensor(missing, dtype=torch.int64), self.dtype).to(self.device)
            for t, row in zip(missing, rows):
                self.cache[t] = row
        out = torch.stack([self.cache[t] for t in keys])
        for t in keys:
            self.cache.move_to_end(t)
        while len(self.cache) > self.cache_rows:
            self.cache.popitem(last=False)
        return out

    def cached_row(self, token: int) -> Optional[torch.Tensor]:
        """A packed table's dequantized row of ``token`` if the row cache holds it, marked as
        just used as a lookup marks it; else None (the row is dequantized by a lookup)."""
        row = self.cache.get(token)
        if row is not None:
            self.cache.move_to_end(token)
        return row


class DeviceWeightPolicy(WeightPolicy):
    """Every dense weight dequantized once, at load, to the activation dtype on the dense
    device, and run by torch (``F.linear``). The policy of GPU backends: a GPU reads a
    dequantized matrix at HBM bandwidth, and the dense part is a small share of a MoE
    model (for Qwen3-30B-A3B about 3.1 GB in BF16 against 1.0 GB as Q4_K). An
    embedding table whose file format is packed stays packed in host memory when
    ``packed_embedding`` is set (rows are dequantized as tokens need them)."""

    def __init__(self, device: Any, dtype: torch.dtype, packed_embedding: bool = False) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.packed_embedding = packed_embedding

    def tensor(self, raw: RawTensor) -> torch.Tensor:
        return raw.to_float(self.dtype).to(self.device)

    def linear(self, raw: RawTensor) -> TorchLinear:
        _check_matrix(raw)
        return TorchLinear(raw.to_float(self.dtype).to(self.device))

    def router(self, raw: RawTensor) -> "RouterLinear":
        _check_matrix(raw)
        return RouterLinear(raw.to_float(torch.float32).to(self.device))

    def stacked_linear(self, raws: list[RawTensor]) -> TorchLinear:
        for raw in raws:
            _check_matrix(raw)
        return TorchLinear(torch.cat([raw.to_float(self.dtype).to(self.device) for raw in raws]))

    def embedding(self, raw: RawTensor) -> Embedding:
        return Embedding(raw, self.device, self.dtype, keep_packed=self.packed_embedding)

    def describe(self) -> dict[str, Any]:
        return {"dense": f"dequantized to {str(self.dtype).replace('torch.', '')} on {self.device} at load",
                "embedding": "packed rows in host memory" if self.packed_embedding else "table on the device",
                "dense_form": "dequantized"}


class RouterLinear(TorchLinear):
    """A float32 router: logits in float32 whatever the activation dtype.

    On a GPU where Triton runs, a decode step's few tokens (up to :attr:`gemv_tokens`) take
    one Triton GEMV (``kernels.dense_ops.router_logits``) that reads the activations as they
    are, instead of a float32 copy of them and cuBLAS's GEMV (three launches per layer)."""

    #: the most tokens the Triton GEMV takes (more: a float32 matmul)
    gemv_tokens = 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and x.dim() == 2 and x.shape[0] <= self.gemv_tokens and self.weight.is_contiguous()
                and self._triton(x.device)):
            from freetoken.kernels.dense_ops import router_logits

            out = torch.empty(x.shape[0], self.weight.shape[0], dtype=torch.float32, device=x.device)
            router_logits(x.contiguous(), self.weight, out)
            return out
        return F.linear(x.float(), self.weight)

    @staticmethod
    def _triton(device: torch.device) -> bool:
        from freetoken.backends import triton_target

        return triton_target.for_device(device).usable


class BiasedRouter:
    """Router logits ``x W^T + b`` in float32 (GPT-OSS's router)."""

    def __init__(self, linear: object, bias: torch.Tensor) -> None:
        self.linear = linear
        self.bias = bias
        self.nbytes = linear.nbytes + bias.numel() * 4  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias  # type: ignore[operator]


def _check_matrix(raw: RawTensor) -> None:
    if len(raw.shape) != 2:
        raise ValueError(f"{raw.source}: {raw.name} should be a matrix, has shape {raw.shape}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in FP32 (as HF does), returned in ``x``'s dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the decode path
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``[T, heads, head_dim]`` with a per-head weight
    ``[heads, head_dim]`` (q and k heads normalised in one go)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """NeoX-style rotary embeddings (rotate-half), cos/sin tables cached per position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.half = head_dim // 2
        sign = torch.cat((-torch.ones(self.half), torch.ones(self.half)))
        self.cos = emb.cos().to(device)
        # sin with the rotate-half sign folded in: rotate_half(x) * sin == roll(x) * sin_signed
        self.sin_signed = (emb.sin() * sign).to(device)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions``, shaped ``[T, 1, head_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x`` of shape ``[T, heads, head_dim]``."""
        return torch.addcmul(x * cos, x.roll(self.half, dims=-1), sin_signed)

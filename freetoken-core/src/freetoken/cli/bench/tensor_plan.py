"""The tensors of a synthetic GGUF before they are written: each one's name, shape, format
(llama.cpp's Q4_K_M rules: :func:`tensor_format`; K-quant rows that are no multiple of 256
values fall back to Q8_0: :func:`row_format`) and how its bytes are drawn (:class:`Planned`),
shared by ``freetoken bench make-model`` and its per-family plans."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from freetoken.handoff import Fmt
from freetoken.loading.tensors import row_bytes
from freetoken.models.gguf_writer import RandomBlockPool

QUANTS = ("q4_k_m", "q8_0", "q4_k", "q6_k", "mxfp4")
MXFP4 = 39  # ggml type id


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_format(quant: str, role: str, layer: int, n_layers: int) -> int:
    if quant == "q8_0":
        return Fmt.Q8_0
    if quant == "q4_k":
        return Fmt.Q4_K
    if quant == "q6_k":
        return Fmt.Q6_K
    # q4_k_m
    if role == "output":
        return Fmt.Q6_K
    if role in ("attn_v", "attn_qkv", "ffn_down_exps", "ffn_down_shexp") and use_more_bits(layer, n_layers):
        return Fmt.Q6_K
    return Fmt.Q4_K


@dataclasses.dataclass
class Planned:
    name: str
    shape: tuple[int, ...]  # row-major
    fmt: int
    make: Callable[[np.random.Generator, RandomBlockPool], np.ndarray]
    gain: float = 1.0  # packed blocks: scale of the block scales (the residual branches' outputs are smaller)

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        if self.fmt == MXFP4:
            return rows * self.shape[-1] // 32 * 17
        return rows * row_bytes(self.fmt, self.shape[-1])


#: how a planned tensor's bytes are drawn
Maker = Callable[[np.random.Generator, RandomBlockPool], np.ndarray]


def f32_values(shape: tuple[int, ...], mean: float, std: float) -> Maker:
    return lambda rng, pool: (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def uniform_values(shape: tuple[int, ...], lo: float, hi: float) -> Maker:
    return lambda rng, pool: rng.uniform(lo, hi, size=shape).astype(np.float32)


def packed_blocks(shape: tuple[int, ...], fmt: int, gain: float = 1.0) -> Maker:
    rows = int(np.prod(shape[:-1]))
    return lambda rng, pool: pool.blocks(fmt, rows, shape[-1], gain).reshape(*shape[:-1], -1)


#: the block-scale gain of the matrices that write into the residual stream (attention
#: output, expert down projections): with weights of one scale everywhere each layer's
#: output is ~10x the token embedding; scaled down, the token's own embedding keeps a
#: larger share of the hidden state (on its own this did not spread the deeper layers'
#: routing over the experts; the sharper attention below did)
RESIDUAL_GAIN = 0.1
#: the q/k RMSNorm weights' mean: attention logits of standard deviation ~4, so each query
#: attends to a few positions instead of averaging the whole context (near-uniform
#: attention gives every position the context's mean value vector, the same for all tokens,
#: and the routers then pick the same few experts for every token)
QK_NORM_GAIN = 4.0



_K_QUANTS = (int(Fmt.Q4_K), int(Fmt.Q5_K), int(Fmt.Q6_K))


def row_format(fmt: int, cols: int) -> int:
    """``fmt``, or Q8_0 for a K-quant whose rows are no multiple of its 256-value blocks."""
    return int(Fmt.Q8_0) if int(fmt) in _K_QUANTS and cols % 256 else fmt


class TensorList:
    """A family's plan being written: :meth:`add` appends a tensor (a K-quant whose rows are no
    multiple of 256 values falls back to Q8_0; bytes drawn as packed blocks unless ``make``
    says otherwise), :meth:`fmt` is the format llama.cpp's rules give a role in a layer."""

    def __init__(self, quant: str, n_layers: int) -> None:
        self.quant, self.n_layers = quant, n_layers
        self.tensors: list[Planned] = []

    def add(self, name: str, shape: tuple[int, ...], fmt: int, make: "Maker | None" = None, gain: float = 1.0) -> None:
        fmt = row_format(fmt, shape[-1])
        self.tensors.append(Planned(name, shape, fmt, make or packed_blocks(shape, fmt, gain), gain))

    def fmt(self, role: str, layer: int) -> int:
        return tensor_format(self.quant, role, layer, self.n_layers)

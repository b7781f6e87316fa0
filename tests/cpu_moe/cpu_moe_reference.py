"""Independent references for the CPU MoE tests.

Weights are generated in each format's raw layout and dequantized by an
independent decoder: numpy for the float formats, torch's float8_e4m3fn for FP8,
gguf-py (``gguf.quants``) for Q8_0, the K-quants and MXFP4. The MoE reference is plain
float64 numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

BLOCK = {"q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256, "mxfp4": 32}
BLOCK_BYTES = {"q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210, "mxfp4": 17}
# byte offsets of the fp16 super-block scales (d, dmin) inside a K-quant block
FP16_FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


@dataclass
class RawWeights:
    fmt: str
    data: np.ndarray  # raw bytes in the format's layout
    scale: Optional[np.ndarray]  # fp8 block scales
    dense: np.ndarray  # float64 [E][rows][cols], the independent dequantization


def _gguf() -> Any:
    """gguf-py, the independent decoder of the GGUF formats (skip the test without it)."""
    import pytest

    return pytest.importorskip("gguf", reason="gguf (gguf-py) is needed for the GGUF-format references")


def _gguf_type(fmt: str) -> Any:
    Q = _gguf().GGMLQuantizationType

    return {"q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "mxfp4": Q.MXFP4}[fmt]


def gguf_dequantize(raw: np.ndarray, fmt: str, E: int, rows: int, cols: int) -> np.ndarray:
    quants = _gguf().quants

    flat = quants.dequantize(raw.reshape(E * rows, -1), _gguf_type(fmt))
    return np.asarray(flat, dtype=np.float64).reshape(E, rows, cols)


def make_weights(fmt: str, E: int, rows: int, cols: int, rng: np.random.Generator, std: float) -> RawWeights:
    """Random weights of about `std` in `fmt`, with their independent float64 decoding."""
    if fmt == "f32":
        a = (rng.standard_normal((E, rows, cols)) * std).astype(np.float32)
        return RawWeights(fmt, a, None, a.astype(np.float64))
    if fmt == "f16":
        a = (rng.standard_normal((E, rows, cols)) * std).astype(np.float16)
        return RawWeights(fmt, a, None, a.astype(np.float64))
    if fmt == "bf16":
        f = (rng.standard_normal((E, rows, cols)) * std).astype(np.float32)
        raw = (f.view(np.uint32) >> 16).astype(np.uint16)  # truncation gives valid bf16 values
        dense = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return RawWeights(fmt, raw, None, dense)
    if fmt == "fp8_e4m3_b128":
        import torch

        codes = rng.integers(0, 256, size=(E, rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3F  # no NaN codes in checkpoints
        sr, sc = math.ceil(rows / 128), math.ceil(cols / 128)
        scale = (rng.uniform(0.5, 2.0, size=(E, sr, sc)) * std / 100.0).astype(np.float32)
        vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy()
        full = np.repeat(np.repeat(scale.astype(np.float64), 128, axis=1), 128, axis=2)[:, :rows, :cols]
        return RawWeights(fmt, codes, scale, vals * full)
    if fmt in ("q8_0", "mxfp4"):
        quants = _gguf().quants
        f = (rng.standard_normal((E * rows, cols)) * std).astype(np.float32)
        raw = np.ascontiguousarray(quants.quantize(f, _gguf_type(fmt)))
        return RawWeights(fmt, raw, None, gguf_dequantize(raw, fmt, E, rows, cols))
    if fmt in ("q4_k", "q5_k", "q6_k"):
        nb = E * rows * cols // 256
        raw = rng.integers(0, 256, size=(nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
        if fmt in ("q4_k", "q5_k"):
            # random codes, scales, and mins that centre each sub-block near zero the
            # way a real quantizer does (min ~ scale * mean code), packed 6-bit
            top = 8 if fmt == "q4_k" else 4
            mean_code = 7.5 if fmt == "q4_k" else 15.5
            sc = rng.integers(1, top + 1, size=(nb, 8))
            mn = np.clip(np.rint(sc * mean_code + rng.integers(-2, 3, size=(nb, 8))), 0, 63).astype(np.int64)
            raw[:, 4:16] = pack_k_scales(sc, mn)
        fields = FP16_FIELDS[fmt]

        def set_scales(mult: float) -> None:
            v = (rng.uniform(0.5, 1.0, size=nb) * mult).astype(np.float16)
            for off in fields:  # d and dmin alike (q4_k/q5_k), d alone (q6_k)
                raw[:, off : off + 2] = v.view(np.uint8).reshape(nb, 2)

        set_scales(1.0)
        s = gguf_dequantize(raw, fmt, E, rows, cols).std()
        set_scales(std / s)  # bring the weights to about `std`
        return RawWeights(fmt, raw, None, gguf_dequantize(raw, fmt, E, rows, cols))
    raise ValueError(fmt)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12-byte packing of eight 6-bit scales and mins of Q4_K/Q5_K ([nb, 8] each)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    return out


def round_to(x32: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of x32 after rounding to the activation dtype."""
    import torch

    return torch.from_numpy(x32).to(getattr(torch, dtype)).to(torch.float64).numpy()


def act_ref(kind: str, g: np.ndarray, u: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    if kind == "silu":
        return g / (1.0 + np.exp(-g)) * u
    if kind == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * u
    if kind == "swiglu_oai":
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    raise ValueError(kind)


def random_routes(rng: np.random.Generator, T: int, K: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [T,K] with -1s and duplicate experts (within a token and across tokens), w [T,K]."""
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.2] = -1
    if K >= 2:
        ids[0, 1] = ids[0, 0] if ids[0, 0] >= 0 else 1  # a duplicate inside one token
    if T >= 2:
        ids[T - 1, :] = -1  # one token routed entirely elsewhere
    w = rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32)
    return ids, w


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


#: int8 block length of the activations each weight format multiplies against
#: (the documented numerics of freetoken_cpu_moe: symmetric, scale = absmax/127,
#: round half away from zero); None = float32 activations.
ACT_QUANT_BLOCK = {"q8_0": 32, "q4_k": 32, "q5_k": 32, "q6_k": 32, "mxfp4": 32}
#: tiers whose K-quant kernels take one activation scale per super-block of 256
#: (csrc/act_prepare.h: the AVX2 tiers' one-token kernels sum a block in integers)
KQUANT_PER_256_TIERS = frozenset({"avx2", "avx_vnni"})


def act_quant_block(fmt: str, isa: Optional[str] = None) -> Optional[int]:
    """int8 block length of the activations ``fmt`` multiplies against on tier ``isa``
    (None: the active tier); None = float32 activations."""
    block = ACT_QUANT_BLOCK.get(fmt)
    if fmt in ("q4_k", "q5_k", "q6_k"):
        if isa is None:
            import freetoken_cpu_moe

            isa = freetoken_cpu_moe.active_isa()
        if isa in KQUANT_PER_256_TIERS:
            return 256
    return block


def quantize_act(v: np.ndarray, block: Optional[int]) -> np.ndarray:
    """float64 values of v after the kernels' per-block int8 activation quantization."""
    return quantize_act_ambiguous(v, block)[0]


def quantize_act_ambiguous(v: np.ndarray, block: Optional[int], window: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """quantize_act, plus for every element the size of one int8 step where the
    scaled value lies within ``window`` of a rounding boundary (else 0): there a
    kernel that computed v in float32 (another summation order) may round the other way."""
    if block is None:
        return v, np.zeros(np.shape(v))
    v32 = np.asarray(v, dtype=np.float32).reshape(-1, block)
    amax = np.abs(v32).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    s = v32 * inv
    q = np.clip(np.trunc(s + np.where(s >= 0, np.float32(0.5), np.float32(-0.5))), -127, 127)
    d = (amax / np.float32(127.0)).astype(np.float32).astype(np.float64)
    frac = np.abs(s.astype(np.float64)) % 1.0
    amb = np.where(np.abs(frac - 0.5) < window, d, 0.0)
    shape = np.shape(v)
    return (q.astype(np.float64) * d).reshape(shape), amb.reshape(shape)


def moe_reference(
    gate: RawWeights, up: RawWeights, down: RawWeights, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
    act: str = "silu", alpha: float = 1.702, limit: float = 7.0, quantized: bool = True, with_allowance: bool = False,
    isa: Optional[str] = None,
) -> Any:
    """float64 MoE, vectorised per expert; with ``quantized`` the kernels' int8
    activation quantization (x before gate/up, h before down) of tier ``isa`` (None:
    the active tier) is modelled too.

    ``with_allowance`` also returns, per output element, how far y may move because
    elements of h sit on an int8 rounding boundary (within 1e-3 of a step; the
    kernels compute h in float32, so they may round those the other way)."""
    def q(v: np.ndarray, fmt: str) -> np.ndarray:
        return quantize_act(v, act_quant_block(fmt, isa)) if quantized else v

    T, K = ids.shape
    y = np.zeros((T, down.dense.shape[1]), dtype=np.float64)
    allowance = np.zeros_like(y)
    xg, xu = q(x, gate.fmt), q(x, up.fmt)
    for e in np.unique(ids[ids >= 0]):
        t_idx, k_idx = np.nonzero(ids == e)
        g = xg[t_idx] @ gate.dense[e].T
        u = xu[t_idx] @ up.dense[e].T
        h = act_ref(act, g, u, alpha, limit)
        amb = np.zeros_like(h)
        if quantized:
            h, amb = quantize_act_ambiguous(h, act_quant_block(down.fmt, isa), window=1e-3)
        wt = w[t_idx, k_idx].astype(np.float64)[:, None]
        np.add.at(y, t_idx, wt * (h @ down.dense[e].T))
        np.add.at(allowance, t_idx, np.abs(wt) * (amb @ np.abs(down.dense[e]).T))
    return (y, allowance) if with_allowance else y


def rel_err_allowing(y: np.ndarray, ref: np.ndarray, allowance: np.ndarray) -> float:
    """rel_err after forgiving each element up to its allowance."""
    excess = np.maximum(np.abs(y - ref) - allowance, 0.0)
    return float(np.linalg.norm(excess) / max(np.linalg.norm(ref), 1e-30))


def moe_error(y: np.ndarray, raws: list, x: np.ndarray, ids: np.ndarray, w: np.ndarray, act: str = "silu",
              isa: Optional[str] = None) -> float:
    """Normwise error of y against the quantization-aware float64 reference of tier
    ``isa`` (None: the active tier), forgiving the int8 rounding-boundary cases (see
    moe_reference)."""
    ref, allowance = moe_reference(*raws, x, ids, w, act=act, with_allowance=True, isa=isa)
    return rel_err_allowing(y, ref, allowance)

"""The fused Triton dense ops against float64 references, and the plain torch ops too.

Runs on the GPU machine (CUDA tensors), and here in Triton's interpreter on CPU tensors
(tests/gpu/conftest.py turns it on without a GPU). Inputs are fresh random values, outputs
and cache slots start poisoned (NaN), and the references are computed in float64 from the
same inputs (the ops round to the activation dtype where stated, so the bound is a few
units of that dtype's precision).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from freetoken.models.dense_ops import TorchDenseOps, TritonDenseOps  # noqa: E402
from freetoken.models.layers import Rotary  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# relative bounds: a few roundings to the activation dtype
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
OPS = [TorchDenseOps(), TritonDenseOps()]


def _tol(ops, dtype) -> float:
    """Triton's interpreter (no GPU) truncates float32 -> bfloat16 casts where the GPU rounds
    to nearest: twice the error per rounding there."""
    import triton

    interpreted = ops.name == "triton" and triton.knobs.runtime.interpret and dtype == torch.bfloat16
    return TOL[dtype] * (2 if interpreted else 1)


def _ids(ops):
    return ops.name


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output"
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,N", [(1, 2048), (5, 2048), (3, 96)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(ops, dtype, T, N, with_delta):
    g = torch.Generator().manual_seed(T * 1000 + N)
    h = torch.randn(T, N, generator=g).to(dtype).to(DEV)
    delta = torch.randn(T, N, generator=g).to(dtype).to(DEV) if with_delta else None
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype).to(DEV)
    eps = 1e-6
    h_new, x = ops.add_rms_norm(h, delta, w, eps)
    h_ref = h.double() + (delta.double() if delta is not None else 0)
    _close(h_new, h_ref, _tol(ops, dtype) / 2, "h + delta")
    assert h_new.dtype == dtype and x.dtype == dtype
    _close(x, _rms64(h_ref, w, eps), _tol(ops, dtype), "rms norm")


def _rope64(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotary embedding in float64, from its definition."""
    D = x.shape[-1]
    half = D // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / D)
    ang = pos.double().cpu()[:, None] * inv[None, :]  # [T, half]
    cos, sin = ang.cos()[:, None, :].to(x.device), ang.sin()[:, None, :].to(x.device)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,fused_qkv", [(1, True), (4, True), (3, False)])
def test_qk_norm_rope_store(ops, dtype, T, fused_qkv):
    Hq, Hkv, D, bs, nb, theta, eps = 8, 2, 64, 4, 6, 10000.0, 1e-6
    g = torch.Generator().manual_seed(7 * T + fused_qkv)
    if fused_qkv:  # one matmul output [T, (Hq + 2 Hkv) D], split into views
        y = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
        q, k, v = y.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    else:
        q = torch.randn(T, Hq * D, generator=g).to(dtype).to(DEV)
        kv = torch.randn(T, 2 * Hkv * D, generator=g).to(dtype).to(DEV)
        k, v = kv.split([Hkv * D, Hkv * D], dim=-1)
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    qkw = torch.cat([qw.expand(Hq, D), kw.expand(Hkv, D)]).contiguous() if fused_qkv else None
    positions = torch.randint(0, 500, (T,), generator=g).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(DEV)
    kc = torch.full((nb, bs, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    rotary = Rotary(D, theta, 512, torch.device(DEV))
    out = ops.qk_norm_rope_store(q, k, v, qw, kw, qkw, rotary, positions, kc, vc, slots, eps)
    assert out.shape == (T, Hq, D) and out.dtype == dtype
    q_ref = _rope64(_rms64(q.reshape(T, Hq, D), qw, eps), positions, theta)
    k_ref = _rope64(_rms64(k.reshape(T, Hkv, D), kw, eps), positions, theta)
    _close(out, q_ref, _tol(ops, dtype), "q")
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, D)
    _close(flat_k[slots], k_ref, _tol(ops, dtype), "k in the cache")
    assert torch.equal(flat_v[slots], v.reshape(T, Hkv, D)), "v in the cache"
    others = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.isnan(flat_k[others]).all() and torch.isnan(flat_v[others]).all(), "a slot outside `slots` was written"


def _partial_rope64(x: torch.Tensor, pos: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """NeoX RoPE on the first ``rotary_dim`` dimensions of each head (pairs ``(i, i + rotary_dim/2)``),
    the others left alone, float64, from its definition."""
    return torch.cat([_rope64(x[..., :rotary_dim], pos, theta), x[..., rotary_dim:]], dim=-1)


# head sizes that are not a power of two, 128 for no regression, and
# partial rotary (Qwen3.5: a quarter of each head rotated) through the permuted full-width tables
HEAD_SIZES = [(24, 24), (80, 80), (96, 96), (128, 128), (192, 192), (24, 8), (96, 24), (192, 64)]


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("D,rotary_dim", HEAD_SIZES, ids=[f"d{d}r{r}" for d, r in HEAD_SIZES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_rope_store_head_sizes(ops, D, rotary_dim, dtype):
    """Any even head size, full or partial rotary: against float64 RMSNorm + RoPE from their
    definitions (partial rotary in the checkpoint's own dimension order, the op run on the
    rows :func:`rotary_permutation` reorders, as the Qwen3.5 model loads them)."""
    from freetoken.models.hybrid_weights import PartialRotary, rotary_permutation

    Hq, Hkv, bs, nb, theta, eps, T = 4, 2, 4, 3, 10000.0, 1e-6, 3
    g = torch.Generator().manual_seed(1000 * D + rotary_dim + (dtype == torch.float32))
    y = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
    q, k, v = y.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    positions = torch.randint(0, 500, (T,), generator=g).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(DEV)
    q_ref = _partial_rope64(_rms64(q.reshape(T, Hq, D), qw, eps), positions, theta, rotary_dim)
    k_ref = _partial_rope64(_rms64(k.reshape(T, Hkv, D), kw, eps), positions, theta, rotary_dim)
    if rotary_dim == D:
        rotary = Rotary(D, theta, 512, torch.device(DEV))
        order = torch.arange(D)
    else:
        rotary = PartialRotary(D, rotary_dim, theta, 512, torch.device(DEV))
        order = rotary_permutation(D, rotary_dim)
    od = order.to(DEV)
    # the op sees each head's dimensions in rotary order (q, k and their norm weights alike)
    qp = q.reshape(T, Hq, D)[..., od].reshape(T, Hq * D)
    kp = k.reshape(T, Hkv, D)[..., od].reshape(T, Hkv * D)
    qwp, kwp = qw[od].contiguous(), kw[od].contiguous()
    kc = torch.full((nb, bs, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    out = ops.qk_norm_rope_store(qp, kp, v, qwp, kwp, None, rotary, positions, kc, vc, slots, eps)
    assert out.shape == (T, Hq, D) and out.dtype == dtype
    # the tables hold float32 angles pos * inv_freq: up to ~500 * 6e-8 from the float64 ones
    tol = _tol(ops, dtype) + (4e-5 if dtype == torch.float32 else 0.0)
    _close(out, q_ref[..., od], tol, f"q D={D}")
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, D)
    _close(flat_k[slots], k_ref[..., od], tol, f"k in the cache D={D}")
    assert torch.equal(flat_v[slots], v.reshape(T, Hkv, D)), "v in the cache"
    others = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.isnan(flat_k[others]).all() and torch.isnan(flat_v[others]).all(), "a slot outside `slots` was written"


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("D,DV", [(24, 16), (192, 128), (80, 96)])
def test_qk_norm_rope_store_v_head_size(ops, D, DV):
    """A v head size other than the q/k one (MLA's 192/128): v rows of ``DV`` values go to a
    ``[.., Hkv, DV]`` cache, k's ``D`` to its own."""
    Hq, Hkv, bs, nb, theta, eps, T, dtype = 4, 2, 4, 3, 10000.0, 1e-6, 2, torch.bfloat16
    g = torch.Generator().manual_seed(D * 7 + DV)
    q = torch.randn(T, Hq * D, generator=g).to(dtype).to(DEV)
    k = torch.randn(T, Hkv * D, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, Hkv * DV, generator=g).to(dtype).to(DEV)
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    positions = torch.randint(0, 500, (T,), generator=g).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(DEV)
    kc = torch.full((nb, bs, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full((nb, bs, Hkv, DV), float("nan"), dtype=dtype, device=DEV)
    out = ops.qk_norm_rope_store(q, k, v, qw, kw, None, Rotary(D, theta, 512, torch.device(DEV)), positions, kc, vc,
                                 slots, eps)  # fmt: skip
    _close(out, _rope64(_rms64(q.reshape(T, Hq, D), qw, eps), positions, theta), _tol(ops, dtype), "q")
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, DV)
    _close(flat_k[slots], _rope64(_rms64(k.reshape(T, Hkv, D), kw, eps), positions, theta), _tol(ops, dtype), "k")
    assert torch.equal(flat_v[slots], v.reshape(T, Hkv, DV)), "v in the cache"
    others = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.isnan(flat_k[others]).all() and torch.isnan(flat_v[others]).all(), "a slot outside `slots` was written"


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,rotary_dim,with_bias", [(64, 64, True), (128, 64, True), (96, 96, False), (24, 24, True)],
                         ids=["d64-bias", "d128r64-bias", "d96", "d24-bias"])  # fmt: skip
def test_bias_rope_store(ops, dtype, D, rotary_dim, with_bias):
    """The projections' biases (GPT-OSS, GLM-4.5), NeoX RoPE (full, or partial through the
    permuted tables as GLM loads it) and the K/V write, without norms: against float64 from the
    definitions on views of one fused q/k/v output, poisoned caches, only ``slots`` written."""
    from freetoken.models.hybrid_weights import PartialRotary, rotary_permutation

    Hq, Hkv, bs, nb, theta, T = 4, 2, 4, 3, 10000.0, 3
    g = torch.Generator().manual_seed(17 * D + rotary_dim + with_bias)
    y = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
    q, k, v = y.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    bias = tuple(torch.randn(n * D, generator=g).to(DEV) for n in (Hq, Hkv, Hkv)) if with_bias else None
    positions = torch.randint(0, 500, (T,), generator=g).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(DEV)
    if rotary_dim == D:
        rotary, order = Rotary(D, theta, 512, torch.device(DEV)), torch.arange(D)
    else:
        rotary, order = PartialRotary(D, rotary_dim, theta, 512, torch.device(DEV)), rotary_permutation(D, rotary_dim)
    od = order.to(DEV)

    def biased(t, i, heads):
        t64 = t.double().reshape(T, heads, D)
        return t64 + bias[i].double().reshape(heads, D) if with_bias else t64

    # the checkpoint's order for the references; the op sees q, k and their biases in rotary order
    q_ref = _partial_rope64(biased(q, 0, Hq)[..., od.argsort()], positions, theta, rotary_dim)[..., od]
    k_ref = _partial_rope64(biased(k, 1, Hkv)[..., od.argsort()], positions, theta, rotary_dim)[..., od]
    v_ref = biased(v, 2, Hkv)
    kc = torch.full((nb, bs, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    cos, sin = rotary.tables(positions, dtype)
    out = ops.bias_rope_store(q, k, v, bias, rotary, cos, sin, positions, kc, vc, slots)
    assert out.shape == (T, Hq, D) and out.dtype == dtype
    tol = _tol(ops, dtype) + (4e-5 if dtype == torch.float32 else 0.0)
    _close(out, q_ref, tol, "q")
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, D)
    _close(flat_k[slots], k_ref, tol, "k in the cache")
    _close(flat_v[slots], v_ref, tol, "v in the cache")
    others = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.isnan(flat_k[others]).all() and torch.isnan(flat_v[others]).all(), "a slot outside `slots` was written"
    if ops.name == "triton":  # the same roundings as the torch ops, to one rounding of the dtype
        kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
        want = TorchDenseOps().bias_rope_store(q, k, v, bias, rotary, cos, sin, positions, kc2, vc2, slots)
        _close(out, want.double(), _tol(ops, dtype) / 2, "q against the torch ops")


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,K,H,pad", [(1, 4, 2880, 32), (3, 4, 200, 32), (2, 8, 2048, 0)])
def test_moe_bias_add(ops, dtype, T, K, H, pad):
    """``y[:, :H] + sum_k w_k * bias[ids_k]`` (GPT-OSS's expert down biases after the routed
    experts, whose outputs carry ``pad`` more columns), against float64."""
    E = 9
    g = torch.Generator().manual_seed(T * 100 + K + H)
    y = torch.randn(T, H + pad, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32).to(DEV)
    w = torch.rand(T, K, generator=g).to(DEV)
    bias = torch.randn(E, H, generator=g).to(DEV)
    out = ops.moe_bias_add(y, ids, w, bias, H, dtype)
    assert out.shape == (T, H) and out.dtype == dtype
    ref = y[:, :H].double() + (w.double().unsqueeze(-1) * bias.double()[ids.long()]).sum(1)
    _close(out, ref, _tol(ops, dtype) / 2, "y + the weighted biases")


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (6, 128, 8), (2, 60, 4), (3, 8, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_top_k(ops, T, E, K, norm):
    g = torch.Generator().manual_seed(E * 10 + T)
    logits = (torch.randn(T, E, generator=g, dtype=torch.float64) * 3).float().to(DEV)
    ids, w = ops.router_top_k(logits, K, norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (T, K) == w.shape
    lg = logits.double().cpu()
    order = torch.argsort(lg, dim=-1, descending=True)[:, :K]
    assert torch.equal(ids.cpu().long(), order), "top-k ids (descending)"
    top = torch.gather(lg, 1, order)
    if norm:
        ref = torch.softmax(top, dim=-1)
    else:
        ref = torch.gather(torch.softmax(lg, dim=-1), 1, order)
    assert float((w.cpu().double() - ref).abs().max()) <= 1e-6
    assert math.isclose(float(w.sum(-1).max()), 1.0, rel_tol=1e-5) or not norm


def _grouped_top_k64(logits: torch.Tensor, bias, groups: int, topk_group: int, k: int, norm: bool,
                     scale: float) -> tuple[list[set[int]], torch.Tensor]:  # fmt: skip
    """From the definition, in float64, token by token: the chosen experts (as sets, in the
    order chosen) and their weights, for sigmoid scores with ``bias`` (softmax when None)."""
    T, E = logits.shape
    per = E // groups
    chosen, weights = [], torch.zeros(T, k, dtype=torch.float64)
    for t in range(T):
        lg = logits[t].double()
        scores = torch.sigmoid(lg) if bias is not None else torch.softmax(lg, dim=0)
        choice = scores + bias.double() if bias is not None else scores.clone()
        if topk_group < groups:
            gscore = []
            for g in range(groups):
                part = sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)
                gscore.append(sum(part[:2]) if bias is not None else part[0])
            keep = sorted(range(groups), key=lambda g: -gscore[g])[:topk_group]
            for g in range(groups):
                if g not in keep:
                    choice[g * per:(g + 1) * per] = float("-inf")
        order = sorted(range(E), key=lambda e: -float(choice[e]))[:k]
        w = scores[order]
        if norm:
            w = w / w.sum()
        chosen.append(order)
        weights[t] = w * scale
    return chosen, weights


#: (experts, groups, groups kept, routes, sigmoid, norm, scale): GLM-4.5-Air, DeepSeek-V3, Kimi-K2,
#: DeepSeek-V2 (softmax, 20 experts per group: no power of two), DeepSeek-V2-Lite, a small odd one,
#: groups that are all kept (no group step)
GROUPED = {"glm-4.5-air": (128, 1, 1, 8, True, True, 1.0), "deepseek-v3": (256, 8, 4, 8, True, True, 2.5),
           "kimi-k2": (384, 1, 1, 8, True, True, 2.827), "deepseek-v2": (160, 8, 3, 6, False, False, 16.0),
           "deepseek-v2-lite": (64, 1, 1, 6, False, False, 1.0), "odd": (24, 3, 2, 5, True, False, 1.5),
           "all-groups-kept": (64, 4, 4, 6, True, True, 1.0)}


@pytest.mark.parametrize("ops", OPS, ids=_ids)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("shape", list(GROUPED))
def test_grouped_top_k_against_float64(ops, T, shape):
    """The grouped routings of GLM-4.5 and DeepSeek-V2/V3 (Kimi-K2's 384 experts too) against
    a float64 reference written from their definition: the same experts in the same order,
    weights within float32 rounding; a correction bias large enough to change the choice;
    outputs of fresh tensors (no result carried over)."""
    from freetoken.models.routing import GroupedTopK

    E, groups, topk_group, k, sigmoid, norm, scale = GROUPED[shape]
    gen = torch.Generator().manual_seed(E * 31 + T)
    logits = (torch.randn(T, E, generator=gen, dtype=torch.float64) * 2).float()
    bias = (torch.randn(E, generator=gen) * 0.5).float() if sigmoid else None
    routing = GroupedTopK(E, k, groups, topk_group, norm, scale, "sigmoid" if sigmoid else "softmax")
    ids, w = ops.grouped_top_k(logits.to(DEV), None if bias is None else bias.to(DEV), routing)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and tuple(ids.shape) == (T, k) == tuple(w.shape)
    chosen, ref = _grouped_top_k64(logits, bias, groups, topk_group, k, norm, scale)
    assert ids.cpu().tolist() == chosen, f"{shape}: experts"
    assert float((w.cpu().double() - ref).abs().max() / ref.abs().max()) <= 1e-6, f"{shape}: weights"
    if sigmoid:  # the bias moved the choice: without it other experts win
        plain, _ = _grouped_top_k64(logits, torch.zeros(E), groups, topk_group, k, norm, scale)
        assert plain != chosen


@pytest.mark.parametrize("T,E,H", [(1, 128, 2048), (3, 60, 100), (16, 32, 640)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits(T, E, H, dtype):
    """The router GEMV (bf16 or float32 activations, float32 weights, float32 sums) against
    float64: ragged expert counts and widths, output poisoned."""
    from freetoken.kernels import dense_ops as dense_kernels

    gen = torch.Generator().manual_seed(T * E + H)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = torch.randn(E, H, generator=gen) * 0.05
    out = torch.full((T, E), float("nan"), dtype=torch.float32, device=DEV)
    dense_kernels.router_logits(x.to(DEV), w.to(DEV), out)
    ref = x.double() @ w.double().T  # the activations as given, products and sums in float64
    _close(out.cpu(), ref, 1e-5, "router logits")


def _top_k64(logits: torch.Tensor, K: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending top-``K`` ids of float64 logits and their weights, from the definition."""
    order = torch.argsort(logits, dim=-1, descending=True)[:, :K]
    top = torch.gather(logits, 1, order)
    if norm:
        return order, torch.softmax(top, dim=-1)
    return order, torch.gather(torch.softmax(logits, dim=-1), 1, order)


@pytest.mark.parametrize("T,E,K,N,with_bias", [(1, 128, 8, 2048, False), (3, 60, 4, 96, False),
                                               (16, 8, 2, 640, False), (1, 128, 4, 2880, True), (2, 60, 4, 96, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_add_norm_route_against_float64(T, E, K, N, with_bias, dtype, norm):
    """The fused decode routing (residual add, RMSNorm, float32 router with or without its
    bias as GPT-OSS has it, top-k) against float64: h and x as ``add_rms_norm`` bounds them,
    the logits from the op's own x (so a rounding of x cannot flip an id) in float64, their
    top-k ids exactly and weights to 1e-6; twice, with fresh inputs, so the counter the launch
    leaves behind is checked to be zero again."""
    from freetoken.kernels.counters import zeroed_counters
    from freetoken.models.layers import RouterLinear
    from freetoken.models.layers import BiasedRouter

    ops = TritonDenseOps()
    gen = torch.Generator().manual_seed(T * 131 + E + N)
    linear = RouterLinear((torch.randn(E, N, generator=gen) * 0.05).to(DEV))
    bias = torch.randn(E, generator=gen).to(DEV) if with_bias else None
    router = BiasedRouter(linear, bias) if with_bias else linear
    nw = (1 + 0.5 * torch.randn(N, generator=gen)).to(dtype).to(DEV)
    eps = 1e-6
    for _ in range(2):
        h = torch.randn(T, N, generator=gen).to(dtype).to(DEV)
        delta = torch.randn(T, N, generator=gen).to(dtype).to(DEV)
        out = ops.add_norm_route(h, delta, nw, eps, router, K, norm)
        assert out is not None, "the Triton ops fuse a RouterLinear's decode routing"
        h_new, x, ids, w = out
        assert h_new.dtype == dtype and x.dtype == dtype and ids.dtype == torch.int32 and w.dtype == torch.float32
        h_ref = h.double() + delta.double()
        _close(h_new, h_ref, _tol(ops, dtype) / 2, "h + delta")
        _close(x, _rms64(h_ref, nw, eps), _tol(ops, dtype), "rms norm")
        logits = x.double().cpu() @ linear.weight.double().cpu().T
        if with_bias:
            logits += bias.double().cpu()
        ref_ids, ref_w = _top_k64(logits, K, norm)
        assert torch.equal(ids.cpu().long(), ref_ids), "top-k ids (descending)"
        assert float((w.cpu().double() - ref_w).abs().max()) <= 1e-5, "top-k weights"
        counts = zeroed_counters("add_norm_route", h_new.device, T)
        assert int(counts.abs().sum()) == 0, "the counters are left at zero"


def test_add_norm_route_declines_what_it_does_not_fuse():
    """None (the caller runs the three ops) for more tokens than a decode step's GEMV takes, a
    router that is not a plain float32 RouterLinear, and the torch ops."""
    from freetoken.models.layers import RouterLinear, TorchLinear

    gen = torch.Generator().manual_seed(3)
    N, E = 256, 16
    router = RouterLinear((torch.randn(E, N, generator=gen) * 0.05).to(DEV))
    nw = torch.ones(N, device=DEV)
    h, d = torch.randn(1, N, generator=gen).to(DEV), torch.randn(1, N, generator=gen).to(DEV)
    ops = TritonDenseOps()
    assert ops.add_norm_route(h, d, nw, 1e-6, router, 4, True) is not None
    T = RouterLinear.gemv_tokens + 1
    big = torch.randn(T, N, generator=gen).to(DEV)
    assert ops.add_norm_route(big, big, nw, 1e-6, router, 4, True) is None
    assert ops.add_norm_route(h, d, nw, 1e-6, TorchLinear(router.weight), 4, True) is None
    from freetoken.models.layers import BiasedRouter

    assert ops.add_norm_route(h, d, nw, 1e-6, BiasedRouter(TorchLinear(router.weight), torch.zeros(E, device=DEV)), 4,
                              True) is None  # fmt: skip
    half = torch.zeros(E, device=DEV, dtype=torch.bfloat16)
    assert ops.add_norm_route(h, d, nw, 1e-6, BiasedRouter(router, half), 4, True) is None
    assert TorchDenseOps().add_norm_route(h, d, nw, 1e-6, router, 4, True) is None


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("shape", list(GROUPED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_norm_grouped_route_against_float64(T, shape, dtype):
    """The fused decode routing with the grouped choice (GLM-4.5, DeepSeek-V2/V3, Kimi-K2):
    h and x as ``add_rms_norm`` bounds them, the experts of the float64 grouped reference over
    the float64 logits of the op's own x, their weights to 1e-6; twice, with fresh inputs (the
    counters left at zero); the correction bias changing the choice."""
    from freetoken.kernels.counters import zeroed_counters
    from freetoken.models.layers import RouterLinear
    from freetoken.models.routing import GroupedTopK

    E, groups, topk_group, k, sigmoid, norm, scale = GROUPED[shape]
    N = 320
    ops = TritonDenseOps()
    gen = torch.Generator().manual_seed(E * 7 + T)
    router = RouterLinear((torch.randn(E, N, generator=gen) * 0.1).to(DEV))
    bias = (torch.randn(E, generator=gen) * 0.5).float() if sigmoid else None
    routing = GroupedTopK(E, k, groups, topk_group, norm, scale, "sigmoid" if sigmoid else "softmax")
    nw = (1 + 0.5 * torch.randn(N, generator=gen)).to(dtype).to(DEV)
    eps = 1e-6
    for _ in range(2):
        h = torch.randn(T, N, generator=gen).to(dtype).to(DEV)
        delta = torch.randn(T, N, generator=gen).to(dtype).to(DEV)
        out = ops.add_norm_grouped_route(h, delta, nw, eps, router, None if bias is None else bias.to(DEV), routing)
        assert out is not None, "the Triton ops fuse a RouterLinear's grouped decode routing"
        h_new, x, ids, w = out
        h_ref = h.double() + delta.double()
        _close(h_new, h_ref, _tol(ops, dtype) / 2, "h + delta")
        _close(x, _rms64(h_ref, nw, eps), _tol(ops, dtype), "rms norm")
        logits = x.double().cpu() @ router.weight.double().cpu().T
        chosen, ref = _grouped_top_k64(logits, bias, groups, topk_group, k, norm, scale)
        assert ids.cpu().tolist() == chosen, f"{shape}: experts"
        assert float((w.cpu().double() - ref).abs().max() / ref.abs().max()) <= 1e-6, f"{shape}: weights"
        assert int(zeroed_counters("add_norm_route", h_new.device, T).abs().sum()) == 0, "the counters are left at zero"
    if sigmoid:  # the bias moved the choice: without it other experts win
        plain, _ = _grouped_top_k64(logits, torch.zeros(E), groups, topk_group, k, norm, scale)
        assert plain != chosen
    assert TorchDenseOps().add_norm_grouped_route(h, delta, nw, eps, router, bias, routing) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: graph-replayed timing")
def test_add_norm_route_tiles_timing():
    """Graph-replayed time per decode layer of the fused routing at Qwen3-30B-A3B's shapes
    (hidden 2048, 128 experts, top-8), for a few tiles, against the three launches it replaces
    (``add_rms_norm``, ``router_logits``, ``router_top_k``); each call on another router
    (128 MB in turn: from HBM). Every tile's ids equal the three launches' and its weights are
    within 1e-5 of theirs; the times are printed (``-s``), not asserted."""
    from graph_timing import graph_sequence_time_us

    from freetoken.kernels import dense_ops as dot

    gen = torch.Generator().manual_seed(17)
    N, E, K, copies = 2048, 128, 8, 128
    routers = [(torch.randn(E, N, generator=gen) * 0.05).cuda() for _ in range(copies)]
    h = torch.randn(1, N, generator=gen).to(torch.bfloat16).cuda()
    d = torch.randn(1, N, generator=gen).to(torch.bfloat16).cuda()
    nw = (1 + 0.5 * torch.randn(N, generator=gen)).to(torch.bfloat16).cuda()
    h3, x3 = torch.empty_like(h), torch.empty_like(h)
    logits3 = torch.empty(1, E, dtype=torch.float32, device="cuda")
    ids3 = torch.empty(1, K, dtype=torch.int32, device="cuda")
    w3 = torch.empty(1, K, dtype=torch.float32, device="cuda")

    def three(r):
        dot.add_rms_norm(h, d, nw, 1e-6, h3, x3)
        dot.router_logits(x3, r, logits3)
        dot.router_top_k(logits3, K, True, ids3, w3)

    base_us = graph_sequence_time_us([lambda r=r: three(r) for r in routers], 10)
    print(f"add_rms_norm + router_logits + router_top_k: {base_us:.2f} us per layer")
    counts = torch.zeros(16, dtype=torch.int32, device="cuda")
    for block_e, warps in ((4, 8), (4, 4), (2, 4), (2, 8), (8, 8), (1, 4)):
        hf, xf = torch.empty_like(h), torch.empty_like(h)
        logits = torch.empty(1, E, dtype=torch.float32, device="cuda")
        ids = torch.full((1, K), -1, dtype=torch.int32, device="cuda")
        w = torch.full((1, K), float("nan"), dtype=torch.float32, device="cuda")

        def fused(r, be=block_e, nwarps=warps):
            dot.add_norm_route(h, d, nw, 1e-6, r, K, True, hf, xf, logits, counts, ids, w, block_e=be,
                               num_warps=nwarps)

        us = graph_sequence_time_us([lambda r=r: fused(r) for r in routers], 10)
        torch.cuda.synchronize()
        assert torch.equal(ids, ids3) and float((w - w3).abs().max()) <= 1e-5, (block_e, warps)
        assert torch.equal(hf, h3), (block_e, warps)
        _close(xf, x3.double(), 1e-2, f"x, block_e={block_e} num_warps={warps}")
        assert int(counts.abs().sum()) == 0, "the counters are left at zero"
        print(f"add_norm_route block_e={block_e} num_warps={warps}: {us:.2f} us per layer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the Triton GEMV runs on CUDA tensors only")
def test_router_linear_takes_the_gemv_for_decode_and_the_matmul_for_prompts():
    from freetoken.models.layers import RouterLinear

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(128, 2048, generator=gen) * 0.05
    router = RouterLinear(w.to(DEV))
    for T in (1, RouterLinear.gemv_tokens, RouterLinear.gemv_tokens + 1, 64):
        x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16)
        _close(router(x.to(DEV)).cpu(), x.double() @ w.double().T, 1e-5, f"router, {T} tokens")


QK_SM90_SCRIPT = r"""
import json, os, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import dense_ops as dk

sys.path.insert(0, sys.argv[2])  # tests/gpu: the spill reading of packed_sm90_spills
from packed_sm90_spills import CUOBJDUMP, resources

target = GPUTarget("cuda", 90, 32)
report = {}


def attempt(key, kernel, sig, consts, warps):
    # True: compiled, and (where Triton has cuobjdump) no local-memory stack
    sig = {**sig, **{k: "constexpr" for k in consts}}
    try:
        k = triton.compile(ASTSource(kernel, sig, consts, {}), target=target, options=dict(num_warps=warps))
        stack = resources(k)["stack_bytes"] if os.path.exists(CUOBJDUMP) else 0
        report[key] = bool(k.asm.get("cubin")) and (stack == 0 or f"a {stack}-byte stack")
    except Exception as exc:
        report[key] = f"{type(exc).__name__}: {str(exc)[-300:]}"


HEADS = {"q_ptr": "*bf16", "q_stride": "i32", "k_ptr": "*bf16", "k_stride": "i32", "v_ptr": "*bf16",
         "v_stride": "i32"}
TABLES = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "q_out_ptr": "*bf16",
          "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
for d, dv in json.loads(sys.argv[1]):
    # what dk.qk_norm_rope and dk.bias_rope pass (the latter with and without biases)
    tiles = dict(HQ=4, HKV=2, D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv))
    warps = 1 if max(d, dv) <= 128 else 2
    attempt(f"{d}/{dv}", dk._qk_norm_rope_kernel,
            {**HEADS, "qw_ptr": "*bf16", "kw_ptr": "*bf16", **TABLES, "eps": "fp32"}, tiles, warps)
    for has_bias in (True, False):
        attempt(f"bias_rope {d}/{dv} {has_bias}", dk._bias_rope_kernel,
                {**HEADS, "qb_ptr": "*fp32", "kb_ptr": "*fp32", "vb_ptr": "*fp32", **TABLES},
                {**tiles, "HAS_BIAS": has_bias}, warps)
for h in (2880, 200):  # GPT-OSS's hidden size, and one that is no power of two below a tile
    attempt(f"moe_bias_add {h}", dk._moe_bias_add_kernel,
            {"y_ptr": "*bf16", "y_stride": "i32", "ids_ptr": "*i32", "w_ptr": "*fp32", "bias_ptr": "*fp32",
             "out_ptr": "*bf16", "H": "i32"}, dict(K=4, BLOCK=min(1024, triton.next_power_of_2(h))), 4)
# the fused grouped routing at GLM-4.5-Air's and DeepSeek-V3's shapes
ROUTE = {"h_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "rw_ptr": "*fp32", "h_out_ptr": "*bf16",
         "x_out_ptr": "*bf16", "logits_ptr": "*fp32", "count_ptr": "*i32", "cb_ptr": "*fp32", "ids_ptr": "*i32",
         "w_ptr": "*fp32", "N": "i32", "eps": "fp32", "scale": "fp32"}
for n, e, groups, topk_group, per_p in ((4096, 128, 1, 1, 128), (7168, 256, 8, 4, 32), (5120, 160, 1, 1, 256)):
    block = triton.next_power_of_2(n)
    attempt(f"add_norm_grouped_route {n}/{e}/{groups}", dk._add_norm_grouped_route_kernel, ROUTE,
            dict(E=e, GROUPS=groups, PER=e // groups, GP=triton.next_power_of_2(groups), PP=per_p,
                 TOPK_GROUP=topk_group, K=8, KP=8, SIGMOID=True, NORM=True, BLOCK=block,
                 BLOCK_E=dk.ROUTE_BLOCK_E), dk._route_warps(block))
print(json.dumps(report))
"""


def test_qk_norm_rope_compiles_for_sm90_at_any_head_size():
    """The issue's failure was Triton's compiler ('arange's range must be a power of 2'), which
    the interpreter does not check: compile the kernel (and the bias + RoPE one, the MoE bias
    add and the fused grouped routing at GLM-4.5(-Air)'s and DeepSeek-V3's widths) for sm_90
    (no GPU needed) at the head sizes of the tests, in a process without TRITON_INTERPRET; none
    keeps a local-memory stack (where Triton ships cuobjdump)."""
    import json
    import os
    import subprocess
    import sys

    sizes = [[24, 24], [80, 80], [96, 96], [128, 128], [192, 192], [192, 128], [24, 16]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", QK_SM90_SCRIPT, json.dumps(sizes), here], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v is True for v in report.values()), report

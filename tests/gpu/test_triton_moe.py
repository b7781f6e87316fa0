"""The fused MoE kernels (freetoken.kernels.moe_experts) behind GpuExperts(impl="triton").

Every result is compared, token row by token row, with the float64 per-route loop
(:func:`expert_reference.reference_experts`) on fresh random inputs; outputs are poisoned
(NaN) first; ids hold -1 (routes not on the GPU), duplicates within a token and across
tokens, and tokens with no GPU route at all (their row must come out exactly zero).

Without a GPU (CPU CI) the kernels run in Triton's interpreter on CPU tensors at small
sizes (conftest.py sets TRITON_INTERPRET=1 and fixes the interpreter's bf16 dots); with
one, the same tests run compiled on the GPU, and the tests marked ``gpu`` add realistic
sizes, graph capture and the hybrid layer.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
from expert_reference import random_experts, reference_experts  # noqa: E402

from freetoken.kernels import moe_experts  # noqa: E402
from freetoken.kernels.availability import default_impl  # noqa: E402
from freetoken.moe.experts.gpu_experts import GpuExperts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU and Triton's interpreter is off (TRITON_INTERPRET unset at import)", allow_module_level=True)

# small shapes for the interpreter: ragged against every block (200 = 128 + 72, 72 = 64 + 8)
E, H, I = 12, 200, 72
SMALL = moe_experts.BlockConfig(block_i=32, block_h=128, block_n=64, block_r=64)
BF16_TOL, FP32_TOL = 2e-2, 1e-5


def routes(tokens: int, top_k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Random ids with -1s, a duplicate within token 0 and, from two tokens on, a token with no route."""
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.3] = -1
    if top_k >= 2:
        ids[0, 0] = ids[0, top_k - 1] = int(torch.randint(0, num_experts, (1,), generator=gen))
    if tokens >= 2:
        ids[tokens // 2] = -1
    return ids.to(torch.int32)


def check_rows(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    got = out.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output (poison left or NaN computed)"
    empty = ref.abs().amax(dim=1) == 0
    assert (got[empty] == 0).all(), "a token without GPU routes got a non-zero row"
    if (~empty).any():
        err = (got[~empty] - ref[~empty]).norm(dim=1) / ref[~empty].norm(dim=1)
        assert float(err.max()) < tol, f"worst token row relative error {float(err.max()):.3g} >= {tol}"
        return float(err.max())
    return 0.0


def run_case(
    tokens: int, top_k: int, wdtype: torch.dtype, xdtype: torch.dtype, outdtype: torch.dtype, seed: int,
    activation: str = "silu", ids_dtype: torch.dtype = torch.int32, w_dtype: torch.dtype = torch.float32,
    config: moe_experts.BlockConfig = SMALL, impl: str = "triton", shape: tuple[int, int, int] = (E, H, I),
) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    ne, hid, inter = shape
    gate, up, down = random_experts(ne, hid, inter, wdtype, "cpu", gen)
    experts = GpuExperts(gate.to(DEV), up.to(DEV), down.to(DEV), activation, impl=impl, block_config=config)
    x = torch.randn(tokens, hid, generator=gen).to(xdtype)
    ids = routes(tokens, top_k, ne, gen).to(ids_dtype)
    w = (torch.rand(tokens, top_k, generator=gen) + 0.1).to(w_dtype)
    out = torch.full((tokens, hid), float("nan"), dtype=outdtype, device=DEV)
    res = experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    assert res is out
    ref = reference_experts(x, ids, w, gate, up, down, activation)
    tol = FP32_TOL if wdtype == torch.float32 and xdtype == torch.float32 else BF16_TOL
    return check_rows(out, ref, tol)


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 64])
def test_bf16_matches_reference(tokens, top_k):
    run_case(tokens, top_k, torch.bfloat16, torch.bfloat16, torch.bfloat16, seed=100 * tokens + top_k)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_fp32_direct_output_and_activations(activation):
    # float32 out: the kernels accumulate into it directly (their zeroing is what clears the poison)
    err = run_case(5, 4, torch.float32, torch.float32, torch.float32, seed=7, activation=activation)
    assert err < FP32_TOL


def test_fp16_weights_int64_ids_bf16_routing_weights():
    run_case(16, 4, torch.float16, torch.float32, torch.float32, seed=11, ids_dtype=torch.int64, w_dtype=torch.bfloat16)


def test_more_tokens_than_one_tile_and_default_blocks():
    run_case(80, 2, torch.bfloat16, torch.bfloat16, torch.float32, seed=13)  # two token tiles of 64
    run_case(3, 8, torch.bfloat16, torch.float32, torch.bfloat16, seed=17, config=moe_experts.DEFAULT_CONFIG)


def test_no_gpu_route_gives_zeros_and_return_dtype():
    gen = torch.Generator().manual_seed(19)
    gate, up, down = random_experts(E, H, I, torch.bfloat16, "cpu", gen)
    experts = GpuExperts(gate.to(DEV), up.to(DEV), down.to(DEV), impl="triton", block_config=SMALL)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16).to(DEV)
    w = torch.rand(4, 2, generator=gen).to(DEV)
    out = torch.full((4, H), float("nan"), dtype=torch.float32, device=DEV)
    experts.forward(x, torch.full((4, 2), -1, dtype=torch.int32, device=DEV), w, out=out)
    assert (out == 0).all()
    ids = routes(4, 2, E, gen).to(DEV)
    y = experts.forward(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (4, H)
    check_rows(y, reference_experts(x, ids, w, gate, up, down), BF16_TOL)


def test_impl_selection():
    gate, up, down = random_experts(4, 32, 16, torch.float32)
    assert default_impl("cpu")[0] == "torch"
    assert GpuExperts(gate, up, down).impl == "torch"
    with pytest.raises(ValueError, match="implementation"):
        GpuExperts(gate, up, down, impl="cutlass")
    with pytest.raises(ValueError, match="dtypes differ"):
        GpuExperts(gate, up, down.double())
    with pytest.raises(ValueError, match="power of two"):
        moe_experts.BlockConfig(block_i=8).validate()


# --------------------------------------------------------------------------------------
# on the GPU: realistic sizes, both implementations, graph capture, the hybrid layer
# --------------------------------------------------------------------------------------

BIG = (8, 2048, 768)


GPU_CASES = [("triton", t, k) for t in (1, 2, 5, 16, 64) for k in (1, 2, 4, 8)]
GPU_CASES += [("torch", t, k) for t, k in ((1, 4), (2, 8), (5, 1), (16, 2), (64, 4))]  # the reference impl


@pytest.mark.gpu
@pytest.mark.parametrize("impl,tokens,top_k", GPU_CASES)
def test_gpu_realistic_sizes(tokens, top_k, impl):
    err = run_case(tokens, top_k, torch.bfloat16, torch.bfloat16, torch.bfloat16, seed=tokens * 31 + top_k,
                   impl=impl, config=moe_experts.DEFAULT_CONFIG, shape=BIG)  # fmt: skip
    logging.getLogger(__name__).info("%s T=%d K=%d: worst row error %.3g", impl, tokens, top_k, err)


@pytest.mark.gpu
def test_gpu_many_experts_fp32_weights():
    run_case(16, 8, torch.bfloat16, torch.bfloat16, torch.bfloat16, seed=5, config=moe_experts.DEFAULT_CONFIG,
             shape=(64, 1024, 512))  # fmt: skip
    run_case(5, 4, torch.float32, torch.float32, torch.float32, seed=6, config=moe_experts.DEFAULT_CONFIG,
             shape=(8, 512, 256))  # fmt: skip


def _static_case(experts: GpuExperts, tokens: int, top_k: int, gen: torch.Generator):
    x = torch.randn(tokens, experts.hidden, generator=gen).to(torch.bfloat16)
    ids = routes(tokens, top_k, experts.num_experts, gen)
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, ids, w


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False])
def test_gpu_graph_capture_and_replay(warm, caplog):
    gen = torch.Generator().manual_seed(23 + warm)
    gate, up, down = random_experts(*BIG, torch.bfloat16, "cpu", gen)
    experts = GpuExperts(gate.cuda(), up.cuda(), down.cuda(), impl="triton")
    tokens, top_k = 4, 4
    if warm:
        experts.warmup([tokens], top_k)
    x, ids, w = _static_case(experts, tokens, top_k, gen)
    sx, sids, sw = x.cuda(), ids.cuda(), w.cuda()
    sout = torch.empty(tokens, BIG[1], dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout.copy_(experts.forward(sx, sids, sw))
    assert experts.capture_fallbacks == (0 if warm else 1)
    if not warm:
        assert "not compiled before stream capture" in caplog.text
    for _ in range(5):
        x, ids, w = _static_case(experts, tokens, top_k, gen)
        sx.copy_(x.cuda()), sids.copy_(ids.cuda()), sw.copy_(w.cuda())
        sout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_rows(sout, reference_experts(x, ids, w, gate, up, down), BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_hybrid_layer_with_impl(backend, impl):
    """The hybrid layer (KernelIO and copy, eager and graph replay) against the oracle with each implementation."""
    pytest.importorskip("freetoken_cpu_moe")
    from freetoken.backends.handoff_io import IOPath
    from freetoken.moe.qualify.startup import QualifyConfig
    from freetoken.moe.qualify.checks import QualLayer

    layer = QualLayer(backend, torch.bfloat16, QualifyConfig(hidden=512, intermediate=256, batch_sizes=(1, 4, 16),
                                                            eager_steps=4, replays=5),
                       backend.cpu_experts())  # fmt: skip
    try:
        ex = layer.experts
        layer.experts = GpuExperts(ex.gate, ex.up, ex.down, ex.activation, impl=impl)
        for path in (IOPath.KERNEL_IO, IOPath.COPY):
            for graph in (False, True):
                rec = layer.check(path, graph=graph)
                assert rec["ok"] and rec["steps"] >= 4, rec
        assert layer.experts.capture_fallbacks == 0
    finally:
        layer.close()

"""The native routed-expert kernels of freetoken-cuda (``packed_moe``, freetoken/include/freetoken/
gpu/packed_moe.cuh) behind PackedGpuExperts, on the GPU machine.

Every result is compared with float64 over gguf-py's dequantization of random Q4_K, Q6_K,
Q8_0 and MXFP4 blocks (tests/gpu/expert_reference.reference_experts), with the token and
each route's h quantized per 32 values as the kernels do it (int8_groups, the Triton int8
dots' rounding),
and against the unquantized result (the quantization's error is there, and small). Outputs
are poisoned (NaN) first; the Triton launch is made to fail, so a result can only come from
the native kernels. Without a GPU, or with an extension built without the kernels, the module
is skipped (CI compiles them with nvcc: test_gpu_packages, and reads their resources:
test_native_kernel_resources; the dispatch through an engine runs in CI:
test_gemv_dispatch.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("no GPU: the native expert kernels run on the H200 machine", allow_module_level=True)
_C = pytest.importorskip("freetoken_cuda._C")
if not hasattr(_C, "packed_moe"):
    pytest.skip("freetoken_cuda._C was built without packed_moe", allow_module_level=True)

from expert_reference import reference_experts  # noqa: E402
from test_packed_experts import E, H, INT8_TOL, MX, Q4, Q5, Q6, Q8, check_rows, random_layer, routes  # noqa: E402

from freetoken.kernels import moe_packed  # noqa: E402
from freetoken.moe.experts.gpu_packed_experts import PackedGpuExperts  # noqa: E402
from freetoken.native_gpu.gemv import NativePackedGemv  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
#: BF16 outputs: float64 within BF16's step
BF16_TOL = 1e-2


def native() -> NativePackedGemv:
    return NativePackedGemv(_C, lambda: torch.cuda.current_stream().cuda_stream)


@pytest.fixture
def no_triton(monkeypatch):
    """The Triton decode launch fails: results come from the native kernels or not at all."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton packed kernels ran where the native ones serve")

    monkeypatch.setattr(moe_packed, "launch", refuse)


def _inputs(tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    x[0, 32:64] = 0.0  # a group of zeros: scale 0, no division by it
    ids = routes(tokens, top_k, gen)
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, ids, w


MIXES = {"q4k_q4k_q6k": (Q4, Q4, Q6), "q4k_q4k_q4k": (Q4, Q4, Q4), "q6k_q6k_q6k": (Q6, Q6, Q6),
         "q4k_q6k_q4k": (Q4, Q6, Q4), "q6k_q4k_q6k": (Q6, Q4, Q6), "q4k_q4k_q8": (Q4, Q4, Q8),
         "q8_q8_q8": (Q8, Q8, Q8), "q8_q8_q6k": (Q8, Q8, Q6), "mx_mx_mx": (MX, MX, MX), "mx_q8_q4k": (MX, Q8, Q4),
         "q8_mx_mx": (Q8, MX, MX)}  # fmt: skip


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 8), (5, 3), (1, 1)])
@pytest.mark.parametrize("mix", list(MIXES))
def test_native_experts_match_quantized_float64(mix, tokens, top_k, no_triton):
    """Every gate/up/down pair of formats, 1 to 5 tokens, 1 to 8 routes (with -1s, a repeated
    expert and a token with no route): float32 out against float64 over the quantized token
    and h, and farther from the unquantized result (the activations were quantized)."""
    fmts = MIXES[mix]
    (gate, up, down), (g64, u64, d64) = random_layer(fmts, seed=11 + tokens * top_k)
    experts = PackedGpuExperts(gate, up, down, DEV, native=native())
    assert experts.native is not None, experts.native_refusal
    x, ids, w = _inputs(tokens, top_k, seed=tokens + 7 * top_k)
    out = torch.full((tokens, H), float("nan"), device=DEV)
    assert experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out) is out
    torch.cuda.synchronize()
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64, int8_x=True, int8_h=32), INT8_TOL)
    if (ids >= 0).any():
        err = check_rows(out, reference_experts(x, ids, w, g64, u64, d64), 5e-2)
        assert err > INT8_TOL, "no quantization error: were the activations quantized?"


@pytest.mark.parametrize("tokens,top_k", [(1, 4), (3, 4), (2, 8)])
@pytest.mark.parametrize("mix", ["mx_mx_mx", "q4k_q4k_q6k"])
def test_native_swiglu_oai_matches_float64(mix, tokens, top_k, no_triton):
    """GPT-OSS's clamped SwiGLU (``swiglu_oai``) on MXFP4 experts (and K-quants): tokens large
    enough that gate and up values pass the clamp's limit on both sides, against float64 with
    the same activation over the quantized token and h."""
    from freetoken.backends.contract import SWIGLU_OAI_LIMIT

    (gate, up, down), (g64, u64, d64) = random_layer(MIXES[mix], seed=5 + tokens)
    experts = PackedGpuExperts(gate, up, down, DEV, activation="swiglu_oai", native=native())
    assert experts.native is not None, experts.native_refusal
    x, ids, w = _inputs(tokens, top_k, seed=31 + tokens)
    x = x * 40.0
    pre = torch.cat([g64[e] @ x[t].double() for t in range(tokens) for e in ids[t].tolist() if e >= 0]
                    + [u64[e] @ x[t].double() for t in range(tokens) for e in ids[t].tolist() if e >= 0])
    assert (pre > SWIGLU_OAI_LIMIT).any() and (pre < -SWIGLU_OAI_LIMIT).any(), "the clamp is never reached"
    out = torch.full((tokens, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    torch.cuda.synchronize()
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64, "swiglu_oai", int8_x=True, int8_h=32), INT8_TOL)
    # and not the SiLU's result
    silu = reference_experts(x, ids, w, g64, u64, d64, int8_x=True, int8_h=32)
    assert float((out.cpu().double() - silu).norm() / silu.norm()) > 0.05


@pytest.mark.parametrize("x_dtype,w_dtype,ids_dtype", [
    (torch.bfloat16, torch.float32, torch.int32), (torch.float16, torch.bfloat16, torch.int64),
    (torch.bfloat16, torch.float16, torch.int64)])  # fmt: skip
def test_native_experts_dtypes(x_dtype, w_dtype, ids_dtype, no_triton):
    """BF16/FP16 tokens, route weights of every float dtype, int64 ids; the output in x's dtype
    (stored once by the down kernel) and, through ``out``, in float32."""
    (gate, up, down), (g64, u64, d64) = random_layer((Q4, Q4, Q6), seed=3)
    experts = PackedGpuExperts(gate, up, down, DEV, native=native())
    x, ids, w = _inputs(3, 8, seed=5)
    x, w = x.to(x_dtype), w.to(w_dtype)
    ref = reference_experts(x, ids, w, g64, u64, d64, int8_x=True, int8_h=32)
    y = experts.forward(x.to(DEV), ids.to(ids_dtype).to(DEV), w.to(DEV))
    assert y.dtype == x_dtype
    check_rows(y, ref, BF16_TOL)
    out = torch.full((3, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(ids_dtype).to(DEV), w.to(DEV), out=out)
    check_rows(out, ref, INT8_TOL)


def test_native_experts_through_a_slot_table_in_a_graph(no_triton):
    """Ids through a slot table (an expert cache's: some entries -1) read by the kernels, in a
    captured graph replayed after the tokens, the routes and the table changed in place."""
    (gate, up, down), (g64, u64, d64) = random_layer((Q4, Q4, Q6), seed=21)
    experts = PackedGpuExperts(gate, up, down, DEV, native=native())
    n = 10
    table = torch.full((n,), -1, dtype=torch.int32, device=DEV)
    x_d = torch.empty(2, H, device=DEV)
    ids_d = torch.empty(2, 8, dtype=torch.int32, device=DEV)
    w_d = torch.empty(2, 8, device=DEV)
    out = torch.empty(2, H, device=DEV)
    gen = torch.Generator().manual_seed(4)

    def fill() -> torch.Tensor:
        t = torch.full((n,), -1, dtype=torch.int32)
        t[torch.randperm(n, generator=gen)[:7]] = torch.randint(0, E, (7,), generator=gen, dtype=torch.int32)
        table.copy_(t)
        x, w = torch.randn(2, H, generator=gen), torch.rand(2, 8, generator=gen) + 0.1
        ids = torch.randint(-1, n, (2, 8), generator=gen, dtype=torch.int32)
        x_d.copy_(x), ids_d.copy_(ids), w_d.copy_(w)
        mapped = torch.where(ids >= 0, t[ids.clamp(min=0).long()], torch.full_like(ids, -1))
        return reference_experts(x, mapped, w, g64, u64, d64, int8_x=True, int8_h=32)

    fill()
    experts.forward(x_d, ids_d, w_d, out=out, slot_table=table)  # eager once, as before a capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts.forward(x_d, ids_d, w_d, out=out, slot_table=table)
    for _ in range(3):
        ref = fill()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_rows(out, ref, INT8_TOL)
    assert experts.capture_fallbacks == 0


#: (experts, hidden, intermediate, gate/up format, down format, routes, activation) of real
#: layers: Qwen3-30B-A3B (several blocks per row on both sides, 24 gate/up blocks per route, 256
#: down blocks), GLM-4.5-Air (1408-value down rows, no multiple of 256: Q8_0 as llama.cpp writes
#: them; 32 of its 128 experts, which the kernels address alike) and GPT-OSS-120B (MXFP4, the
#: gate/up biases as one more 32-value block per row: 2880 + 32 columns, 1547-byte rows, so every
#: other expert starts at an odd address; 8 of its 128 experts)
REAL_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, Q4, Q6, 8, "silu"), "glm-4.5-air": (32, 4096, 1408, Q4, Q8, 8, "silu"),
               "gpt-oss-120b": (8, 2912, 2880, MX, MX, 4, "swiglu_oai")}  # fmt: skip


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_native_experts_real_shapes(shape, no_triton):
    """A real layer's shape and routes of one BF16 token, against float64."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from freetoken.models.gguf_writer import random_blocks
    from freetoken.loading.tensors import RawTensor

    e, hidden, inter, gu_fmt, down_fmt, top_k, activation = REAL_SHAPES[shape]
    rng = np.random.default_rng(9)
    raws, refs = [], []
    for name, fmt, rows, cols, scale in (("gate", gu_fmt, inter, hidden, 1e-4), ("up", gu_fmt, inter, hidden, 1e-4),
                                         ("down", down_fmt, hidden, inter, 1e-4)):
        b = random_blocks(fmt, e * rows, cols, rng, scale=scale)
        raws.append(RawTensor(name=name, shape=(e, rows, cols), fmt=fmt, data=b.reshape(e, rows, -1), source="random"))
        refs.append((b, fmt, rows, cols))
    experts = PackedGpuExperts(*raws, DEV, activation=activation, native=native())
    assert experts.native is not None, experts.native_refusal
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(e, generator=gen)[:top_k].reshape(1, top_k).to(torch.int32)
    w = torch.softmax(torch.randn(1, top_k, generator=gen), dim=-1)
    out = torch.full((1, hidden), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    torch.cuda.synchronize()
    used = sorted(set(ids[0].tolist()))
    local = {ex: i for i, ex in enumerate(used)}
    stacks = []
    for b, fmt, rows, cols in refs:  # only the routed experts dequantized (128 would take minutes)
        per = b.reshape(e, -1)[used]
        stacks.append(torch.from_numpy(gguf_dequantize(per, GGMLQuantizationType(fmt)).astype(np.float64)
                                       .reshape(len(used), rows, cols)))
    ids_local = ids.clone().apply_(lambda v: local[v])
    check_rows(out, reference_experts(x, ids_local, w, *stacks, activation, int8_x=True, int8_h=32), INT8_TOL)


def test_refusals_leave_the_triton_kernels():
    """What the native kernels do not serve runs the Triton kernels, with the reason kept:
    other formats, Q8_0 beside a K-quant in gate/up, another activation, more than 16 routes,
    intermediate sizes the down format cannot split; the extension's own checks name what is
    wrong."""
    kernels = native()
    (gate, up, down), _ = random_layer((Q4, Q8, Q4), seed=1)
    experts = PackedGpuExperts(gate, up, down, DEV, native=kernels)
    assert experts.native is None and "or both K-quants" in experts.native_refusal
    (gate, up, down), _ = random_layer((Q5, Q5, Q6), seed=1)
    assert "gate format 13" in PackedGpuExperts(gate, up, down, DEV, native=kernels).native_refusal
    (gate, up, down), _ = random_layer((Q4, Q4, Q6), seed=1)
    gelu = PackedGpuExperts(gate, up, down, DEV, activation="gelu_tanh", native=kernels)
    assert gelu.native is None and "activation" in gelu.native_refusal
    assert kernels.experts_refusal((MX, MX, MX), 2880 + 32, 2880, 4, "swiglu_oai", torch.bfloat16) == ""
    assert "multiple of 256" in kernels.experts_refusal((MX, MX, Q4), 2880 + 32, 2880, 4, "swiglu_oai", None)
    assert "1 to 16" in kernels.experts_refusal((Q4, Q4, Q6), H, 256, 17, "silu", torch.bfloat16)
    assert "multiple of 256" in kernels.experts_refusal((Q4, Q4, Q6), H, 96, 8, "silu", None)
    assert kernels.experts_refusal((Q4, Q4, Q8), H, 96, 8, "silu", None) == ""  # Q8_0 rows: of 32 values
    assert "multiple of 32" in kernels.experts_refusal((Q4, Q4, Q8), H, 80, 8, "silu", None)
    assert "multiple of 32 " in kernels.experts_refusal((Q8, Q8, Q8), 2880 + 16, 256, 8, "silu", None)
    assert "float64" in kernels.experts_refusal((Q4, Q4, Q6), H, 256, 8, "silu", torch.float64)
    with pytest.raises(ValueError, match="aligned"):
        _C.packed_moe(0, 8, 0, 1, 16, 0, 0, 16, 0, 8, 16, Q4, 16, Q4, 16, Q6, H, 256, 0, 1.702, 7.0, 16, 16, 0)
    with pytest.raises(ValueError, match="activation code 1"):
        _C.packed_moe(0, 16, 0, 1, 16, 0, 0, 16, 0, 8, 16, Q4, 16, Q4, 16, Q6, H, 256, 1, 1.702, 7.0, 16, 16, 0)

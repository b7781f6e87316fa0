"""The native one-token GEMV of freetoken-cuda (``packed_gemv``, freetoken/include/freetoken/gpu/
packed_gemv.cuh) behind PackedLinear, on the GPU machine.

Every result is compared with numpy float64 over gguf-py's dequantization of random Q4_K,
Q6_K and Q8_0 blocks, times the token quantized as the kernel does it (tests/gpu/expert_reference.int8_groups,
the same rounding as the Triton int8 dots); outputs are poisoned (NaN) first; row counts are
odd and wide matrices take several rows per warp. Without a GPU, or with an extension built
without the kernel, the module is skipped (CI compiles the kernel with nvcc: test_gpu_packages).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
if not torch.cuda.is_available():
    pytest.skip("no GPU: the native GEMV runs on the H200 machine", allow_module_level=True)
_C = pytest.importorskip("freetoken_cuda._C")
if not hasattr(_C, "packed_gemv"):
    pytest.skip("freetoken_cuda._C was built without packed_gemv", allow_module_level=True)

from expert_reference import int8_groups  # noqa: E402
from graph_timing import graph_sequence_time_us  # noqa: E402
from test_packed_dense import BF16_TOL, INT8_TOL, Q4, Q5, Q6, Q8, SCALES, packed, relative_error  # noqa: E402

from freetoken.models.gguf_writer import random_blocks  # noqa: E402
from freetoken.models import packed_linear  # noqa: E402
from freetoken.kernels import packed_linear as plt  # noqa: E402
from freetoken.native_gpu.gemv import NativePackedGemv  # noqa: E402

pytestmark = pytest.mark.gpu

NAMES = {Q4: "q4_k", Q6: "q6_k", Q8: "q8_0"}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def gemv_native() -> NativePackedGemv:
    return NativePackedGemv(_C, lambda: torch.cuda.current_stream().cuda_stream)


def blocks(fmt: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random blocks on the GPU as ``[rows, row_bytes]`` and gguf-py's float64 dequantization."""
    raw, ref = packed(fmt, rows, cols, seed)
    return torch.from_numpy(np.ascontiguousarray(raw.data)).reshape(rows, -1).cuda(), ref


#: (format, row length): the K-quants' rows of 1 .. 16 blocks; Q8_0's of 8 .. 128 blocks, also
#: lengths no K-quant takes (GLM-4.5-Air's 1408-value expert rows, GPT-OSS's 2880-value hidden)
GEMV_CASES = [(f, c) for f in (Q4, Q6) for c in (256, 2048, 4096)] + [(Q8, c) for c in (256, 1408, 2880, 4096)]


@pytest.mark.parametrize("x_dtype", list(DTYPES))
@pytest.mark.parametrize("fmt,cols", GEMV_CASES, ids=[f"{NAMES[f]}-{c}" for f, c in GEMV_CASES])
def test_native_gemv_matches_quantized_float64(fmt, cols, x_dtype):
    """517 and 3 rows (fewer than a block's four warps), every activation dtype; float32 out
    against float64 over the quantized token (and farther from the unquantized product: the
    token was quantized), BF16 and FP16 out within their step."""
    gemv = gemv_native()
    for rows in (517, 3):
        data, ref = blocks(fmt, rows, cols, seed=fmt * 1000 + cols + rows)
        g = torch.Generator().manual_seed(cols + rows)
        x = torch.randn(1, cols, generator=g).to(DTYPES[x_dtype]).cuda()
        quantized = int8_groups(x.cpu()).numpy() @ ref.T
        for y_dtype, tol in ((torch.float32, INT8_TOL), (torch.bfloat16, BF16_TOL), (torch.float16, BF16_TOL)):
            y = torch.full((1, rows), float("nan"), dtype=y_dtype, device="cuda")
            gemv.gemv(x, data, fmt, y)
            torch.cuda.synchronize()
            assert relative_error(y, quantized) <= tol, (rows, y_dtype)
        unquantized = x.cpu().double().numpy() @ ref.T
        y = torch.full((1, rows), float("nan"), dtype=torch.float32, device="cuda")
        gemv.gemv(x, data, fmt, y)
        assert relative_error(y, unquantized) > 1e-3, "no quantization error: was the token quantized?"


@pytest.mark.parametrize("fmt", [Q4, Q6, Q8], ids=[NAMES[Q4], NAMES[Q6], NAMES[Q8]])
def test_native_gemv_wide_matrix(fmt):
    """A head-like matrix (40,000 rows: several rows per warp over a grid of the resident
    blocks), against float64."""
    rows, cols = 40000, 2048
    data, ref = blocks(fmt, rows, cols, seed=fmt)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    y = torch.full((1, rows), float("nan"), dtype=torch.float32, device="cuda")
    gemv_native().gemv(x, data, fmt, y)
    torch.cuda.synchronize()
    assert relative_error(y, int8_groups(x.cpu()).numpy() @ ref.T) <= INT8_TOL


def test_packed_linear_takes_the_native_gemv_in_a_graph():
    """PackedLinear with the native GEMV: one token through it (captured in a CUDA graph,
    replayed with new tokens, equal to float64 each time), several tokens and refused
    formats through Triton, a misaligned token through Triton too (same result)."""
    gemv = gemv_native()
    scratch = packed_linear.PrefillScratch(torch.device("cuda"), torch.bfloat16)
    data, ref = blocks(Q6, 301, 2048, seed=11)
    lin = packed_linear.PackedLinear(data.reshape(-1), Q6, (301, 2048), scratch, native=gemv, dtype=torch.bfloat16)
    assert lin.native is gemv
    data5, _ = blocks(Q5, 64, 2048, seed=12)
    assert packed_linear.PackedLinear(data5.reshape(-1), Q5, (64, 2048), scratch, native=gemv,
                                      dtype=torch.bfloat16).native is None
    assert "Q4_K" in gemv.refusal(Q5, 2048, torch.bfloat16)
    assert "256" in gemv.refusal(Q4, 300, torch.bfloat16)
    assert "multiple of 32" in gemv.refusal(Q8, 300, torch.bfloat16)
    assert gemv.refusal(Q8, 1408, torch.bfloat16) == "" and gemv.refusal(Q4, 1408, torch.bfloat16) != ""
    x = torch.zeros(1, 2048, dtype=torch.bfloat16, device="cuda")
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        out["y"] = lin(x)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        xs = torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        x.copy_(xs)
        out["y"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out["y"], int8_groups(xs).numpy() @ ref.T) <= BF16_TOL
    # several tokens: the Triton byte tiles, unquantized
    x3 = torch.randn(3, 2048, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert relative_error(lin(x3.cuda()), x3.double().numpy() @ ref.T) <= BF16_TOL
    # a token 2 bytes off 16-byte alignment: Triton's int8 dots, the same quantization
    buf = torch.randn(1, 2049, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    off = buf[:, 1:]
    assert off.data_ptr() % 16 != 0
    assert relative_error(lin(off), int8_groups(off.cpu()).numpy() @ ref.T) <= BF16_TOL
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv.gemv(off, data, Q6, torch.empty(1, 301, device="cuda"))


def _rms64(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = h.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("formats", [(Q4, Q6), (Q4,), (Q6, Q4), (Q8, Q8), (Q4, Q8), (Q8, Q6)],
                         ids=["q4k+q6k", "q4k", "q6k+q4k", "q8+q8", "q4k+q8", "q8+q6k"])
def test_native_norm_gemv_against_float64(dtype, with_delta, formats):
    """The pre-norm in front of one or two matrices, one launch: h + delta exact (one rounding
    to the dtype, as torch adds), x against float64's RMSNorm within the dtype's rounding, and
    each matrix's rows against float64 over the kernel's own x quantized as the kernels do it
    (so a rounding of x cannot move the bound); outputs poisoned; a second call with fresh
    inputs, captured in a CUDA graph and replayed."""
    gemv = gemv_native()
    dt = DTYPES[dtype]
    cols, rows = 2048, (517, 3)
    mats = [blocks(f, r, cols, seed=f * 100 + r) for f, r in zip(formats, rows)]
    g = torch.Generator().manual_seed(len(formats) * 10 + with_delta)
    w = (1 + 0.5 * torch.randn(1, cols, generator=g)).to(dt).cuda()
    h = torch.empty(1, cols, dtype=dt, device="cuda")
    d = torch.empty(1, cols, dtype=dt, device="cuda")
    out: dict[str, object] = {}

    def call() -> None:
        out["r"] = gemv.norm_gemv(h, d if with_delta else None, w, 1e-6, [(m, f) for (m, _), f in zip(mats, formats)])

    def check(hs: torch.Tensor, ds: torch.Tensor) -> None:
        fused = out["r"]
        assert fused is not None, "the native GEMV takes the norm and these matrices"
        h_new, x, ys = fused  # type: ignore[misc]
        torch.cuda.synchronize()
        h_ref = (hs + ds) if with_delta else hs  # torch's add: one rounding to dt
        assert torch.equal(h_new.cpu(), h_ref), "h + delta"
        x_tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dt]
        err = float((x.cpu().double() - _rms64(h_ref, w.cpu(), 1e-6)).abs().max() / x.cpu().double().abs().max())
        assert err <= x_tol, f"x: {err:.3g}"
        xq = int8_groups(x.cpu()).numpy()
        for y, (_, ref), r in zip(ys, mats, rows):
            assert y.shape == (1, r) and y.dtype == dt
            assert relative_error(y, xq @ ref.T) <= (INT8_TOL if dt == torch.float32 else BF16_TOL), (r, dt)

    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        hs, ds = torch.randn(1, cols, generator=gen).to(dt), torch.randn(1, cols, generator=gen).to(dt)
        h.copy_(hs)
        d.copy_(ds)
        call()
        check(hs, ds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (7, 8):
        gen = torch.Generator().manual_seed(seed)
        hs, ds = torch.randn(1, cols, generator=gen).to(dt), torch.randn(1, cols, generator=gen).to(dt)
        h.copy_(hs)
        d.copy_(ds)
        for t in out["r"][2]:  # type: ignore[index]
            t.fill_(float("nan"))
        graph.replay()
        check(hs, ds)


def test_native_norm_gemv_declines_and_checks():
    """None for what it does not take (several tokens, mixed dtypes, three matrices, a refused
    format, a misaligned residual: the caller runs the norm and the GEMVs); the extension's
    own checks name the problem."""
    gemv = gemv_native()
    data, _ = blocks(Q4, 64, 2048, seed=1)
    data5, _ = blocks(Q5, 64, 2048, seed=2)
    h = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    w = torch.ones(1, 2048, dtype=torch.bfloat16, device="cuda")
    assert gemv.norm_gemv(h, None, w, 1e-6, [(data, Q4)]) is not None
    assert gemv.norm_gemv(h.expand(2, 2048).contiguous(), None, w, 1e-6, [(data, Q4)]) is None
    assert gemv.norm_gemv(h, None, w.float(), 1e-6, [(data, Q4)]) is None
    assert gemv.norm_gemv(h, None, w, 1e-6, [(data, Q4)] * 3) is None
    assert gemv.norm_gemv(h, None, w, 1e-6, [(data5, Q5)]) is None
    buf = torch.randn(1, 2049, device="cuda").to(torch.bfloat16)
    assert gemv.norm_gemv(buf[:, 1:], None, w, 1e-6, [(data, Q4)]) is None
    with pytest.raises(ValueError, match="16-byte aligned"):
        _C.packed_gemv_norm(0, buf[:, 1:].data_ptr(), 0, w.data_ptr(), 1e-6, 0, h.data_ptr(), 2, 2048,
                            data.data_ptr(), Q4, 64, data.stride(0), h.data_ptr(), 0, Q4, 0, 0, 0)
    with pytest.raises(ValueError, match="Q4_K"):
        _C.packed_gemv_norm(0, h.data_ptr(), 0, w.data_ptr(), 1e-6, 0, h.data_ptr(), 2, 2048,
                            data5.data_ptr(), Q5, 64, data5.stride(0), h.data_ptr(), 0, Q4, 0, 0, 0)


#: Qwen3-30B-A3B: a layer's q/k (Q4_K, fused), v (Q6_K in half of Q4_K_M's layers) and o, the head
QWEN3_SHAPES = [("qk", 4096 + 512, 2048, Q4), ("v", 512, 2048, Q6), ("o", 2048, 4096, Q4),
                ("head", 151936, 2048, Q6)]


def test_native_gemv_timing():
    """Graph-replayed time per call at the Qwen3-30B-A3B shapes, native against Triton's int8
    tiles, each call on another copy of the weights (>= 256 MB in turn: read from HBM, not
    L2); printed, not asserted (``-s``), with the HBM floor of the packed bytes (4.3 TB/s)."""
    rng = np.random.default_rng(0)
    gemv = gemv_native()
    for name, rows, cols, fmt in QWEN3_SHAPES:
        b = torch.from_numpy(random_blocks(fmt, rows, cols, rng, scale=SCALES[fmt])).reshape(rows, -1).cuda()
        copies = [b] + [b.clone() for _ in range(max(0, -(-(256 << 20) // b.numel()) - 1))]
        mats = [plt.PackedMatrix.from_bytes(c.reshape(-1), fmt, rows, cols) for c in copies]
        x = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
        y = torch.empty(1, rows, dtype=torch.bfloat16, device="cuda")
        y2 = torch.empty_like(y)
        cfg = plt.config_for(rows, x.device)
        native_us = graph_sequence_time_us([lambda c=c: gemv.gemv(x, c, fmt, y) for c in copies], 10)
        triton_us = graph_sequence_time_us([lambda m=m: plt.gemv(x, m, y2, cfg) for m in mats], 10)
        err = float((y.float() - y2.float()).abs().max() / y2.float().abs().max())
        assert err <= BF16_TOL, (name, err)
        print(f"{name} [{rows}, {cols}] {NAMES[fmt]}: native {native_us:.1f} us, triton {triton_us:.1f} us "
              f"({b.numel() / 1e6:.2f} MB, HBM floor {b.numel() / 4.3e12 * 1e6:.1f} us, native "
              f"{b.numel() / native_us / 1e6:.2f} TB/s)")


def test_native_norm_gemv_timing():
    """Graph-replayed time per layer of the attention pre-norm and q/k/v at Qwen3-30B-A3B's
    shapes, one ``packed_gemv_norm`` launch against ``add_rms_norm`` and a GEMV per group:
    a Q4_K q/k with a Q6_K v (half of Q4_K_M's layers) and one Q4_K q/k/v; each call on
    another copy of the weights (>= 256 MB in turn). Printed (``-s``), not asserted; the
    outputs of the two ways agree within BF16's step."""
    from freetoken.kernels import dense_ops as dot

    rng = np.random.default_rng(1)
    gemv = gemv_native()
    cols = 2048
    h = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
    d = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(cols, device="cuda")).to(torch.bfloat16)
    for name, groups in (("q/k Q4_K + v Q6_K", ((4608, Q4), (512, Q6))), ("q/k/v Q4_K", ((5120, Q4),))):
        one = [torch.from_numpy(random_blocks(f, r, cols, rng, scale=SCALES[f])).reshape(r, -1).cuda() for r, f in groups]
        per_copy = sum(t.numel() for t in one)
        sets = [one] + [[t.clone() for t in one] for _ in range(max(0, -(-(256 << 20) // per_copy) - 1))]
        fmts = [f for _, f in groups]
        h2, x2 = torch.empty_like(h), torch.empty_like(h)
        ys = [torch.empty(1, r, dtype=torch.bfloat16, device="cuda") for r, _ in groups]
        out: dict[str, object] = {}

        def separate(mats):
            dot.add_rms_norm(h, d, w, 1e-6, h2, x2)
            for m, f, y in zip(mats, fmts, ys):
                gemv.gemv(x2, m, f, y)

        def fused(mats):
            out["r"] = gemv.norm_gemv(h, d, w, 1e-6, list(zip(mats, fmts)))

        sep_us = graph_sequence_time_us([lambda m=m: separate(m) for m in sets], 10)
        fused_us = graph_sequence_time_us([lambda m=m: fused(m) for m in sets], 10)
        separate(sets[-1])
        fused(sets[-1])
        torch.cuda.synchronize()
        for y_sep, y_fused in zip(ys, out["r"][2]):  # type: ignore[index]
            err = float((y_sep.float() - y_fused.float()).abs().max() / y_sep.float().abs().max())
            assert err <= BF16_TOL, (name, err)
        print(f"{name}: pre-norm + GEMVs {sep_us:.2f} us, packed_gemv_norm {fused_us:.2f} us per layer "
              f"({per_copy / 1e6:.2f} MB)")

"""Programmatic dependent launch of the decode step's kernels
(:mod:`freetoken.backends.dependent_launch`).

Without a GPU: the setting is never active off a GPU, and the Triton kernels that take part
compile for the H200 (sm_90) with the wait and the trigger in their code exactly when asked
(a subprocess without TRITON_INTERPRET). On the H200: a chain of native kernels each reading
what the one before it wrote (GEMV, norm GEMV, both expert kernels, GEMV), launched dependent
in a replayed graph with every intermediate poisoned (NaN) inside the graph before the kernel
that writes it, gives bit for bit what the same chain gives launched one after another; the
engine's logits and tokens with ``--gpu-dependent-launch on`` equal those with ``off``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken.backends import dependent_launch


@pytest.fixture
def enabled():
    before = dependent_launch.enabled()
    dependent_launch.set_enabled(True)
    yield
    dependent_launch.set_enabled(before)


def test_never_active_off_a_gpu(enabled):
    assert dependent_launch.enabled()
    assert "not a GPU" in dependent_launch.refusal("cpu")
    assert not dependent_launch.active("cpu") and dependent_launch.triton_options("cpu") == {}
    dependent_launch.set_enabled(False)
    assert not dependent_launch.enabled()


_SM90_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from triton_hip_compile import attention_kernels, dense_kernels
from freetoken.backends.triton_target import cuda_target
target, report = cuda_target((9, 0)), {}
for gdc in (True, False):
    kernels = {**dense_kernels(target, gdc), **attention_kernels(target, gdc)}
    for name in ("dense.qk_norm_rope", "dense.add_norm_route", "attention.partial"):
        ptx = kernels[name]().asm["ptx"]
        report[f"{name}:{gdc}"] = ["griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx]
print(json.dumps(report))
"""


def test_triton_kernels_wait_and_trigger_exactly_when_asked():
    """The q/k norm + RoPE, routing and attention kernels compiled for sm_90: with ``GDC`` their
    code waits for the kernel before (``griddepcontrol.wait``) and lets the next one start
    (``launch_dependents``); without it neither instruction is there."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    helpers = Path(__file__).resolve().parent.parent / "core" / "backends"  # triton_hip_compile.py: the signatures
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, str(helpers)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 6, report
    for key, (wait, trigger) in report.items():
        want = key.endswith(":True")
        assert wait == want and trigger == want, report


# ---- on the GPU ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                         reason="needs an NVIDIA GPU of compute capability 9.0+ (the H200 machine runs it)")


def _native():
    c = pytest.importorskip("freetoken_cuda._C")
    if not hasattr(c, "packed_moe"):
        pytest.skip("freetoken_cuda._C was built without the packed kernels")
    from freetoken.moe.native_gemv import NativePackedGemv

    return NativePackedGemv(c, lambda: torch.cuda.current_stream().cuda_stream)


@pytest.mark.gpu
@gpu
def test_native_chain_in_a_graph_equals_the_serial_launches(enabled):
    """x -> GEMV (Q4_K 2048x2048) -> norm GEMV (Q6_K 512 rows + Q4_K 256 rows) -> the expert
    kernels (8 routes) -> GEMV (Q4_K 1024x512): each kernel reads what the one before it wrote,
    each intermediate is set to NaN inside the graph just before it is written. Replayed 20
    times with fresh inputs and routes, launched dependent: equal bit for bit to the chain
    launched plainly (eagerly) on the same inputs, and finite."""
    pytest.importorskip("gguf")
    from test_native_gemv import blocks
    from test_packed_dense import Q4, Q6
    from test_packed_experts import E, H, random_layer

    from freetoken.moe.gpu_packed_experts import PackedGpuExperts

    gemv = _native()
    assert dependent_launch.active("cuda")
    a, _ = blocks(Q4, 2048, 2048, seed=1)
    b, _ = blocks(Q6, H, 2048, seed=2)
    b2, _ = blocks(Q4, 256, 2048, seed=3)
    c, _ = blocks(Q4, 1024, H, seed=4)
    (gate, up, down), _ = random_layer((Q4, Q4, Q6), seed=5)
    experts = PackedGpuExperts(gate, up, down, "cuda", native=gemv)
    assert experts.native is not None, experts.native_refusal
    gen = torch.Generator().manual_seed(6)
    norm_w = (torch.rand(1, 2048, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    x = torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda")
    ids = torch.empty(1, 8, dtype=torch.int32, device="cuda")
    w = torch.empty(1, 8, device="cuda")
    y1 = torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda")
    moe_out = torch.empty(1, H, dtype=torch.bfloat16, device="cuda")
    y3 = torch.empty(1, 1024, device="cuda")

    def chain() -> list[torch.Tensor]:
        y1.fill_(float("nan"))
        gemv.gemv(x, a, Q4, y1)
        _, normed, (yb, yb2) = gemv.norm_gemv(y1, None, norm_w, 1e-6, [(b, Q6), (b2, Q4)])
        moe_out.fill_(float("nan"))
        experts.forward(yb, ids, w, out=moe_out)
        y3.fill_(float("nan"))
        gemv.gemv(moe_out, c, Q4, y3)
        return [y1, normed, yb, yb2, moe_out, y3]

    def fill() -> None:
        x.copy_(torch.randn(1, 2048, generator=gen).to(torch.bfloat16))
        ids.copy_(torch.randint(0, E, (1, 8), generator=gen, dtype=torch.int32))
        w.copy_(torch.rand(1, 8, generator=gen) + 0.1)

    fill()
    chain()  # compiled and allocated before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(20):
        fill()
        graph.replay()
        got = [t.clone() for t in outs]
        dependent_launch.set_enabled(False)
        want = [t.clone() for t in chain()]
        dependent_launch.set_enabled(True)
        torch.cuda.synchronize()
        for g, r in zip(got, want):
            assert torch.isfinite(g.float()).all(), "a kernel read an intermediate before it was written"
            assert torch.equal(g, r)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_engine_logits_equal_with_and_without(backend, eager, tmp_path):
    """A tiny Q4_K/Q6_K GGUF, every expert on the GPU, the dense weights packed (native GEMVs,
    the norm GEMV, the native expert kernels, the Triton norm/RoPE, attention and routing):
    ``--gpu-dependent-launch on`` (active, as the report says) gives the tokens and logits of
    ``off`` bit for bit."""
    pytest.importorskip("gguf")
    from greedy_runs import run_greedy
    from test_gpu_engine import INT8_MIX, _gguf_helpers

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    _native()
    tg = _gguf_helpers()
    mix = [{name: getattr(tg.Fmt, fmt) for name, fmt in layer.items()} for layer in INT8_MIX]
    path = str(tmp_path / "tiny.gguf")
    tg.write_tiny_gguf(path, seed=13, mix=mix)
    prompts = [[(5 * i + 3 * j) % (tg.V - 10) + 5 for j in range(n)] for i, n in enumerate((6, 21, 1))]
    runs = {}
    for setting in ("on", "off"):
        eng = LLMEngine(EngineConfig(model=path, dtype="bfloat16", max_model_len=128, kv_cache_tokens=1024,
                                     gpu_dense="packed", enforce_eager=eager, cuda_graph_max_bs=8,
                                     gpu_dependent_launch=setting),
                        backend=backend)  # fmt: skip
        try:
            info = eng.backend_info()
            assert info["dependent_launch"]["active"] == (setting == "on"), info["dependent_launch"]
            assert info["moe_gpu_kernel"]["native_layers"] > 0 and info["gpu_gemv"]["native_linears"] > 0, info
            runs[setting] = run_greedy(eng, prompts, max_tokens=10)
        finally:
            eng.close()
    for (ids_a, logits_a), (ids_o, logits_o) in zip(runs["on"], runs["off"]):
        assert ids_a == ids_o
        assert torch.equal(logits_a, logits_o)

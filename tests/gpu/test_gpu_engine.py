"""The whole model on the GPU backend against the CPU backend (run on the GPU machine).

The demo model (random weights, FP32 checkpoint) is generated greedily by the CPU backend;
the GPU engine then decodes the same requests with its logits recorded, for placements
all-CPU / mixed / all-GPU, eager and with decode graphs. The CPU backend is the independent
reference (synchronous CPU execution). Bounds: FP32 activations on the GPU agree with the
CPU to float32 summation-order noise (1e-3 of the logits' scale); BF16 to 5e-2, with the
argmax equal wherever the reference's top-2 margin is clear.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from greedy_runs import check_logits, run_greedy

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40, 2, 17, 31, 12))]


def _engine(backend, **kw):
    return LLMEngine(EngineConfig(max_model_len=256, kv_cache_tokens=4096, **kw), backend=backend)


@pytest.fixture(scope="module")
def reference():
    from freetoken_cpu_moe.backend import CpuBackend

    eng = _engine(CpuBackend(), dtype="float32")
    out = run_greedy(eng, PROMPTS)
    eng.close()
    return out


@pytest.mark.parametrize("placement", ["all", "0-1", "0"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_cuda_engine_matches_cpu(backend, reference, placement, eager, dtype, tol):
    eng = _engine(backend, dtype=dtype, moe_cpu_layers=placement, enforce_eager=eager, cuda_graph_max_bs=8)
    try:
        info = eng.backend_info()
        assert info["graphs"] is (not eager), info
        got = run_greedy(eng, PROMPTS)
        info = eng.backend_info()
        if placement != "0":
            assert info["io_path"] in ("kernel_io", "copy"), info
    finally:
        eng.close()
    check_logits(got, reference, tol)


def test_concurrent_equals_alone(backend):
    # no prefix cache: the requests alone compute their prompts again, as they did together
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="0-1", cuda_graph_max_bs=8, enable_prefix_cache=False)
    try:
        together = run_greedy(eng, PROMPTS)
        alone = [run_greedy(eng, [p])[0] for p in PROMPTS]
    finally:
        eng.close()
    for (a, la), (b, lb) in zip(together, alone):
        assert a == b
        assert float((la - lb).abs().max() / lb.abs().max()) < 5e-2


def _ahead_and_not(monkeypatch, run, backend, **kw) -> dict:
    """``run(engine)`` on an engine with decode ahead off, then on (``{False: .., True: ..}``),
    each checked to launch steps ahead or not."""
    runs = {}
    for ahead in (False, True):
        eng = _engine(backend, decode_ahead=ahead, **kw)
        launched = []
        real = eng.session.decode_ahead
        monkeypatch.setattr(eng.session, "decode_ahead", lambda *a: launched.append(1) or real(*a))
        try:
            runs[ahead] = run(eng)
        finally:
            eng.close()
        assert (len(launched) > 10) == ahead, len(launched)
    return runs


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_decode_ahead_equals_steps_read_back(backend, eager, monkeypatch):
    """``--decode-ahead`` on the GPU with two layers' experts on the CPU (the next step's
    hand-offs queued while the host reads this step's tokens): the same greedy tokens as the
    engine that reads every step's tokens first, logits within float32 summation order."""
    runs = _ahead_and_not(monkeypatch, lambda eng: run_greedy(eng, PROMPTS, 24), backend, dtype="float32",
                          moe_cpu_layers="0-1", enforce_eager=eager, cuda_graph_max_bs=8)
    for (ids, logits), (ref_ids, ref_logits) in zip(runs[True], runs[False]):
        assert ids == ref_ids
        assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_decode_ahead_with_seeded_sampled_requests(backend, eager, monkeypatch):
    """Plain sampled requests (temperature, top-k, seeds) beside greedy ones go ahead on the
    GPU (drawn on the device): the same tokens as the engine that reads every step's tokens
    back first."""
    from freetoken.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=20, temperature=t, top_k=k, seed=s, ignore_eos=True)
              for t, k, s in ((0.8, 0, 1), (0.0, 0, None), (1.2, 40, 3), (0.7, 5, 4))]
    def run(eng):
        reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        while eng.has_work():
            eng.step()
        return [r.output_ids for r in reqs]

    runs = _ahead_and_not(monkeypatch, run, backend, dtype="bfloat16", moe_cpu_layers="0-1", enforce_eager=eager,
                          cuda_graph_max_bs=8)
    assert runs[True] == runs[False]
    assert all(len(ids) == 20 for ids in runs[True])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream order on a CUDA device")
def test_tokens_read_back_before_the_step_queued_after_them():
    """Decode ahead reads a step's tokens through a copy queued before the next step: the
    values arrive while a kernel queued after the read still runs (a ~1 s sleep kernel stands
    in for the next step), where ``tolist()`` would wait for it; the values are the tensor's."""
    import time

    from freetoken.engine.engine import _read_back_later

    t = torch.randint(0, 151936, (3,), device="cuda")
    expect = t.cpu().tolist()
    torch.cuda.synchronize()
    read = _read_back_later(t)
    torch.cuda._sleep(2_000_000_000)  # GPU clock cycles: about a second at 2 GHz
    t0 = time.perf_counter()
    values = read()
    waited = time.perf_counter() - t0
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert values == expect
    assert still_running and waited < 0.5, f"the read waited {waited:.3f} s: for the kernel queued after it?"


def test_recapture_on_demand(backend):
    """Graphs captured again between steps (tasks and scratch block kept) decode the same."""
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="0-1", cuda_graph_max_bs=8, enable_prefix_cache=False)
    try:
        first = run_greedy(eng, PROMPTS)
        free = eng.kv.free_blocks + eng.prefix_cache.num_cached_free  # blocks no request holds
        eng.session.recapture_graphs()
        second = run_greedy(eng, PROMPTS)
        assert eng.kv.free_blocks + eng.prefix_cache.num_cached_free == free
    finally:
        eng.close()
    for (a, la), (b, lb) in zip(first, second):  # the GPU experts' atomic adds may sum in another order
        assert a == b
        assert float((la - lb).abs().max() / lb.abs().max()) < 1e-2


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_prefix_cache_hits_decode_like_a_fresh_prompt(backend, eager):
    """The same requests again: their prompts' full blocks come from the prefix cache (read
    by the paged attention and the decode graphs), and they decode as the first time did."""
    eng = _engine(backend, dtype="float32", moe_cpu_layers="0-1", cuda_graph_max_bs=8, enforce_eager=eager)
    try:
        first = run_greedy(eng, PROMPTS)
        hits_before = eng.stats().prefix_cache_hits
        second = run_greedy(eng, PROMPTS)
        hits = eng.stats().prefix_cache_hits - hits_before
    finally:
        eng.close()
    # every prompt of 17 tokens or more has a full 16-token block to reuse
    assert hits >= 16 * sum(1 for p in PROMPTS if len(p) > 16), hits
    check_logits(second, first, 1e-3)


def test_memory_limit_refuses_with_sizes(backend):
    from freetoken.backends.contract import MemoryPlanError

    with pytest.raises(MemoryPlanError, match="--moe-cpu-layers|--gpu-memory-limit"):
        _engine(backend, dtype="bfloat16", moe_cpu_layers="0", gpu_memory_limit=1 << 20)


@pytest.mark.parametrize("fault,io_path,graphs_expected", [
    ("kernel_io@graph:stale", "kernel_io", False),  # replay wrong only: graphs off, KernelIO kept
    ("kernel_io:stale", "copy", True),  # KernelIO wrong eagerly: the copy path, graphs on
    ("kernel_io:stale,copy@graph:stale", "copy", False),  # the copy path's replay wrong too: graphs off
])
def test_qualification_fault_decides_path_and_graphs(backend, reference, monkeypatch, fault, io_path,
                                                     graphs_expected):
    """Each injected fault through the real engine start: the path and graphs the policy
    picks, a warning saying why, and a model that still decodes like the CPU backend."""
    monkeypatch.setenv("FREETOKEN_FAULT_INJECT", fault)
    from freetoken.moe.qualify import startup as qualify

    qualify.LAST_RESULTS.clear()
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all")
    try:
        info = eng.backend_info()
        assert info["io_path"] == io_path and info["graphs"] is graphs_expected, info
        assert info["warnings"], info
        # the fault stays injected while serving: the chosen path must avoid it
        got = run_greedy(eng, PROMPTS[:3])
    finally:
        eng.close()
    check_logits(got, reference[:3], 5e-2)


@pytest.mark.parametrize("fault", ["kernel_io:error", "kernel_io:stale,copy:stale", "kernel_io:error,copy:error"])
def test_qualification_eager_error_refuses_start(backend, monkeypatch, fault):
    """An API error, or every path wrong eagerly: the engine refuses to start."""
    from freetoken.moe.qualify import startup as qualify
    from freetoken.moe.qualify.startup import QualificationError

    monkeypatch.setenv("FREETOKEN_FAULT_INJECT", fault)
    qualify.LAST_RESULTS.clear()
    with pytest.raises(QualificationError):
        _engine(backend, dtype="bfloat16", moe_cpu_layers="all")


# ---------------------------------------------------------------- GGUF K-quants


def _gguf_helpers():
    """tests/engine/test_engine_gguf.py: the tiny K-quant file writer and its HF reference."""
    import importlib.util
    import os
    import sys

    here = os.path.join(os.path.dirname(__file__), "..", "engine")
    if here not in sys.path:
        sys.path.insert(0, here)
    spec = importlib.util.spec_from_file_location("ft_gpu_tiny_gguf", os.path.join(here, "test_engine_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tg = _gguf_helpers()
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return tg, path, tg.write_tiny_gguf(path, seed=11)


@pytest.mark.parametrize("placement,cpu_layers", [("all", {0, 1}), ("1", {0}), ("0", set())],
                         ids=["all-cpu", "mixed", "all-gpu"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_engine_gguf_kquants_match_float64_reference(backend, tiny_gguf, monkeypatch, placement, cpu_layers,
                                                          eager):  # fmt: skip
    """FP32, a GGUF with Q4_K/Q5_K/Q6_K/Q8_0/F16/BF16 tensors: the GPU engine's logits at
    every generated position equal a float64 forward (tests/gpu/qwen3_reference.py) over
    the tensors as gguf-py dequantizes them, run on the engine's own tokens (teacher
    forcing). Experts of CPU layers run the CPU kernels (no locked fetch: every route of a
    CPU layer on the CPU), which round activations to int8 per 32 values: the reference applies that rounding to those layers' expert inputs (the
    scheme of tests/engine/test_engine_gguf.py), and the bound is that file's documented one
    for rounding-boundary flips. GPU-resident layers dequantize everything: float32
    summation order only (1e-3 of the logits' scale, the bound of the FP32 demo-model test):
    the packed experts' byte tiles (NVIDIA's default int8 dots: the test below)."""
    import qwen3_reference

    from freetoken.kernels import moe_packed

    monkeypatch.setattr(moe_packed, "NVIDIA_CONFIG", moe_packed.DEFAULT_CONFIG)
    tg, path, tensors = tiny_gguf

    def expert_input(layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        if layer not in cpu_layers:
            return x
        fmt = tg.MIX[layer][f"ffn_{name}_exps"]
        return tg.quantize_activations(x.float(), fmt).double()

    eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 moe_cpu_layers=placement, enforce_eager=eager, cuda_graph_max_bs=8,
                                 moe_locked_fetch=0), backend=backend)  # fmt: skip
    try:
        info = eng.backend_info()
        assert info["graphs"] is (not eager), info
        prompts = [[(7 * i + 3 * j) % (tg.V - 10) + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40))]
        got = run_greedy(eng, prompts)
    finally:
        eng.close()
    for prompt, (out, logits) in zip(prompts, got):
        ids = prompt + out
        want = qwen3_reference.logits(tensors, ids, tg.LAYERS, tg.HEADS, tg.KVH, tg.HD, tg.K, theta=1e6,
                                      expert_input=expert_input)[len(prompt) - 1 : len(ids) - 1].float()  # fmt: skip
        if cpu_layers:
            tg.assert_close_rounding(logits, want, f"placement {placement}")
        else:
            err = float((logits - want).abs().max() / want.abs().max())
            assert err <= 1e-3, f"all experts on the GPU: logits differ by {err:.3g} of their scale"


# ---------------------------------------------------------------- int8 dots in the engine

#: every GPU layer's expert stacks in the formats the int8 dots serve: Q4_K gate/up pairs,
#: Q6_K and Q4_K down
INT8_MIX = [
    {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "Q6_K", "attn_output": "Q4_K",
     "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
    {"attn_q": "Q4_K", "attn_k": "BF16", "attn_v": "Q8_0", "attn_output": "Q6_K",
     "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_K"},
]  # fmt: skip


@pytest.fixture(scope="module")
def int8_gguf(tmp_path_factory):
    tg = _gguf_helpers()
    mix = [{name: getattr(tg.Fmt, fmt) for name, fmt in layer.items()} for layer in INT8_MIX]
    path = str(tmp_path_factory.mktemp("gguf8") / "int8.gguf")
    return tg, mix, path, tg.write_tiny_gguf(path, seed=12, mix=mix)


@pytest.mark.parametrize("eager,int8_h,kernel", [(True, False, "triton"), (True, True, "triton"),
                                                 (False, True, "triton"), (True, False, "native"),
                                                 (False, False, "native")],
                         ids=["eager-h-float", "eager", "graphs", "native-eager", "native-graphs"])  # fmt: skip
def test_cuda_engine_int8_dots_match_rounding_reference(backend, int8_gguf, monkeypatch, eager, int8_h, kernel):
    """FP32, every expert on the GPU with NVIDIA's default tiles (int8 dots,
    ``moe_packed.NVIDIA_CONFIG``; also with h left in float32 for the down kernel), or
    the native expert kernels (``--moe-gpu-kernel native``): the engine's logits against the
    float64 forward of the K-quant test above whose expert inputs are rounded as the kernels
    round them (tests/gpu/int8_model_reference.py: gate/up inputs per 32 values, h per 16 when
    the Triton gate/up kernel quantizes it, else per 32 by the down kernel; per 32 both in the
    native kernels). Bound: 3e-3 of the logits' scale (float32 summation order and the
    rare rounding-boundary flip it causes); the same reference without the rounding must
    miss by more (the int8 dots ran)."""
    import dataclasses

    from int8_model_reference import expert_hook, position_errors

    from freetoken.kernels import moe_packed

    tg, mix, path, tensors = int8_gguf
    config = dataclasses.replace(moe_packed.NVIDIA_CONFIG, int8_h=int8_h)
    assert config.int8_dot, "NVIDIA's default expert tiles are the int8 dots"
    monkeypatch.setattr(moe_packed, "NVIDIA_CONFIG", config)

    def expert_input(rounded: bool):
        return expert_hook(mix, int8_h, native=kernel == "native") if rounded else None

    eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 moe_cpu_layers="0", enforce_eager=eager, cuda_graph_max_bs=8,
                                 moe_gpu_kernel=kernel),
                    backend=backend)  # fmt: skip
    try:
        info = eng.backend_info()["moe_gpu_kernel"]
        assert info["native_layers"] == (info["native_layers"] + info["triton_layers"] if kernel == "native" else 0)
        prompts = [[(5 * i + 3 * j) % (tg.V - 10) + 5 for j in range(n)] for i, n in enumerate((6, 21, 11, 37))]
        got = run_greedy(eng, prompts)
    finally:
        eng.close()
    errs, plain = [], []
    for prompt, (out, logits) in zip(prompts, got):
        for rounded, sink in ((True, errs), (False, plain)):
            sink.append(max(position_errors(tg, tensors, prompt + out, len(prompt), logits, expert_input(rounded))))
    assert max(errs) <= 3e-3, f"int8 dots against the rounding reference: {errs} of the logits' scale"
    assert min(plain) > 2 * max(errs), f"the unrounded reference fits as well ({plain} vs {errs}): no int8 dots ran?"


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_engine_int8_dense_match_rounding_reference(backend, int8_gguf, eager):
    """FP32, every expert on the GPU and the dense weights packed, NVIDIA's defaults: the
    one-token GEMV of Q4_K/Q6_K projections and of the Q6_K head runs int8 dots (the
    activations quantized per 32 values), of Q8_0 ones too (the native GEMV, the default on
    NVIDIA), batches of several tokens the byte tiles. One
    request, so the prompt's projections are one batch and every decode step and every logits
    row is one token: the float64 reference rounds the dense inputs of the positions after the
    prompt and every head input, and the experts' inputs as above. Position by position, as
    test_packed_dense.py's interpreter run of the same rules: a position's error is float32
    noise (bound 3e-3 of the logits' scale, as above) unless that noise moved an activation
    across a rounding boundary (one flip: up to 4e-2), so at least 9 of the 12 positions
    within 3e-3 and all within 4e-2; the reference without the dense rounding at least twice
    as far off at 9 of them too (the int8 GEMV ran)."""
    from int8_model_reference import dense_hook, expert_hook, position_errors

    from freetoken.kernels import packed_linear as plt

    tg, mix, path, tensors = int8_gguf
    assert plt.config_for(tg.V, "cuda").int8_dot, "NVIDIA's default GEMV tiles are the int8 dots"
    prompt = [(11 * j) % (tg.V - 10) + 5 for j in range(21)]  # above the GEMV's batch sizes: one matmul
    experts = expert_hook(mix, int8_h=True)

    eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 moe_cpu_layers="0", gpu_dense="packed", enforce_eager=eager,
                                 cuda_graph_max_bs=8, moe_gpu_kernel="triton"),
                    backend=backend)  # fmt: skip
    try:
        assert eng.backend_info()["dense_form"] == "packed"
        ((out, logits),) = run_greedy(eng, [prompt], max_tokens=12)
    finally:
        eng.close()
    ids = prompt + out

    err, plain = (position_errors(tg, tensors, ids, len(prompt), logits, experts, hook)
                  for hook in (dense_hook(mix, tg.OUTPUT_FMT, len(prompt), native=True), None))  # fmt: skip
    assert len(err) == 12, err
    assert sum(e <= 3e-3 for e in err) >= 9, f"int8 GEMV against the rounding reference, per position: {err}"
    assert max(err) <= 4e-2, f"int8 GEMV against the rounding reference, per position: {err}"
    closer = sum(p > 2 * e for p, e in zip(plain, err))
    assert closer >= 9, f"the reference without the dense rounding fits as well: {plain} vs {err}"


def _worker_threads() -> dict[int, set[int]]:
    """Expert worker threads (named ft-pool) and coordinator poll threads of this process:
    native id -> the CPUs the kernel lets them run on, read from /proc."""
    import os

    out: dict[int, set[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name in ("ft-pool", "ft-coordinator"):
                out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:
            continue
    return out


@pytest.mark.parametrize("setting", ["on", "off"])
def test_host_threads_keep_off_the_workers_cores(backend, reference, setting, physical_core):
    """``--pin-host-threads on``: the thread that steps the model runs only on CPUs whose
    physical cores hold no expert worker (the workers' CPU sets read from /proc), during the
    session; it gets its former CPU set back at close. ``off`` leaves it alone. Tokens and
    logits as the CPU backend's either way."""
    import os

    before = os.sched_getaffinity(0)
    older = set(_worker_threads())  # other pools of this process (the reference's)
    eng = _engine(backend, dtype="float32", moe_cpu_layers="0-1", cuda_graph_max_bs=8, cpu_threads=2,
                  pin_host_threads=setting)
    try:
        got = run_greedy(eng, PROMPTS)
        report = eng.backend_info()
        info = report["host_threads"]
        assert report["cpu_spin_ms"] == 20.0 and eng.session.coordinator.pool.spin_us == 20_000.0, report
        mine = os.sched_getaffinity(0)
        workers = set().union(*[cpus for tid, cpus in _worker_threads().items() if tid not in older])
        if setting == "off":
            assert info == {"setting": "off", "because": "off (--pin-host-threads off)"}
            assert mine == before
        else:
            assert info["because"] is None and info["threads"] >= 1, info
            assert mine == set(info["cpus"]) and mine < before
            cores = {physical_core(c) for c in workers}
            assert workers and not {physical_core(c) for c in mine} & cores, (mine, workers)
    finally:
        eng.close()
    assert os.sched_getaffinity(0) == before
    check_logits(got, reference, 1e-3)


def _compiled_variants(kernels) -> list[int]:
    """Compiled variants in this process's in-memory caches of each Triton kernel (Triton 3:
    ``device_caches[device][0]`` maps a specialisation to its compiled kernel)."""
    counts = []
    for k in kernels:
        caches = getattr(k, "device_caches", None)
        if caches is None:
            pytest.skip(f"{k}: this Triton keeps no device_caches, the compiled variants cannot be counted")
        counts.append(sum(len(entry[0]) for entry in caches.values()))
    return counts


def test_prompts_compile_no_kernel_after_the_warmup(backend, caplog):
    """After the start-up warm-up, prompts of other lengths (so other routes blocks and mixed
    steps with decodes) build no new variant of the grouped prompt kernels."""
    import logging

    from freetoken.kernels import moe_grouped
    from freetoken.models.demo import ensure_demo_model

    kernels = (moe_grouped._gate_up_grouped_kernel, moe_grouped._down_grouped_kernel)
    with caplog.at_level(logging.INFO, logger="freetoken.engine.engine"):
        eng = LLMEngine(EngineConfig(model=ensure_demo_model().gguf_path, max_model_len=1024, kv_cache_tokens=8192,
                                     dtype="bfloat16"), backend=backend)
    try:
        assert "prompt kernels ready" in caplog.text
        before = _compiled_variants(kernels)
        assert all(n > 0 for n in before), before
        prompts = [[(11 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((20, 150, 333, 700, 1000))]
        run_greedy(eng, prompts, 3)
        assert _compiled_variants(kernels) == before
    finally:
        eng.close()

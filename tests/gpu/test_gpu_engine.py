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
from freetoken.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40, 2, 17, 31, 12))]


def _engine(backend, **kw):
    return LLMEngine(EngineConfig(max_model_len=256, kv_cache_tokens=4096, **kw), backend=backend)


def _run(eng, prompts, max_tokens=8):
    rows: dict[str, list[torch.Tensor]] = {}

    def observe(ids, logits):
        for i, rid in enumerate(ids):
            rows.setdefault(rid, []).append(logits[i].float().cpu().clone())

    remove = eng.add_logits_observer(observe)
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]
        while eng.has_work():
            eng.step()
    finally:
        remove()
    return [(r.output_ids, torch.stack(rows[r.request_id])) for r in reqs]


@pytest.fixture(scope="module")
def reference():
    from freetoken_cpu_moe.backend import CpuBackend

    eng = _engine(CpuBackend(), dtype="float32")
    out = _run(eng, PROMPTS)
    eng.close()
    return out


def _check(got, ref, tol):
    for (ids, logits), (ref_ids, ref_logits) in zip(got, ref):
        scale = ref_logits.abs().max()
        n = min(len(ids), len(ref_ids))
        # compare the positions up to the first divergence (after it the contexts differ)
        same = next((i for i in range(n) if ids[i] != ref_ids[i]), n)
        err = float((logits[:same + 1] - ref_logits[:same + 1]).abs().max() / scale)
        assert err <= tol, f"logits differ by {err:.3g} of their scale"
        if same < n:
            top2 = ref_logits[same].topk(2).values
            margin = float((top2[0] - top2[1]) / scale)
            assert margin <= 2 * tol, f"greedy token {same} differs where the reference margin {margin:.3g} is clear"


@pytest.mark.parametrize("placement", ["all", "0-1", "0"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_cuda_engine_matches_cpu(backend, reference, placement, eager, dtype, tol):
    eng = _engine(backend, dtype=dtype, moe_cpu_layers=placement, enforce_eager=eager, cuda_graph_max_bs=8)
    try:
        info = eng.backend_info()
        assert info["graphs"] is (not eager), info
        got = _run(eng, PROMPTS)
        info = eng.backend_info()
        if placement != "0":
            assert info["io_path"] in ("kernel_io", "copy"), info
    finally:
        eng.close()
    _check(got, reference, tol)


def test_concurrent_equals_alone(backend):
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="0-1", cuda_graph_max_bs=8)
    try:
        together = _run(eng, PROMPTS)
        alone = [_run(eng, [p])[0] for p in PROMPTS]
    finally:
        eng.close()
    for (a, la), (b, lb) in zip(together, alone):
        assert a == b
        assert float((la - lb).abs().max() / lb.abs().max()) < 5e-2


def test_memory_limit_refuses_with_sizes(backend):
    from freetoken.backends.contract import MemoryPlanError

    with pytest.raises(MemoryPlanError, match="--moe-cpu-layers|--gpu-memory-limit"):
        _engine(backend, dtype="bfloat16", moe_cpu_layers="0", gpu_memory_limit=1 << 20)


@pytest.mark.parametrize("fault,graphs_expected", [("kernel_io@graph:stale", False)])
def test_qualification_fault_turns_graphs_off(backend, monkeypatch, fault, graphs_expected):
    monkeypatch.setenv("FREETOKEN_FAULT_INJECT", fault)
    from freetoken.moe import qualify

    qualify.LAST_RESULTS.clear()
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all")
    try:
        info = eng.backend_info()
        assert info["graphs"] is graphs_expected, info
        assert info["warnings"], info
    finally:
        eng.close()


def test_qualification_eager_error_refuses_start(backend, monkeypatch):
    from freetoken.moe.qualify import QualificationError

    monkeypatch.setenv("FREETOKEN_FAULT_INJECT", "kernel_io:error,copy:error")
    with pytest.raises(QualificationError):
        _engine(backend, dtype="bfloat16", moe_cpu_layers="all")

"""Model families on the GPU engine, and the decode attention variants they need.

* Decode attention with a sliding window and attention sinks (GPT-OSS): both
  implementations of :func:`freetoken.models.decode_attention.paged_decode_attention`
  against a float64 reference (on a CPU machine the Triton kernels run in Triton's
  interpreter, see conftest.py).
* Mixtral, OLMoE, GPT-OSS, GLM-4.5 and DeepSeek-V3/V2 tiny random models: greedy tokens and
  logits of the GPU engine (eager and with decode graphs) against the CPU engine (marked ``gpu``).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from freetoken.models import decode_attention as da
from test_decode_attention import IMPLS, TOL, Case

BASE_SEED = random.SystemRandom().randrange(1 << 30)


def reference_window_sinks(c: Case, window, sinks) -> torch.Tensor:
    """float64 ``[B, Hq*D]``: per sequence and query head, softmax over the last
    ``window`` keys of its context plus the head's sink logit (whose value row is zero)."""
    B, hq, d = c.q.shape
    g = hq // c.hkv
    out = torch.zeros(B, hq, d, dtype=torch.float64)
    tables, ctx = c.tables.cpu().tolist(), c.ctx.cpu().tolist()
    for b in range(B):
        n = min(ctx[b], len(tables[b]) * c.bs)
        if n <= 0:
            continue
        lo = 0 if window is None else max(0, n - window)
        idx = list(range(lo, n))
        blocks = torch.tensor([tables[b][i // c.bs] for i in idx], device=c.k_cache.device)
        rows = torch.tensor(idx, device=c.k_cache.device) % c.bs
        k = c.k_cache[blocks, rows].double().cpu().repeat_interleave(g, dim=1)
        v = c.v_cache[blocks, rows].double().cpu().repeat_interleave(g, dim=1)
        s = torch.einsum("nhd,hd->hn", k, c.q[b].double().cpu()) * c.scale
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu().view(hq, 1)], dim=1)
        p = torch.softmax(s, dim=1)[:, : len(idx)]
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.view(B, hq * d)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window,with_sinks", [(5, False), (None, True), (40, True), (1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_and_sinks(impl, window, with_sinks, dtype):
    seed = BASE_SEED + 7 * (window or 0) + with_sinks
    c = Case([1, 7, 16, 45, 0, 130], hq=8, hkv=2, d=32, bs=16, max_blocks=10, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    sinks = (2 * torch.randn(8, generator=gen)).to(c.q.device) if with_sinks else None
    out = torch.full((6, 8 * 32), float("nan"), dtype=dtype, device=c.q.device)
    got = da.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.tables, c.ctx, c.scale, out=out, impl=impl,
                                    window=window, sinks=sinks)  # fmt: skip
    ref = reference_window_sinks(c, window, sinks)
    torch.testing.assert_close(got.double().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype],
                               msg=lambda m: f"seed {seed}: {m}")  # fmt: skip


# --------------------------------------------------------------------------------------
# the families on the GPU engine against the CPU engine
# --------------------------------------------------------------------------------------

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models_moe_families"))

FAMILY_CASES = {"mixtral": dict(sliding_window=6), "olmoe": dict(), "gpt_oss": dict(), "glm4_moe": dict(),
                "deepseek_v3": dict(), "deepseek_v2": dict(q_lora_rank=24, topk_method="group_limited_greedy",
                                                          n_group=4, topk_group=2, n_routed_experts=16)}  # fmt: skip
PROMPTS = [[(7 * i + 3 * j) % 150 + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40, 2, 17))]


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def family_checkpoint(request, tmp_path_factory):
    from families import make_model, save

    path = str(tmp_path_factory.mktemp(f"family-{request.param}"))
    save(make_model(request.param, 1234, **FAMILY_CASES[request.param]), path)
    return request.param, path


def _family_run(backend, path, **kw):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=path, max_model_len=256, kv_cache_tokens=4096, **kw), backend=backend)
    rows: dict[str, list[torch.Tensor]] = {}
    remove = eng.add_logits_observer(
        lambda ids, logits: [rows.setdefault(r, []).append(logits[i].float().cpu().clone()) for i, r in enumerate(ids)])
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        while eng.has_work():
            eng.step()
    finally:
        remove()
        eng.close()
    return [(r.output_ids, torch.stack(rows[r.request_id])) for r in reqs]


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["all", "0", None], ids=["cpu-experts", "layer0-cpu", "gpu-experts"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_family_gpu_engine_matches_cpu(backend, family_checkpoint, placement, eager):
    from freetoken_cpu_moe.backend import CpuBackend

    family, path = family_checkpoint
    ref = _family_run(CpuBackend(), path, dtype="float32")
    kw = dict(dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8)
    if placement is not None:
        kw["moe_cpu_layers"] = placement
    got = _family_run(backend, path, **kw)
    for (ids, logits), (ref_ids, ref_logits) in zip(got, ref):
        scale = ref_logits.abs().max()
        n = min(len(ids), len(ref_ids))
        same = next((i for i in range(n) if ids[i] != ref_ids[i]), n)
        err = float((logits[: same + 1] - ref_logits[: same + 1]).abs().max() / scale)
        assert err <= 1e-3, f"{family}: logits differ by {err:.3g} of their scale"
        assert same == n, f"{family}: greedy tokens differ at {same}: {ids} vs {ref_ids}"


# --------------------------------------------------------------------------------------
# the Gated DeltaNet hybrids (qwen3_5_moe, qwen3_next): recurrent state on the device
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def hybrid_checkpoint(request, tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
    from qwen35_helpers import make_hf

    path = str(tmp_path_factory.mktemp(f"hybrid-{request.param}"))
    make_hf(request.param, path, 4321)
    return request.param, path


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["all", None], ids=["cpu-experts", "gpu-experts"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_hybrid_gpu_engine_matches_cpu(backend, hybrid_checkpoint, placement, eager):
    """Greedy tokens and logits of the hybrids on the GPU engine (DeltaNet state in device
    slots, decode graphs reading the staged slot buffer; padding rows on the scratch slot)
    against the CPU engine. Six prompts with max_running_requests 4 also move slots between
    requests as they finish."""
    from freetoken_cpu_moe.backend import CpuBackend

    family, path = hybrid_checkpoint
    ref = _family_run(CpuBackend(), path, dtype="float32", max_running_requests=4)
    kw = dict(dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8, max_running_requests=4)
    if placement is not None:
        kw["moe_cpu_layers"] = placement
    got = _family_run(backend, path, **kw)
    for (ids, logits), (ref_ids, ref_logits) in zip(got, ref):
        scale = ref_logits.abs().max()
        n = min(len(ids), len(ref_ids))
        same = next((i for i in range(n) if ids[i] != ref_ids[i]), n)
        err = float((logits[: same + 1] - ref_logits[: same + 1]).abs().max() / scale)
        assert err <= 2e-3, f"{family}: logits differ by {err:.3g} of their scale"
        assert same == n, f"{family}: greedy tokens differ at {same}: {ids} vs {ref_ids}"

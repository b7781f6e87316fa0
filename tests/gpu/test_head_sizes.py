"""Attention head sizes that are not a power of two on the GPU engine.

A checkpoint whose attention head size is 24 (a Qwen3.5-MoE-shaped test model) failed on the
cuda backend with Triton's ``CompilationError`` ('arange's range must be a power of 2', in
``_qk_norm_rope_kernel``), on every placement, eager and with graphs. The head-tiling kernels
now pad their tiles to the next power of two and mask the lanes past the head
(:func:`freetoken.kernels.availability.head_dim_support` says which sizes they take).

Tiny random transformers checkpoints (FP32) of two shapes, at head sizes 24, 80, 96 and 192:

* Qwen3-MoE: per-head q/k RMSNorm and full NeoX RoPE (the fused q/k norm + RoPE kernel);
* Qwen3.5-MoE: gated full attention with partial RoPE (a quarter of each head, through the
  permuted full-width tables) between Gated DeltaNet layers, whose own key/value head sizes
  follow the attention's at 24.

Each runs greedily on the GPU engine (placements all experts on the CPU / all on the GPU,
eager and with decode graphs) against the CPU engine (the independent reference), and the
test checks that the Triton kernels themselves ran: the fused q/k norm + RoPE launched, and
with graphs the decode attention in the graphs is Triton's. FP32 activations: logits within
2e-3 of the CPU engine's scale (summation-order noise), greedy tokens equal up to a clear
margin (``greedy_runs.check_logits``). Marked ``gpu``: skipped without one.

Without a GPU, the same checkpoints go through the real engine start on the fake GPU backend
(tests/qualify/fake_backend.py: CPU tensors, decode graphs recorded and replayed) with the
Triton ops and the Triton decode attention in graphs forced on, run by Triton's interpreter
(conftest.py): the model-level wiring (the partial-rotary row order, the kernels' padded
tiles, the cache layout) against the CPU engine, in CI.

Run on the GPU machine: ``python -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_head_sizes.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from greedy_runs import check_logits, run_greedy
from test_decode_attention import TRITON_RUNS  # noqa: F401 (also: the interpreter's scalar-index fix)

HEAD_DIMS = [24, 80, 96, 192]
FAMILIES = ["qwen3_moe", "qwen3_5_moe"]
VOCAB = 160
PROMPTS = [[(7 * i + 3 * j) % 150 + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40, 2, 17))]
TOL = 2e-3
#: the interpreted run's share of PROMPTS and tokens (Triton's interpreter: seconds per step)
SMALL = dict(prompts=3, max_tokens=4)


def _randomize(model: Any, seed: int) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models_moe_families"))
    from families import randomize

    randomize(model, seed)


def make_qwen3_moe(path: str, head_dim: int, seed: int) -> None:
    """A Qwen3-MoE-shaped FP32 checkpoint: 2 layers, 4 query heads over 2 kv heads of ``head_dim``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, intermediate_size=64, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)


def mrope_sections(rotary_dim: int) -> list[int]:
    """Three multimodal RoPE sections over the ``rotary_dim / 2`` rotated pairs (text tokens
    have one position for all three: the split does not change the result)."""
    pairs = rotary_dim // 2
    a = pairs // 3
    return [pairs - 2 * a, a, a]


def make_qwen3_5_moe(path: str, head_dim: int, seed: int) -> None:
    """A Qwen3.5-MoE-shaped FP32 checkpoint (tests/engine/qwen35_helpers.py's shape: 3
    linear-attention layers + 1 full attention, shared experts) with attention heads of
    ``head_dim``, a quarter rotated; at 24 the DeltaNet key/value heads are 24 wide too."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
    from qwen35_helpers import COMMON
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    kw = dict(COMMON, head_dim=head_dim)
    if head_dim == 24:
        kw.update(linear_key_head_dim=24, linear_value_head_dim=24)
    rotary = int(head_dim * 0.25)
    cfg = Qwen3_5MoeTextConfig(**kw, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": mrope_sections(rotary), "mrope_interleaved": True})  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates of a trained model, as qwen35_helpers sets them
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.7))
    model.save_pretrained(path)


MAKERS = {"qwen3_moe": make_qwen3_moe, "qwen3_5_moe": make_qwen3_5_moe}


def _engine(backend: Any, path: str, **kw: Any) -> Any:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=path, max_model_len=256, kv_cache_tokens=4096, max_running_requests=4, **kw),
                     backend=backend)  # fmt: skip


@pytest.fixture(scope="module", params=[(f, d) for f in FAMILIES for d in HEAD_DIMS],
                ids=[f"{f}-d{d}" for f in FAMILIES for d in HEAD_DIMS])  # fmt: skip
def checkpoint(request, tmp_path_factory):
    """(family, head size, path, the CPU engine's greedy runs: of PROMPTS, and of the
    :data:`SMALL` share of them)."""
    from freetoken_cpu_moe.backend import CpuBackend

    family, head_dim = request.param
    path = str(tmp_path_factory.mktemp(f"{family}-d{head_dim}"))
    MAKERS[family](path, head_dim, 1000 + head_dim)
    eng = _engine(CpuBackend(), path, dtype="float32")
    try:
        ref = run_greedy(eng, PROMPTS)
        small = run_greedy(eng, PROMPTS[: SMALL["prompts"]], max_tokens=SMALL["max_tokens"])
    finally:
        eng.close()
    return family, head_dim, path, ref, small


def _count_launches(monkeypatch: Any) -> dict[str, int]:
    """Calls of the fused q/k norm + RoPE and of the Triton decode attention, counted."""
    from freetoken.kernels import decode_attention as attention_kernels
    from freetoken.kernels import dense_ops as dense_kernels

    launches = {"qk_norm_rope": 0, "decode_attention": 0}
    for name, module, attr in (("qk_norm_rope", dense_kernels, "qk_norm_rope"),
                               ("decode_attention", attention_kernels, "launch")):  # fmt: skip
        real = getattr(module, attr)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            launches[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["all", None], ids=["cpu-experts", "gpu-experts"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_head_size_gpu_engine_matches_cpu(backend, checkpoint, placement, eager, monkeypatch):
    from freetoken.models.dense_ops import TritonDenseOps

    family, head_dim, path, ref, _ = checkpoint
    launches = _count_launches(monkeypatch)
    kw: dict[str, Any] = dict(dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8)
    if placement is not None:
        kw["moe_cpu_layers"] = placement
    eng = _engine(backend, path, **kw)
    try:
        info = eng.backend_info()
        assert info["graphs"] is (not eager), info
        ops = eng.model.ops
        assert isinstance(ops, TritonDenseOps) and ops.fused_qk_norm_rope, f"dense ops {ops.name} at D={head_dim}"
        got = run_greedy(eng, PROMPTS)
        info = eng.backend_info()
    finally:
        eng.close()
    where = f"{family} head_dim={head_dim} placement={placement} eager={eager}"
    assert launches["qk_norm_rope"] > 0, f"{where}: the fused q/k norm + RoPE kernel never ran"
    if not eager:
        assert info["attention"] == "triton", f"{where}: {info['attention']}"
        assert launches["decode_attention"] > 0, f"{where}: the Triton decode attention never ran"
    check_logits(got, ref, TOL)


def _fake_gpu_backend() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "qualify" / "fake_backend.py"
    spec = importlib.util.spec_from_file_location("ft_head_sizes_fake_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeGpuBackend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, test_head_size_gpu_engine_matches_cpu runs the "
                    "compiled kernels; Triton's interpreter (CPU tensors) is for machines without one")  # fmt: skip
def test_head_size_interpreted_kernels_in_the_engine_match_cpu(checkpoint, monkeypatch):
    """The engine start of a GPU backend (the fake one: experts on the CPU, decode graphs
    recorded and replayed on CPU tensors) with the Triton dense ops and the Triton decode
    attention in the graphs, in Triton's interpreter, against the CPU engine."""
    import triton

    from freetoken.models import dense_ops
    from freetoken.moe.session import gpu_session

    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton's interpreter is off (conftest.py turns it on without a GPU)")
    family, head_dim, path, _, ref = checkpoint
    ops = dense_ops.TritonDenseOps()
    monkeypatch.setattr(dense_ops, "_triton_ops_for", lambda device: (ops, "Triton's interpreter (forced)"))
    monkeypatch.setattr(gpu_session, "_attention_impl", lambda device, head_dim=None, v_head_dim=None: "triton")
    # the cpu backend installs its native ops for the host's device type once it ran in this
    # process (the reference did): the fake GPU's model must not take them
    monkeypatch.delitem(dense_ops._INSTALLED, "cpu", raising=False)
    launches = _count_launches(monkeypatch)
    eng = _engine(_fake_gpu_backend(), path, dtype="float32", moe_cpu_layers="all", cuda_graph_max_bs=8)
    try:
        assert eng.model.ops is ops, f"dense ops {eng.model.ops.name} at D={head_dim}"
        info = eng.backend_info()
        assert info["graphs"] is True and info["attention"] == "triton", info
        got = run_greedy(eng, PROMPTS[: SMALL["prompts"]], max_tokens=SMALL["max_tokens"])
    finally:
        eng.close()
    assert launches["qk_norm_rope"] > 0 and launches["decode_attention"] > 0, launches
    check_logits(got, ref, TOL)


# --------------------------------------------------------------------------------------
# MLA's latent queries (DeepSeek-V3/Kimi-K2 family): the decode graphs' attention with the
# up-projections absorbed is the Triton decode attention over one cached latent per token
# --------------------------------------------------------------------------------------

#: tiny DeepSeek-V3 checkpoints (tests/models_moe_families/families.py, every feature on) of
#: two latent widths: the tiny family tests' 16 + 8 (one tile, values loaded apart) and the
#: real models' 512 + 64 (two q/k tiles, the values read from the keys' tile), 32 heads
LATENTS = {"latent-24": dict(kv_lora_rank=16, qk_rope_head_dim=8),
           "latent-576": dict(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=32)}


@pytest.fixture(scope="module", params=sorted(LATENTS))
def latent_checkpoint(request, tmp_path_factory):
    """(name, path, the CPU engine's greedy runs of the :data:`SMALL` share of PROMPTS)."""
    from freetoken_cpu_moe.backend import CpuBackend

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models_moe_families"))
    from families import make_model, save

    path = str(tmp_path_factory.mktemp(request.param))
    save(make_model("deepseek_v3", 4242, **LATENTS[request.param]), path)
    eng = _engine(CpuBackend(), path, dtype="float32")
    try:
        ref = run_greedy(eng, PROMPTS[: SMALL["prompts"]], max_tokens=SMALL["max_tokens"])
    finally:
        eng.close()
    return request.param, path, ref


def _latent_launches(monkeypatch: Any) -> list[tuple[int, ...]]:
    """The Triton decode attention's launches, each as its q's shape."""
    from freetoken.kernels import decode_attention as attention_kernels

    shapes: list[tuple[int, ...]] = []
    real = attention_kernels.launch

    def counted(q: Any, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_kernels, "launch", counted)
    return shapes


@pytest.mark.gpu
def test_latent_attention_in_gpu_decode_graphs_matches_cpu(backend, latent_checkpoint, monkeypatch):
    name, path, ref = latent_checkpoint
    shapes = _latent_launches(monkeypatch)
    eng = _engine(backend, path, dtype="float32", moe_cpu_layers="all", cuda_graph_max_bs=8)
    try:
        info = eng.backend_info()
        assert info["graphs"] is True and info["attention"] == "triton", info
        got = run_greedy(eng, PROMPTS[: SMALL["prompts"]], max_tokens=SMALL["max_tokens"])
    finally:
        eng.close()
    kv_lora, rope = LATENTS[name]["kv_lora_rank"], LATENTS[name]["qk_rope_head_dim"]
    assert shapes and all(s[2] == kv_lora + rope for s in shapes), f"{name}: latent launches {shapes[:4]}"
    check_logits(got, ref, TOL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, test_latent_attention_in_gpu_decode_graphs_"
                    "matches_cpu runs the compiled kernel; Triton's interpreter (CPU tensors) is for machines without one")  # fmt: skip
def test_latent_attention_interpreted_in_decode_graphs_matches_cpu(latent_checkpoint, monkeypatch):
    """The fake GPU backend's decode graphs (recorded and replayed on CPU tensors) with the
    Triton decode attention forced on, in Triton's interpreter: the latent queries, the
    cache's latents as keys and (cut) values, against the CPU engine."""
    import triton

    from freetoken.moe.session import gpu_session

    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton's interpreter is off (conftest.py turns it on without a GPU)")
    name, path, ref = latent_checkpoint
    monkeypatch.setattr(gpu_session, "_attention_impl", lambda device, head_dim=None, v_head_dim=None: "triton")
    shapes = _latent_launches(monkeypatch)
    eng = _engine(_fake_gpu_backend(), path, dtype="float32", moe_cpu_layers="all", cuda_graph_max_bs=8)
    try:
        info = eng.backend_info()
        assert info["graphs"] is True and info["attention"] == "triton", info
        got = run_greedy(eng, PROMPTS[: SMALL["prompts"]], max_tokens=SMALL["max_tokens"])
    finally:
        eng.close()
    kv_lora, rope = LATENTS[name]["kv_lora_rank"], LATENTS[name]["qk_rope_head_dim"]
    assert shapes and all(s[2] == kv_lora + rope for s in shapes), f"{name}: latent launches {shapes[:4]}"
    check_logits(got, ref, TOL)

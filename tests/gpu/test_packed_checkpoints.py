"""Checkpoints through the engine with their experts packed on the (simulated) GPU: the
fakegpu plugin's engine, the experts' kernels run by Triton's interpreter, against
transformers' models on the same values: an FP8 block-scaled HF checkpoint (resident layers,
and a fetching expert cache), GPT-OSS with MXFP4 experts as llama.cpp's GGUF and as the
official HF blocks. The plan's packed layers and bytes are checked too. On a GPU machine
the compiled kernels are checked by test_packed_experts.py; these run where Triton's
interpreter is on (CPU CI)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from greedy_runs import run_greedy  # noqa: E402
from test_packed_experts import INTERPRET, WIDE, WIDE_BF16  # noqa: E402

from freetoken.kernels import moe_experts  # noqa: E402

from freetoken.kernels import moe_packed  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter's run of the fakegpu engine")


# --------------------------------------------------------------------------------------
# checkpoints through the engine: their experts packed on the (simulated) GPU
# --------------------------------------------------------------------------------------


def _test_dirs(*subs: str) -> None:
    """Other test folders' helpers importable (tests/<sub>)."""
    for sub in subs:
        here = os.path.join(os.path.dirname(__file__), "..", sub)
        if here not in sys.path:
            sys.path.insert(0, here)


@contextlib.contextmanager
def _fakegpu_engine(path: str, monkeypatch, **kw: Any):
    """An FP32 engine on the fakegpu plugin, by default with every expert on its "GPU", the
    experts' kernels Triton's (interpreted, one program per route); closed and the backend
    registry reset after (the later tests of this process choose their own backend)."""
    from freetoken.backends import registry
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.kernels import availability

    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(moe_packed, "DEFAULT_CONFIG", WIDE)
    monkeypatch.setattr(moe_experts, "DEFAULT_CONFIG", WIDE_BF16)  # startup qualification's BF16 experts
    registry.reset()
    eng = LLMEngine(EngineConfig(model=path, backend="fakegpu", dtype="float32", **{
        "moe_cpu_layers": "0", "max_model_len": 64, "kv_cache_tokens": 256, **kw}))
    try:
        yield eng
    finally:
        eng.close()
        registry.reset()


def test_fakegpu_engine_packs_fp8_checkpoint(tmp_path, monkeypatch):
    """The plan keeps an FP8 block-scaled HF checkpoint's experts packed on the device (its
    formats read from the checkpoint, the device rows' bytes planned) and the engine's
    logits equal HF's FP32 model on the decoded values, through the interpreted kernels."""
    _test_dirs("engine")
    from helpers import hf_logits
    from test_engine_hf_formats import TOL, write_fp8_checkpoint

    path, model = write_fp8_checkpoint(tmp_path, seed=5)
    with _fakegpu_engine(path, monkeypatch) as eng:
        plan = eng.backend_info()["memory_plan"]
        cfg = model.config
        layer_bytes = 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size // 128 * 132
        assert plan["packed_layers"] == cfg.num_hidden_layers, plan
        assert plan["expert_bytes"] == cfg.num_hidden_layers * layer_bytes, plan
        ids = [(11 * j) % 150 + 3 for j in range(13)]
        torch.testing.assert_close(eng.prompt_logits(ids), hf_logits(model, ids), **TOL)


def test_fakegpu_engine_caches_fp8_experts_as_rows(tmp_path, monkeypatch):
    """Every layer a CPU layer with an expert cache that fetches during decode: the FP8
    experts' slots hold the packed kernels' rows (3.1% over the codes, not BF16), built at
    each fetch; the greedy logits of every step equal HF's FP32 model on the decoded values
    (cached routes through the interpreted kernels, the others through the CPU's)."""
    _test_dirs("engine")
    from helpers import hf_logits
    from test_engine_hf_formats import TOL, write_fp8_checkpoint

    from freetoken.moe.experts import expert_cache

    # a restless fetch policy (heat halving each step, no hysteresis): six decode steps fetch
    for name, value in (("HEAT_HALF_LIFE", 1), ("FETCH_Z", 0.0), ("FETCH_MARGIN", 0.0)):
        monkeypatch.setattr(expert_cache, name, value)
    path, model = write_fp8_checkpoint(tmp_path, seed=9)
    cfg = model.config
    rows_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size // 128 * 132
    prompts = [[(5 * i + 3 * j) % 150 + 3 for j in range(n)] for i, n in enumerate((9, 4, 15))]
    with _fakegpu_engine(path, monkeypatch, moe_cpu_layers="all", moe_cache_size=float(6 * rows_bytes),
                         moe_hybrid_max_fetch=2, moe_stream_prefill="off") as eng:
        got = run_greedy(eng, prompts, max_tokens=6)
        cache = eng.session.report()["expert_cache"]
    assert [p["formats"][0] for p in cache["pools"]] == ["fp8"] and cache["slots"] == 6, cache
    assert cache["pools"][0]["bytes_per_expert"] == rows_bytes and cache["fetched_experts"] > 0, cache
    for prompt, (out, logits) in zip(prompts, got):
        want = hf_logits(model, prompt + out)[len(prompt) - 1: len(prompt) + len(out) - 1]
        torch.testing.assert_close(logits, want, **TOL)


def _gpt_oss_mxfp4_gguf(tmp_path) -> tuple[str, Any]:
    """A GPT-OSS GGUF file with MXFP4 experts, and transformers' model holding gguf-py's
    dequantization of the same blocks."""
    import gguf
    from families import make_model
    from gguf.quants import quantize
    from test_gguf import YARN, _as_written, write_gguf

    model = make_model("gpt_oss", 17, rope_parameters=YARN)
    path = str(tmp_path / "mxfp4.gguf")
    write_gguf(model, "gpt_oss", path, mxfp4=True)
    _as_written(model)
    mx = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for L in model.model.layers:
            ex = L.mlp.experts
            for p in (ex.gate_up_proj, ex.down_proj):  # rows along the last dim in the file
                a = np.ascontiguousarray(p.transpose(1, 2).numpy())
                p.copy_(torch.from_numpy(gguf_dequantize(quantize(a, mx), mx).reshape(a.shape)).transpose(1, 2))
    return path, model


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_fakegpu_engine_packs_gpt_oss_mxfp4(form, tmp_path, monkeypatch):
    """GPT-OSS with MXFP4 experts, as llama.cpp's GGUF and as the official HF checkpoint
    (``*_blocks``/``*_scales``), their gate/up biases folded in as one more block per row:
    the plan keeps every layer's experts packed on the device at the size they are held,
    and the logits equal transformers' on gguf-py's dequantization of the same blocks
    (float32 activations: the GPU kernels do not round them as the CPU's do)."""
    _test_dirs("engine", "models_moe_families")
    from families import hf_logits
    from test_hf_mxfp4 import write_mxfp4_checkpoint

    if form == "gguf":
        path, model = _gpt_oss_mxfp4_gguf(tmp_path)
    else:
        path, model = str(tmp_path), write_mxfp4_checkpoint(str(tmp_path), 23)
    with _fakegpu_engine(path, monkeypatch) as eng:
        plan = eng.backend_info()["memory_plan"]
        cfg = model.config
        # gate, up [E, I, H + 32] and down [E, H + 32, I] in 17-byte blocks of 32
        layer_bytes = 3 * cfg.num_local_experts * cfg.intermediate_size * (cfg.hidden_size + 32) // 32 * 17
        assert plan["packed_layers"] == cfg.num_hidden_layers, plan
        assert plan["expert_bytes"] == cfg.num_hidden_layers * layer_bytes, plan
        ids = [(13 * j) % 150 + 3 for j in range(12)]  # past the sliding window (8)
        torch.testing.assert_close(eng.prompt_logits(ids), hf_logits(model, ids), atol=2e-4, rtol=1e-4)

"""The engine end to end through the fakegpu plugin's implementation of the engine seam.

fakegpu's session is the generic GPU session: dense weights dequantized by torch onto its
(host) device, routed experts handed to the CPU workers over its simulated stream (copy
path + stream-ordered flags), or resident on the "device" for layers not listed in
``moe_cpu_layers``. The cpu backend (packed CPU kernels, synchronous experts) is the
reference: same FP32 checkpoint, so logits agree to float32 summation-order noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [5, 6], [77] * 12]


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def _run(backend_name: str, **kw):
    registry.reset()
    eng = LLMEngine(EngineConfig(backend=backend_name, dtype="float32", max_model_len=128, kv_cache_tokens=1024, **kw))
    rows: dict[str, list[torch.Tensor]] = {}
    remove = eng.add_logits_observer(
        lambda ids, logits: [rows.setdefault(r, []).append(logits[i].clone()) for i, r in enumerate(ids)])
    reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    while eng.has_work():
        eng.step()
    remove()
    info = eng.backend_info()
    eng.close()
    return [r.output_ids for r in reqs], [torch.stack(rows[r.request_id]) for r in reqs], info


@pytest.mark.parametrize("placement", [None, "0-1", "all"])
def test_fakegpu_engine_equals_cpu_backend(fresh_registry, placement):
    want_ids, want_logits, cpu_info = _run("cpu")
    got_ids, got_logits, info = _run("fakegpu", moe_cpu_layers=placement)
    assert cpu_info["backend"] == "cpu" and info["backend"] == "fakegpu"
    assert info["io_path"] == "copy" and info["graphs"] is False  # fakegpu: no KernelIO, no graphs
    if placement == "0-1":
        assert info["moe_cpu_layers"] == "0-1" and info["moe_gpu_layers"] >= 1
    else:  # no device memory to plan with: every layer's experts stay with the CPU workers
        assert info["moe_gpu_layers"] == 0
    # the fake GPU's device work runs on the stepping thread: it is not pinned to one core
    assert info["host_threads"]["setting"] == "on" and "no GPU device" in info["host_threads"]["because"], info
    assert info["cpu_spin_ms"] is None  # the CPU experts' default spin off a GPU
    assert got_ids == want_ids
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_generate_cli_backend_fakegpu(tmp_path):
    env = dict(os.environ, FREETOKEN_CACHE=os.environ.get("FREETOKEN_CACHE", str(tmp_path)))
    outs = {}
    for name in ("cpu", "fakegpu"):
        r = subprocess.run(
            [sys.executable, "-m", "freetoken.cli.main", "generate", "--backend", name, "--prompt-ids", "5,9,13,200",
             "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--json", "--dtype", "float32"],
            capture_output=True, text=True, env=env, timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert outs["fakegpu"] == outs["cpu"] and len(outs["cpu"]) == 5


def test_cpu_side_failure_surfaces_on_the_next_step(fresh_registry):
    """A hand-off the CPU workers fail (exception in the task) is raised by the engine's
    next step, naming the layer, instead of decoding on with a wrong layer output."""
    from freetoken.backends.handoff_io import HandoffError

    eng = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 moe_cpu_layers="all"))
    try:
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        eng.step()
        eng.step()  # healthy steps
        eng.session.coordinator._core._inject_fault()
        with pytest.raises(HandoffError, match="failed for layer .*CPU_EXCEPTION"):
            for _ in range(3):
                eng.step()
    finally:
        eng.close()


def test_bench_decode_stages_through_the_gpu_session(fresh_registry, capsys):
    """`bench decode --stages` on the fake GPU: the coordinator's trace of a batch-1 run
    splits into the CPU task per layer, the GPU side between layers and the prefill chunk."""
    from freetoken.cli.main import main

    rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "fakegpu", "--moe-cpu-layers", "all",
               "--batch", "1", "--prompt-len", "12", "--gen-len", "5", "--repeats", "1", "--bandwidth-bytes", "4MiB",
               "--stages", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    st = out["stages_b1_us"]
    layers = out["backend_report"]["memory_plan"]["cpu_layers"]
    assert st["cpu_layers"] == 4 and layers == "0-3"
    assert st["steps"] >= 3 and st["prefill_tokens"] == 12
    for key in ("layer_serve", "layer_gpu_gap", "layer_step_gap", "prefill_serve", "prefill_gpu_gap"):
        assert st[key] > 0, key
    # a step holds every layer's CPU task and the gaps between them (medians of different
    # samples: within a factor of two on a loaded machine, where one layer's share is 1/4)
    held = st["cpu_layers"] * st["layer_serve"] + (st["cpu_layers"] - 1) * st["layer_gpu_gap"] * 0.5
    assert st["step_us"] >= 0.5 * held, (st["step_us"], held)

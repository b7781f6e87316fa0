"""``freetoken doctor --model PATH``: the model loaded on the selected backend as ``serve``
would, its startup decision, memory plan and weights policy; a model that cannot start
exits 1 with the error and no traceback. Run as the installed command, on the demo
model (random weights) through the fakegpu backend."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.cli.doctor import MODEL_KEY, REPORT_KEYS
from freetoken.moe.handoff import faults

pytestmark = pytest.mark.timeout(300)

FREETOKEN = shutil.which("freetoken", path=str(Path(sys.executable).parent)) or "freetoken"


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("FREETOKEN_BACKEND", faults.ENV_VAR)}
    environment.update(env)
    return subprocess.run([FREETOKEN, "doctor", *args], capture_output=True, text=True, env=environment, timeout=240)


@pytest.fixture(scope="module")
def demo_model() -> str:
    from freetoken.models.demo import ensure_demo_model

    return ensure_demo_model().hf_dir


def test_model_on_fakegpu_prints_the_decision_and_plan(demo_model: str) -> None:
    r = _doctor("--backend", "fakegpu", "--model", demo_model, "--moe-cpu-layers", "1-3", "--dtype", "float32")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert f"Model {demo_model} (" in out and "on backend fakegpu" in out
    assert "startup decision: IO path copy, sync mode stream_memops, decode graphs off" in out
    assert "why: backend fakegpu cannot capture graphs: eager only" in out
    assert "activations: float32" in out
    assert "MoE experts: CPU layers 1-3, 1 layers on the GPU" in out
    assert "memory plan: budget -, dense " in out and "(1 layers on the GPU, CPU layers 1-3)" in out
    assert "step reserve" in out and "prompt chunks of 256 tokens" in out  # no budget: the chunk as asked
    assert "KV cache: " in out and "weights: dense: " in out
    assert "locked fetch: auto: off on " in out  # the default, measured on NVIDIA GPUs only
    assert "warning:" not in out and "Traceback" not in out + r.stderr


def test_model_json_has_the_report_under_model(demo_model: str) -> None:
    r = _doctor("--backend", "fakegpu", "--model", demo_model, "--enforce-eager", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert tuple(report) == REPORT_KEYS + (MODEL_KEY,)
    model = report[MODEL_KEY]
    assert model["ok"] is True and model["error"] is None and model["path"] == demo_model
    assert model["max_model_len"] > 0 and model["kv_cache_tokens"] > 0 and model["kv_cache_bytes"] > 0
    info = model["backend_info"]
    assert (info["backend"], info["io_path"], info["sync_mode"], info["graphs"]) == (
        "fakegpu", "copy", "stream_memops", False)
    assert "decode graphs off (--enforce-eager)" in info["reason"]
    assert info["warnings"] == []
    assert info["memory_plan"]["cpu_layers"] == "0-3" and info["memory_plan"]["gpu_layers"] == 0
    assert set(info["weights"]) >= {"dense"}


def test_impossible_memory_limit_exits_1_naming_the_flag(demo_model: str) -> None:
    r = _doctor("--backend", "fakegpu", "--model", demo_model, "--gpu-memory-limit", "1MB")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"Model {demo_model}: FAILED to start" in r.stdout
    assert "the model's GPU part does not fit" in r.stdout and "--gpu-memory-limit" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    r = _doctor("--backend", "fakegpu", "--model", demo_model, "--gpu-memory-limit", "1MB", "--json")
    assert r.returncode == 1
    model = json.loads(r.stdout)[MODEL_KEY]
    assert model["ok"] is False and model["error_type"] == "MemoryPlanError" and "--gpu-memory-limit" in model["error"]


def test_qualification_refusal_exits_1_with_the_reason(demo_model: str) -> None:
    r = _doctor("--backend", "fakegpu", "--model", demo_model, **{faults.ENV_VAR: "copy:stale"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED to start" in r.stdout
    assert "refusing to start on backend 'fakegpu'" in r.stdout and "wrong results eagerly" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_bad_model_file_exits_1_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model at all")
    r = _doctor("--backend", "cpu", "--model", str(bad))
    assert r.returncode == 1
    assert f"Model {bad}: FAILED to start" in r.stdout and str(bad) in r.stdout.split("FAILED to start")[1]
    assert "Traceback" not in r.stdout + r.stderr


def test_engine_options_without_model_are_a_usage_error() -> None:
    r = _doctor("--moe-cpu-layers", "all", "--enforce-eager")
    assert r.returncode == 2
    assert "--moe-cpu-layers, --enforce-eager apply to a model: give --model PATH" in r.stderr


def test_plan_error_names_the_flag_that_set_the_budget():
    """The budget came from --gpu-memory-limit: the message says so, in readable units."""
    from freetoken.backends.contract import MemoryPlanError, ModelShape
    from freetoken.backends.options import EngineOptions
    from freetoken.moe.session.gpu_session import GpuModelSession

    class NoMemoryBackend:
        name = "no-memory"
        locked_fetch_share = 0.0  # the contract's default (Backend.locked_fetch_share)

        def device(self):
            return "cpu"

        def device_memory(self):
            return None

    session = GpuModelSession(NoMemoryBackend(), EngineOptions(gpu_memory_limit=1 << 20, moe_cpu_layers="0"), None)
    shape = ModelShape(num_layers=2, hidden=64, moe_intermediate=32, num_experts=4, top_k=2, moe_layers=[0, 1],
                       dense_bytes=10 << 20, kv_bytes_per_token=1024)
    with pytest.raises(MemoryPlanError, match=r"the budget is 1\.0 MiB \(--gpu-memory-limit\)"):
        session.plan(shape)


def test_model_prints_streaming_threshold_and_cache(demo_model: str) -> None:
    """The measured long-prompt threshold (PCIe copy of one layer against the CPU experts'
    time per token), the expert cache and the page-lock limit are in the report."""
    r = _doctor("--backend", "fakegpu", "--model", demo_model, "--moe-cpu-layers", "all", "--dtype", "float32",
                "--moe-cache-size", "4MiB", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert set(report["memory_lock"]) == {"soft_bytes", "hard_bytes", "can_lock", "reason"}
    info = report[MODEL_KEY]["backend_info"]
    profile = info["prefill_stream"]["profile"]
    assert profile["source"] == "measured" and profile["pcie_gb_s"] > 0 and profile["cpu_us_per_token"] > 0
    assert info["prefill_stream"]["min_tokens"] == profile["min_tokens"] >= 2
    assert info["expert_cache"]["slots"] == (4 << 20) // (3 * 256 * 256 * 4)
    text = _doctor("--backend", "fakegpu", "--model", demo_model, "--moe-cpu-layers", "all", "--dtype", "float32",
                   "--moe-cache-size", "4MiB").stdout
    assert "long prompts: auto; prefill chunks of >= " in text and "expert cache: " in text
    assert "Page-locking host expert banks:" in text

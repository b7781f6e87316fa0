"""The fakegpu plugin standing in for a GPU whose kernels read page-locked, mapped host
banks, for the CI runs (no GPU) of what the GPU reads from the host itself: locked fetch
by copy, the gather kernels of routed prompt streaming. Host memory is the plugin's device
memory; the packed kernels run in Triton's interpreter."""

from __future__ import annotations

from typing import Any

import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.models.demo import ensure_demo_model
from greedy_runs import run_greedy

INTERPRET = not torch.cuda.is_available()
#: one demo expert in Q8_0: 3 matrices of 256 x 256 values, 34 bytes per 32
EXPERT_BYTES = 3 * 256 * 256 * 34 // 32


def run_demo(prompts: list[list[int]], tokens: int, **kw: Any) -> tuple[list, dict, Any]:
    """(greedy outputs with logits, the session's report, its expert traffic) of the demo
    model's Q8_0 file on the fakegpu plugin, float32, every layer a CPU layer."""
    registry.reset()
    eng = LLMEngine(EngineConfig(model=ensure_demo_model().gguf_path, backend="fakegpu", dtype="float32",
                                 max_model_len=64, kv_cache_tokens=512, max_running_requests=len(prompts),
                                 moe_cpu_layers="all", **kw))
    try:
        got = run_greedy(eng, prompts, tokens)
        return got, eng.session.report(), eng.session.traffic
    finally:
        eng.close()
        registry.reset()


def wide_tiles_in_the_interpreter(monkeypatch: Any) -> None:
    """The packed kernels' and the BF16 per-route kernels' tiles wide enough for one program
    per route (and token): the interpreter's cost is per program. The BF16 ones are the
    startup qualification's GPU experts (its check layer is the demo's 256 x 256 experts)."""
    from test_packed_experts import WIDE, WIDE_BF16

    from freetoken.kernels import moe_experts


    from freetoken.kernels import moe_packed

    monkeypatch.setattr(moe_packed, "default_config", lambda device: WIDE)
    monkeypatch.setattr(moe_experts, "DEFAULT_CONFIG", WIDE_BF16)


def mapped_banks_in_the_interpreter(monkeypatch: Any) -> None:
    """From here on the fakegpu session registers its host banks mapped (the session does
    that for CUDA/HIP devices only; the plugin's registration gives the same address) and
    runs the packed kernels, in the interpreter with few programs."""
    from freetoken.kernels import availability
    from freetoken.moe.handoff.expert_traffic import ExpertTraffic
    from freetoken.moe.handoff.host_pinning import register_banks

    def register(self, staging, wanted, mapped):
        if wanted:
            self.registration = register_banks(staging, self.cpu_layers.values(), mapped=mapped)

    monkeypatch.setattr(ExpertTraffic, "_register", register)
    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    wide_tiles_in_the_interpreter(monkeypatch)

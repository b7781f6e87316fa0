"""``freetoken bench moe-layer`` end to end on the CPU: one worker through the fake GPU
backend of tests/qualify (hand-off served by the real CPU coordinator), CUDA events and
device queries stubbed, tiny sizes, the Triton kernels (in Triton's interpreter) with one
program per route and per token. Checks that every row the GPU run reports is produced
(layers per IO path, the empty-CPU diagnostic, the hand-off floor, the GPU experts alone
for both implementations with their HBM floor, the Triton block sweep) and that the
summary and table are built from them. Timings here mean nothing."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("freetoken_cpu_moe")
pytest.importorskip("triton")

import triton  # noqa: E402

from freetoken.cli.bench import moe_layer  # noqa: E402


def _fake_backend_class():
    path = Path(__file__).resolve().parents[1] / "qualify" / "fake_backend.py"
    spec = importlib.util.spec_from_file_location("ft_bench_fake_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeGpuBackend


class _HostEvent:
    def __init__(self, **_: object) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU smoke test of the benchmark (the GPU runs the real one)")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton's interpreter is off")
    backend = _fake_backend_class()()
    monkeypatch.setattr("freetoken.backends.registry.get_backend", lambda name=None: backend)
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: types.SimpleNamespace(name="fake"))
    monkeypatch.setattr(moe_layer, "_gpu_impls", lambda device: (["torch", "triton"], ""))
    # the per-route kernels' tiles (the only kernels these batches of 2 routes run) of the
    # default configuration and of the sweep's ones, each of them under its own name, with one
    # program per route and per token at these sizes: the interpreter's cost is per program
    from freetoken.kernels import moe_experts

    def wide(config: moe_experts.BlockConfig) -> moe_experts.BlockConfig:
        return dataclasses.replace(config, route_block_i=32, route_block_h=64, route_block_n=64, route_block_r=32)

    sweep = moe_layer._triton_sweep
    monkeypatch.setattr(moe_experts, "DEFAULT_CONFIG", wide(moe_experts.DEFAULT_CONFIG))
    monkeypatch.setattr(moe_layer, "_triton_sweep", lambda: {name: wide(c) for name, c in sweep().items()})
    return backend


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe_layer.add_parser(parser.add_subparsers())
    argv = ["moe-layer", "--worker", "--hidden", "64", "--intermediate", "32", "--experts", "4", "--top-k", "2",
            "--layers", "1", "--cpu-threads", "1", "--iters", "2", "--repeats", "1", "--floor-intermediate", "16",
            "--paths", "kernel_io,copy,host_callback", *extra]  # fmt: skip
    return parser.parse_args(argv)


def test_worker_reports_every_row(fake_cuda):
    result = moe_layer.worker(_args())
    rows = result["per_layer_us"]
    assert result["gpu_impl"] == "triton" and not result["triton_error"]
    expected = ["kernel_io_eager", "kernel_io_graph", "copy_eager", "copy_graph", "host_callback_eager",
                "empty_kernel_io_graph", "empty_copy_graph", "floor_kernel_io_graph", "floor_copy_graph",
                "gpu_experts_alone", "gpu_experts_alone_torch_graph", "gpu_experts_alone_triton_eager",
                "gpu_experts_alone_triton_i32_n64_graph", "empty_gpu_experts_alone_triton_graph",
                "cpu_compute_alone", "empty_cpu_compute_alone"]  # fmt: skip
    missing = [k for k in expected if k not in rows]
    assert not missing, f"missing rows {missing}; got {sorted(rows)}"
    assert "host_callback_graph" not in rows and "empty_host_callback_eager" not in rows
    assert rows["gpu_experts_alone"] == rows["gpu_experts_alone_triton_graph"]
    assert set(result["overhead_per_layer_us"]) == set(result["cpu_alone_interleaved_us"])
    # one GPU route per token on one token: one distinct expert's bf16 gate/up/down at 4.3 TB/s
    assert result["hbm_floor_us"]["gpu_experts"] == pytest.approx(3 * 64 * 32 * 2 / 4.3e12 * 1e6)
    stages = result["stages_us"]
    for key in ("kernel_io_graph", "copy_graph", "floor_kernel_io_graph", "floor_copy_graph"):
        assert stages[f"{key}_serve"] > 0 and f"{key}_overhead_vs_serve" in stages and f"{key}_step_gap" in stages
    for prefix in ("", "floor_"):
        assert stages[f"{prefix}cpu_task_native_loop"] > 0 and stages[f"{prefix}cpu_task_host_driven_handoff"] > 0
    summary = moe_layer.summarize([result, result])
    assert summary["per_layer_us"] == rows and summary["gpu_impl"] == ["triton", "triton"]
    assert summary["stages_us"] == stages
    moe_layer.print_table(summary)


def test_worker_torch_layers_without_diagnostics(fake_cuda):
    result = moe_layer.worker(_args("--gpu-impl", "torch", "--empty-cpu", "0", "--triton-sweep", "0",
                                    "--floor-intermediate", "0", "--paths", "copy"))  # fmt: skip
    rows = result["per_layer_us"]
    assert result["gpu_impl"] == "torch"
    assert rows["gpu_experts_alone"] == rows["gpu_experts_alone_torch_graph"]
    assert "gpu_experts_alone_triton_graph" in rows  # both implementations are always timed alone
    sweep = [f"gpu_experts_alone_triton_{name}_graph" for name in moe_layer._triton_sweep()]
    assert not any(k.startswith(("empty_", "floor_")) or k in sweep for k in rows)

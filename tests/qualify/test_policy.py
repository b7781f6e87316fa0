"""Each rule of the startup-qualification policy fires, through a fake backend whose
hand-off is served by the real CPU coordinator, with faults injected by the switch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("freetoken_cpu_moe")

from freetoken.backends.handoff_io import IOPath  # noqa: E402
from freetoken.moe.handoff import faults  # noqa: E402
from freetoken.moe.qualify.startup import (  # noqa: E402
    LAST_RESULTS,
    GraphSettings,
    QualificationError,
    QualifyConfig,
    doctor_section,
    qualify,
)

from .fake_backend import FakeGpuBackend  # noqa: E402

CONFIG = QualifyConfig(hidden=128, intermediate=64, batch_sizes=(1, 3), eager_steps=4, replays=5)


def settings() -> GraphSettings:
    return GraphSettings(enabled=True, batch_sizes=[1, 2, 4], max_batch_size=4)


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    LAST_RESULTS.clear()


def test_rule1_bf16_prefers_kernel_io_with_graphs():
    backend = FakeGpuBackend()
    gs = settings()
    r = qualify(backend, torch.bfloat16, gs, config=CONFIG)
    assert r.io_path == IOPath.KERNEL_IO.value and r.graphs is True
    assert gs.enabled and gs.batch_sizes == [1, 2, 4] and gs.max_batch_size == 4
    assert backend.captures == len(CONFIG.batch_sizes)
    modes = [(c["path"], c["mode"], c["ok"]) for c in r.checks]
    assert modes == [("kernel_io", "eager", True), ("kernel_io", "graph", True)]
    assert all(c["max_rel_error"] < CONFIG.tolerance for c in r.checks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rule1_other_dtypes_take_copy(dtype):
    r = qualify(FakeGpuBackend(), dtype, settings(), config=CONFIG)
    assert r.io_path == IOPath.COPY.value and r.graphs is True
    assert "copy path" in r.reason


def test_rule1_failed_kernel_io_probe_takes_copy():
    r = qualify(FakeGpuBackend(kio_probe_ok=False), torch.bfloat16, settings(), config=CONFIG)
    assert r.io_path == IOPath.COPY.value
    assert "KernelIO probe failed" in r.reason


def test_rule2_wrong_bf16_kernel_io_retries_copy(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io:stale")
    r = qualify(FakeGpuBackend(), torch.bfloat16, settings(), config=CONFIG)
    assert r.io_path == IOPath.COPY.value and r.graphs is True
    assert r.checks[0]["path"] == "kernel_io" and r.checks[0]["ok"] is False
    assert r.checks[0]["max_rel_error"] > 0.1  # stale activations are far off, not rounding
    assert any("retrying with copy" in w for w in r.warnings)


def test_rule3_graph_wrong_turns_graphs_off(monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io@graph:stale")
    gs = settings()
    r = qualify(FakeGpuBackend(), torch.bfloat16, gs, config=CONFIG)
    assert r.io_path == IOPath.KERNEL_IO.value  # eager was right
    assert r.graphs is False
    assert gs.enabled is False and gs.batch_sizes == [] and gs.max_batch_size == 0
    assert any("decode graphs turned off" in w for w in r.warnings)
    assert "decode graphs turned off" in caplog.text


def test_rule3_decision_is_shared_by_all_ranks():
    class OtherRankSaysNo:
        def __init__(self):
            self.calls = []

        def all_true(self, value):
            self.calls.append(value)
            return value and len(self.calls) < 3  # 3rd agreement is the graph verdict

    gs = settings()
    group = OtherRankSaysNo()
    r = qualify(FakeGpuBackend(), torch.bfloat16, gs, group=group, config=CONFIG)
    assert group.calls == [True, True, True]  # this rank was fine everywhere
    assert r.graphs is False and gs.enabled is False and gs.batch_sizes == []
    assert any("another tensor-parallel rank" in w for w in r.warnings)


@pytest.mark.parametrize("spec", ["copy:stale", "kernel_io:stale,copy:stale"])
def test_rule4_eager_wrong_refuses_to_start(monkeypatch, spec):
    monkeypatch.setenv(faults.ENV_VAR, spec)
    dtype = torch.float16 if spec == "copy:stale" else torch.bfloat16
    with pytest.raises(QualificationError, match="wrong results eagerly"):
        qualify(FakeGpuBackend(), dtype, settings(), config=CONFIG)


def test_rule4_api_error_refuses_to_start(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io:error")
    with pytest.raises(QualificationError, match="raised InjectedFault"):
        qualify(FakeGpuBackend(), torch.bfloat16, settings(), config=CONFIG)


def test_rule4_graph_api_error_refuses_to_start():
    backend = FakeGpuBackend()
    backend.replay_raises = True
    with pytest.raises(QualificationError, match="graph capture/replay"):
        qualify(backend, torch.bfloat16, settings(), config=CONFIG)


def test_rule5_graphs_off_checks_eager_only(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io@graph:stale")  # would fail a graph check
    backend = FakeGpuBackend()
    gs = GraphSettings(enabled=False)
    r = qualify(backend, torch.bfloat16, gs, config=CONFIG)
    assert r.graphs is False and backend.captures == 0 and not r.warnings
    assert [c["mode"] for c in r.checks] == ["eager"]
    assert "configured off" in r.reason


def test_doctor_section_reports_last_result():
    backend = FakeGpuBackend()
    qualify(backend, torch.bfloat16, settings(), config=CONFIG)
    d = doctor_section(backend, run=False)
    assert d["qualified"] is True and d["io_path"] == "kernel_io" and d["graphs"] is True and d["reason"]
    LAST_RESULTS.clear()
    assert doctor_section(backend, run=False)["qualified"] is False


def test_fault_spec_is_validated(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io:sometimes")
    with pytest.raises(ValueError, match="FREETOKEN_FAULT_INJECT"):
        faults.fault_for("kernel_io", False)
    monkeypatch.setenv(faults.ENV_VAR, "copy@graph:stale")
    assert faults.fault_for("copy", False) is None and faults.fault_for("copy", True) == "stale"

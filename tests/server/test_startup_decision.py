"""The backend's startup decision (IO path, sync mode, decode graphs, why, warnings) where
an operator looks: /health, /metrics and the startup log.

Two ways in: a real ``freetoken serve --backend fakegpu`` process (the generic GPU session
over simulated streams: copy path, no graphs), and the app in this process over the
qualification tests' fake backend (tests/qualify/fake_backend.py: KernelIO and graph
capture), where an injected fault (``FREETOKEN_FAULT_INJECT``) makes the startup check
fall back: ``kernel_io:stale`` to the copy path, ``kernel_io@graph:stale`` to eager decode.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import scrape
from starlette.testclient import TestClient

from freetoken.engine.config import EngineConfig
from freetoken.moe.handoff import faults
from freetoken.server.app import create_app
from freetoken.server.metrics import BACKEND_INFO_LABELS

pytestmark = pytest.mark.timeout(300)

PROMPT = {"model": "freetoken-demo", "prompt": [5, 9, 13, 200], "max_tokens": 6, "temperature": 0,
          "ignore_eos": True}


def _info_samples(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> list[dict[str, str]]:
    samples = metrics.get("freetoken_backend_info", {})
    assert all(value == 1.0 for value in samples.values()), samples
    return [dict(labels) for labels in samples]


# ------------------------------------------------------------------ a real server on fakegpu


@pytest.fixture(scope="module")
def fakegpu_server(server_factory: Any) -> Any:
    return server_factory(["--backend", "fakegpu"])


@pytest.fixture(scope="module")
def fakegpu_resident_server(server_factory: Any) -> Any:
    return server_factory(["--backend", "fakegpu", "--moe-cpu-layers", "0"])


def test_health_shows_the_decision(fakegpu_server: Any) -> None:
    body = httpx.get(fakegpu_server.base_url + "/health", timeout=10).json()
    assert body["status"] == "ok" and body["backend"] == "fakegpu"
    # fakegpu: no KernelIO, no graph capture, no device memory to plan with
    assert (body["io_path"], body["sync_mode"], body["graphs"]) == ("copy", "stream_memops", False)
    assert "cannot capture graphs" in body["reason"] and "no KernelIO" in body["reason"]
    assert body["warnings"] == []
    assert body["act_dtype"] == "bfloat16"
    assert (body["moe_cpu_layers"], body["moe_gpu_layers"]) == ("0-3", 0)
    assert "graph_batch_sizes" not in body  # no graphs: the report has none
    assert None not in body.values()


def test_metrics_show_the_decision_and_the_step_split(fakegpu_server: Any) -> None:
    before = scrape(fakegpu_server.base_url)
    assert _info_samples(before) == [{"backend": "fakegpu", "io_path": "copy", "sync_mode": "stream_memops",
                                      "graphs": "false", "act_dtype": "bfloat16", "moe_cpu_layers": "0-3"}]
    assert before["freetoken_moe_gpu_layers"][()] == 0
    assert not any(name.startswith("freetoken_gpu_memory_") for name in before)  # a host "device": no GPU memory
    resp = httpx.post(fakegpu_server.base_url + "/v1/completions", json=PROMPT, timeout=120)
    assert resp.status_code == 200, resp.text
    after = scrape(fakegpu_server.base_url)
    share = after["freetoken_cpu_wait_share"][()]
    assert 0.0 <= share <= 1.0
    step = after["freetoken_step_breakdown_decode_step_seconds"][()]
    cpu = after["freetoken_step_breakdown_cpu_experts_seconds"][()]
    assert 0 < step < 10 and 0 <= cpu
    # one sample per family, unlabelled, of type gauge
    text = httpx.get(fakegpu_server.base_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("freetoken_backend_info", "freetoken_cpu_wait_share", "freetoken_step_breakdown_decode_step_seconds"):
        assert families[name].type == "gauge" and len(families[name].samples) == 1


def test_startup_log_states_the_decision_once(fakegpu_server: Any) -> None:
    log = fakegpu_server.log()
    loaded = [line for line in log.splitlines() if "freetoken.server.state: loaded model" in line]
    assert len(loaded) == 1, loaded
    line = loaded[0]
    assert " INFO " in line
    assert ("backend fakegpu, IO path copy, sync mode stream_memops, decode graphs off, activations bfloat16, "
            "MoE CPU layers 0-3 (0 on the GPU)") in line
    assert "why: backend fakegpu cannot capture graphs" in line
    assert "startup check:" not in log  # no warnings


def test_health_states_the_memory_plan(server_factory: Any) -> None:
    """Under a GPU memory limit the plan's parts are in /health, and they add up: the dense
    part, the experts on the GPU, the KV cache and the step reserve (workspace, prompt-chunk
    activations, memory outside the allocator) within the budget."""
    srv = server_factory(["--backend", "fakegpu", "--gpu-memory-limit", "3GiB", "--max-model-len", "512"])
    body = httpx.get(srv.base_url + "/health", timeout=10).json()
    plan = body["memory_plan"]
    assert plan["budget"] == 3 << 30
    assert plan["reserve"] >= plan["workspace"] + plan["activations"] + plan["outside"] > 0
    assert plan["dense"] + plan["expert_bytes"] + plan["kv_budget"] + plan["reserve"] <= plan["budget"]
    assert plan["prefill_chunk"] >= 64 and plan["gpu_layers"] == body["moe_gpu_layers"]


def test_resident_experts_have_no_hand_off(fakegpu_resident_server: Any) -> None:
    base = fakegpu_resident_server.base_url
    body = httpx.get(base + "/health", timeout=10).json()
    assert (body["io_path"], body["graphs"]) == ("none", False)
    assert body["sync_mode"] is None  # the report's own value: nothing to synchronise
    assert (body["moe_cpu_layers"], body["moe_gpu_layers"]) == ("none", 4)
    assert "no hand-off" in body["reason"]
    assert httpx.post(base + "/v1/completions", json=PROMPT, timeout=120).status_code == 200
    metrics = scrape(base)
    assert _info_samples(metrics) == [{"backend": "fakegpu", "io_path": "none", "sync_mode": "none",
                                       "graphs": "false", "act_dtype": "bfloat16", "moe_cpu_layers": "none"}]
    assert metrics["freetoken_moe_gpu_layers"][()] == 4
    assert "freetoken_cpu_wait_share" not in metrics  # no CPU workers: the report has no share


def test_qualification_refusal_stops_the_server_with_the_reason(server_factory: Any) -> None:
    # The copy path is fakegpu's only one: stale activations there fail the eager check.
    with pytest.raises(RuntimeError, match="exited with 1") as failed:
        server_factory(["--backend", "fakegpu"], {faults.ENV_VAR: "copy:stale"})
    log = str(failed.value)
    assert "refusing to start on backend 'fakegpu'" in log
    assert "copy hand-off gives wrong results eagerly" in log
    assert "loaded model" not in log


# ------------------------------------------------------------------ the app in this process


def _fake_backend_class() -> Any:
    path = Path(__file__).resolve().parents[1] / "qualify" / "fake_backend.py"
    spec = importlib.util.spec_from_file_location("freetoken_test_qualify_fake_backend", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeGpuBackend


@pytest.fixture
def serve_in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``serve(backend, fault)``: the app over ``backend`` with ``fault`` injected, ready."""
    clients: list[TestClient] = []

    def serve(backend: Any, fault: str = "", **config: Any) -> TestClient:
        if fault:
            monkeypatch.setenv(faults.ENV_VAR, fault)
        else:
            monkeypatch.delenv(faults.ENV_VAR, raising=False)
        from freetoken.engine.async_engine import AsyncEngine

        cfg = EngineConfig(max_model_len=128, kv_cache_tokens=1024, **config)
        app = create_app(cfg, engine_factory=lambda c: AsyncEngine(c, backend=backend))
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            resp = client.get("/health")
            if resp.status_code == 200:
                return client
            holder = app.state.holder
            assert holder.load_error is None, holder.load_error
            time.sleep(0.05)
        raise AssertionError("the model did not load within 120 s")

    yield serve
    for client in clients:
        client.__exit__(None, None, None)


def _metrics(client: TestClient) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _startup_records(caplog: pytest.LogCaptureFixture) -> tuple[list[logging.LogRecord], list[logging.LogRecord]]:
    state = [r for r in caplog.records if r.name == "freetoken.server.state"]
    loaded = [r for r in state if r.getMessage().startswith("loaded model")]
    warned = [r for r in state if r.getMessage().startswith("startup check:")]
    return loaded, warned


@pytest.mark.parametrize(
    "fault, io_path, sync_mode, graphs, warning",
    [
        ("", "kernel_io", "kernel_io", True, None),
        ("kernel_io:stale", "copy", "stream_memops", True, "BF16 KernelIO gave wrong results eagerly"),
        ("kernel_io@graph:stale", "kernel_io", "kernel_io", False, "graph replay of the kernel_io hand-off is wrong"),
    ],
    ids=["no-fault", "kernel-io-falls-back-to-copy", "graphs-turned-off"],
)
def test_fallback_decision_in_health_metrics_and_log(serve_in_process: Any, caplog: pytest.LogCaptureFixture,
                                                     fault: str, io_path: str, sync_mode: str, graphs: bool,
                                                     warning: str | None) -> None:
    caplog.set_level(logging.INFO)
    client = serve_in_process(_fake_backend_class()(), fault, dtype="bfloat16", cuda_graph_max_bs=2)
    body = client.get("/health").json()
    assert body["backend"] == "fake-qualify"
    assert (body["io_path"], body["sync_mode"], body["graphs"]) == (io_path, sync_mode, graphs)
    assert body["act_dtype"] == "bfloat16" and body["moe_cpu_layers"] == "0-3" and body["moe_gpu_layers"] == 0
    if graphs:
        assert body["graph_batch_sizes"] == [1, 2] and "graph replay verified" in body["reason"]
    else:
        assert "graph_batch_sizes" not in body
    if warning is None:
        assert body["warnings"] == []
    else:
        assert len(body["warnings"]) == 1 and warning in body["warnings"][0]

    metrics = _metrics(client)
    assert _info_samples(metrics) == [{"backend": "fake-qualify", "io_path": io_path, "sync_mode": sync_mode,
                                       "graphs": "true" if graphs else "false", "act_dtype": "bfloat16",
                                       "moe_cpu_layers": "0-3"}]

    loaded, warned = _startup_records(caplog)
    assert len(loaded) == 1 and loaded[0].levelno == logging.INFO
    message = loaded[0].getMessage()
    assert f"IO path {io_path}, sync mode {sync_mode}, decode graphs {'on (batch sizes 1,2)' if graphs else 'off'}" \
        in message
    assert f"why: {body['reason']}" in message
    assert [r.getMessage() for r in warned] == [f"startup check: {w}" for w in body["warnings"]]
    assert all(r.levelno == logging.WARNING for r in warned)


def test_cpu_backend_report_has_fewer_keys(serve_in_process: Any, caplog: pytest.LogCaptureFixture) -> None:
    from freetoken_cpu_moe.backend import CpuBackend

    caplog.set_level(logging.INFO)
    client = serve_in_process(CpuBackend())
    body = client.get("/health").json()
    assert (body["backend"], body["io_path"], body["sync_mode"], body["graphs"]) == (
        "cpu", "synchronous", "synchronous", False)
    assert body["moe_cpu_layers"] == "all"
    for key in ("warnings", "act_dtype", "moe_gpu_layers", "graph_batch_sizes"):
        assert key not in body  # not in the CPU backend's report: left out, not null
    assert None not in body.values()
    metrics = _metrics(client)
    (labels,) = _info_samples(metrics)
    assert set(labels) == set(BACKEND_INFO_LABELS)
    assert labels["backend"] == "cpu" and labels["graphs"] == "false" and labels["act_dtype"] == ""
    assert "freetoken_moe_gpu_layers" not in metrics and "freetoken_cpu_wait_share" not in metrics
    loaded, warned = _startup_records(caplog)
    assert len(loaded) == 1 and "backend cpu, IO path synchronous, sync mode synchronous" in loaded[0].getMessage()
    assert warned == []


# ------------------------------------------------------------------ the series of one report


def test_backend_series_of_a_gpu_report() -> None:
    """What a CUDA session reports becomes gauges in base units; text stays out of labels."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from freetoken.server.metrics import backend_families

    report = {
        "backend": "cuda", "io_path": "kernel_io", "sync_mode": "kernel_io", "graphs": True,
        "reason": "KernelIO probe passed and activations are BF16; graph replay verified",
        "warnings": ["something, with \"quotes\""], "act_dtype": "bfloat16", "moe_cpu_layers": "0-11,40",
        "moe_gpu_layers": 36, "memory_plan": {"budget": 24 << 30, "dense": 1}, "graph_batch_sizes": [1, 2],
        "cpu_wait_share": 0.25, "step_breakdown": {"decode_step_us": 12000.0, "cpu_experts_us": 3000.0},
        "gpu_memory": {"allocated": 5 << 30, "max_allocated": 6 << 30, "reserved": 7 << 30},
    }

    class One(Collector):
        def collect(self) -> Any:
            return backend_families(report)

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    got = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            got[sample.name] = (dict(sample.labels), sample.value)
    assert got["freetoken_backend_info"] == ({"backend": "cuda", "io_path": "kernel_io", "sync_mode": "kernel_io",
                                              "graphs": "true", "act_dtype": "bfloat16",
                                              "moe_cpu_layers": "0-11,40"}, 1.0)
    assert got["freetoken_moe_gpu_layers"] == ({}, 36.0)
    assert got["freetoken_cpu_wait_share"] == ({}, 0.25)
    assert got["freetoken_step_breakdown_decode_step_seconds"] == ({}, pytest.approx(0.012))
    assert got["freetoken_step_breakdown_cpu_experts_seconds"] == ({}, pytest.approx(0.003))
    assert got["freetoken_gpu_memory_allocated_bytes"] == ({}, float(5 << 30))
    assert got["freetoken_gpu_memory_max_allocated_bytes"] == ({}, float(6 << 30))
    assert got["freetoken_gpu_memory_reserved_bytes"] == ({}, float(7 << 30))
    assert got["freetoken_gpu_memory_budget_bytes"] == ({}, float(24 << 30))
    assert "graph replay verified" not in text and "quotes" not in text
    assert list(backend_families({})) == []  # while loading: nothing


def test_moe_statistics_in_metrics(server_factory: Any) -> None:
    """--moe-collect-stats with an expert cache: per-layer route counters add up, the cache's
    size and the decode steps are exported."""
    server = server_factory(["--backend", "fakegpu", "--moe-collect-stats", "--moe-cache-size", "2MiB",
                             "--moe-hybrid-max-fetch", "1"])
    resp = httpx.post(server.base_url + "/v1/completions", json=PROMPT, timeout=120)
    assert resp.status_code == 200, resp.text
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    per_layer = {name: {s.labels["layer"]: s.value for s in families[name].samples if s.name.endswith("_total")}
                 for name in ("freetoken_moe_routes", "freetoken_moe_gpu_routes", "freetoken_moe_cpu_routes")}
    assert set(per_layer["freetoken_moe_routes"]) == {"0", "1", "2", "3"}
    for layer, routes in per_layer["freetoken_moe_routes"].items():
        assert routes > 0
        assert per_layer["freetoken_moe_gpu_routes"][layer] + per_layer["freetoken_moe_cpu_routes"][layer] == routes
    steps = families["freetoken_moe_decode_steps"].samples[0].value
    assert steps > 0 and sum(per_layer["freetoken_moe_routes"].values()) == steps * 4 * 4  # 4 layers, top-4, batch 1
    assert families["freetoken_moe_cache_slots"].samples[0].value == (2 << 20) // (3 * 256 * 256 * 2)
    assert 0 <= families["freetoken_moe_miss_rate"].samples[0].value <= 1

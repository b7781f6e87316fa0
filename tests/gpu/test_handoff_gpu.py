"""The hybrid MoE layer on a real GPU: every path x eager/graph x dtype against the
oracle (CPU experts through freetoken_cpu_moe + float64 torch for the GPU experts),
replays with changing inputs and routes, empty routes, recapture, many consecutive
hand-offs, timeouts, and the qualification policy with injected faults."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
cm = pytest.importorskip("freetoken_cpu_moe")

from freetoken import handoff  # noqa: E402
from freetoken.backends.handoff_io import SyncMode  # noqa: E402
from freetoken.backends.handoff_io import HandoffError, IOPath
from freetoken.moe.handoff import faults  # noqa: E402
from freetoken.native_gpu import backend as native_backend  # noqa: E402
from freetoken.moe.qualify.startup import GraphSettings, QualificationError, QualifyConfig, qualify  # noqa: E402
from freetoken.moe.qualify.checks import QualLayer  # noqa: E402

CONFIG = QualifyConfig(hidden=512, intermediate=256, batch_sizes=(1, 4, 16), eager_steps=6, replays=8)


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)


@pytest.fixture
def layer_factory(backend):
    made = []

    def make(dtype):
        layer = QualLayer(backend, dtype, CONFIG, backend.cpu_experts())
        made.append(layer)
        return layer

    yield make
    for layer in made:
        layer.close()


def test_probe_and_capabilities(backend):
    caps = backend.capabilities()
    print("capabilities:", caps.as_dict())
    assert caps.stream_memops and caps.mapped_memory and caps.graph_capture
    assert caps.memops_in_graphs and caps.kernel_io and caps.host_callbacks and caps.flag_wait_kernel


def test_graph_memop_probe(backend):
    p = backend.graph_memop_probe()
    print("graph memop probe:", p)
    assert p["error"] == ""
    assert p["flag_unchanged_during_capture"] and p["replay_performed"]
    assert p["native"] or p["explicit_ok"]


def test_mapped_memory_and_staging(backend):
    staging = backend.staging()
    buf = staging.alloc_host(4096, mapped=True)
    assert buf.device_ptr and buf.mapped
    native = backend.native()
    native.flag_write_kernel(backend.current_stream(), buf.device_ptr + 64, 0xABCDEF)
    backend.synchronize()
    assert ctypes.c_uint64.from_address(buf.host_ptr + 64).value == 0xABCDEF
    src = torch.randn(1 << 20)
    handle = staging.register_host(src)
    dst = torch.full((1 << 20,), float("nan"), device=backend.device())
    staging.fetch(backend.current_stream(), dst, src)
    backend.synchronize()
    assert torch.equal(dst.cpu(), src)
    del handle


PATHS = [
    (IOPath.KERNEL_IO, torch.bfloat16),
    (IOPath.COPY, torch.bfloat16),
    (IOPath.COPY, torch.float16),
    (IOPath.COPY, torch.float32),
]


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("path,dtype", PATHS, ids=lambda v: getattr(v, "value", str(v).replace("torch.", "")))
def test_path_against_oracle(layer_factory, path, dtype, mode):
    layer = layer_factory(dtype)
    rec = layer.check(path, graph=mode == "graph")
    print(rec)
    assert rec["ok"] and rec["steps"] >= 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_callback_eager_and_refuses_capture(layer_factory, dtype):
    layer = layer_factory(dtype)
    assert layer.check(IOPath.HOST_CALLBACK, graph=False)["ok"]
    assert not layer.graph_capable(IOPath.HOST_CALLBACK)
    ex = layer.executor(IOPath.HOST_CALLBACK)
    dev = layer.backend.device()
    x, ids, w, mask = (t.to(dev) for t in layer.inputs(1, "mixed"))
    with pytest.raises(Exception, match="eager only"):
        layer.backend.graph_capture().capture(lambda: ex.forward(x, ids, w, mask))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_flag_wait_kernel_sync(layer_factory, backend, mode):
    from freetoken.moe.handoff.hybrid import HybridMoEExecutor

    layer = layer_factory(torch.float16)
    ex = HybridMoEExecutor(backend, 0, layer.experts, layer.bank.address, CONFIG.top_k, IOPath.COPY, torch.float16,
                           coordinator=layer.coordinator, sync_mode=SyncMode.FLAG_WAIT_KERNEL)  # fmt: skip
    ex.prepare(CONFIG.batch_sizes)
    layer.executors[IOPath.COPY] = ex
    assert layer.check(IOPath.COPY, graph=mode == "graph")["ok"]


def test_explicit_memop_graph_nodes(layer_factory, backend):
    if not backend.graph_memop_probe().get("explicit_ok"):
        pytest.skip("explicit memop nodes unsupported here")
    layer = layer_factory(torch.bfloat16)
    ex = layer.executor(IOPath.COPY)
    ex.sync = native_backend.MemopSync(backend.native(), explicit_nodes=True)
    assert layer.check(IOPath.COPY, graph=True)["ok"]


def test_empty_routes_do_not_wake_cpu(layer_factory):
    layer = layer_factory(torch.bfloat16)
    ex = layer.executor(IOPath.KERNEL_IO)
    dev = layer.backend.device()
    served = layer.coordinator.stats()["served"]
    for _ in range(5):
        x, ids, w, mask = layer.inputs(4, "no_cpu")
        out = ex.forward(x.to(dev), ids.to(dev), w.to(dev), mask.to(dev))
        layer.backend.synchronize()
        ref = layer.oracle(x, ids, w, mask)
        assert float((out.cpu().double() - ref).norm() / ref.norm()) < CONFIG.tolerance
    assert layer.coordinator.stats()["served"] == served
    assert ex.tasks[4].flags.ready == 0 and ex.tasks[4].flags.done == 0


@pytest.mark.parametrize("path", [IOPath.KERNEL_IO, IOPath.COPY])
def test_recapture_and_many_handoffs(layer_factory, path):
    layer = layer_factory(torch.bfloat16)
    ex = layer.executor(path)
    backend, dev, tokens = layer.backend, layer.backend.device(), 4
    x, ids, w, mask = layer.inputs(tokens, "all_cpu")
    sx, sids, sw, smask = x.to(dev), ids.to(dev), w.to(dev), mask.to(dev)
    sout = torch.empty(tokens, CONFIG.hidden, dtype=torch.bfloat16, device=dev)
    sout.copy_(ex.forward(sx, sids, sw, smask))
    backend.synchronize()
    task = ex.tasks[tokens]
    for capture in range(2):  # capture, then recapture over the same task
        graph = backend.graph_capture().capture(lambda: sout.copy_(ex.forward(sx, sids, sw, smask)))
        seq0 = task.flags.seq
        n = 500
        for i in range(n):
            if i % 100 == 0:
                x, ids, w, mask = layer.inputs(tokens, "all_cpu")
                sx.copy_(x.to(dev)), sids.copy_(ids.to(dev)), sw.copy_(w.to(dev)), smask.copy_(mask.to(dev))
                sout.fill_(float("nan"))
            graph.replay()
            if i % 100 == 99:
                backend.synchronize()
                ex.check_errors()
                ref = layer.oracle(x, ids, w, mask)
                assert float((sout.cpu().double() - ref).norm() / ref.norm()) < CONFIG.tolerance
        backend.synchronize()
        assert task.flags.seq - seq0 == n, f"capture {capture}: {task.flags.seq - seq0} hand-offs served of {n}"
        del graph


def test_combine_times_out_into_an_error(backend, monkeypatch):
    """No CPU side at all: the bounded GPU wait ends the step and the host raises."""
    monkeypatch.setattr(native_backend, "WAIT_TIMEOUT_NS", 200_000_000)
    kio = backend.kernel_io()
    task = backend.staging().new_task(0, 0, 1, 4, 256, torch.bfloat16, torch.float32, 0, mapped=True)
    dev = backend.device()
    x = torch.randn(1, 256, device=dev).to(torch.bfloat16)
    ids = torch.tensor([[0, -1, -1, -1]], dtype=torch.int32, device=dev)
    w = torch.rand(1, 4, device=dev)
    out = torch.randn(1, 256, device=dev).to(torch.bfloat16)
    before = out.clone()
    t0 = time.monotonic()
    kio.publish(backend.current_stream(), task, x, ids, w)
    kio.combine(backend.current_stream(), task, out)
    backend.synchronize()
    assert time.monotonic() - t0 < 5
    assert torch.equal(out, before)  # nothing added on a timed-out hand-off
    with pytest.raises(HandoffError, match="WATCHDOG"):
        task.check_error()


def test_coordinator_watchdog_releases_memop_wait(backend):
    """A CPU side that cannot serve in time: two long tasks published back to back on a
    one-worker coordinator; while it runs one, the other's ready stays up past the 50 ms
    watchdog, which sets err and done. The memop waits are released and the host raises."""
    pool = cm.Pool(1)
    coord = cm.Coordinator(pool=pool, watchdog_ms=50.0)
    layer = QualLayer(backend, torch.bfloat16, QualifyConfig(hidden=512, intermediate=256, cpu_threads=1),
                      backend.cpu_experts())
    tokens = 4096
    try:
        tasks = []
        for slot in range(2):
            task = backend.staging().new_task(0, slot, tokens, 4, 512, torch.bfloat16, torch.float32,
                                              layer.bank.address, mapped=True)  # fmt: skip
            task.x.copy_(torch.randn(tokens, 512).to(torch.bfloat16))
            task.ids.copy_(torch.randint(0, 8, (tokens, 4), dtype=torch.int32))
            task.w.fill_(0.25)
            coord.add_task(task.desc_buffer.host_ptr)
            tasks.append(task)
        coord.start()
        sync = backend.gpu_sync(SyncMode.STREAM_MEMOPS)
        stream = backend.current_stream()
        t0 = time.monotonic()
        for task in tasks:
            sync.publish(stream, task)
        for task in tasks:
            sync.wait(stream, task)
        backend.synchronize()
        elapsed = time.monotonic() - t0
        stats = coord.stats()
        print("elapsed", elapsed, stats)
        assert stats["watchdog_fired"] >= 1, f"neither task waited past 50 ms ({elapsed:.3f} s, {stats})"
        errors = []
        for task in tasks:
            try:
                task.check_error()
            except HandoffError as exc:
                errors.append(str(exc))
        assert len(errors) >= 1 and all("WATCHDOG" in e for e in errors)
    finally:
        coord.stop()
        layer.close()


def _settings():
    return GraphSettings(enabled=True, batch_sizes=[1, 2, 4, 8], max_batch_size=8)


def test_qualify_prefers_kernel_io_with_graphs(backend):
    gs = _settings()
    r = qualify(backend, torch.bfloat16, gs, config=CONFIG)
    print(r.as_dict())
    assert r.io_path == "kernel_io" and r.graphs and gs.enabled


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qualify_other_dtypes_use_copy(backend, dtype):
    r = qualify(backend, dtype, _settings(), config=CONFIG)
    assert r.io_path == "copy" and r.graphs and r.sync_mode == "stream_memops"


def test_qualify_stale_kernel_io_retries_copy(backend, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io:stale")
    r = qualify(backend, torch.bfloat16, _settings(), config=CONFIG)
    print(r.as_dict())
    assert r.io_path == "copy" and r.checks[0]["ok"] is False and r.checks[0]["max_rel_error"] > 0.1


def test_qualify_graph_only_fault_turns_graphs_off(backend, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io@graph:stale")
    gs = _settings()
    r = qualify(backend, torch.bfloat16, gs, config=CONFIG)
    print(r.as_dict())
    assert r.io_path == "kernel_io" and not r.graphs
    assert not gs.enabled and gs.batch_sizes == [] and gs.max_batch_size == 0


def test_qualify_eager_copy_fault_refuses(backend, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "copy:stale")
    with pytest.raises(QualificationError, match="wrong results eagerly"):
        qualify(backend, torch.float16, _settings(), config=CONFIG)


def test_qualify_api_error_refuses(backend, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "kernel_io:error")
    with pytest.raises(QualificationError, match="InjectedFault"):
        qualify(backend, torch.bfloat16, _settings(), config=CONFIG)

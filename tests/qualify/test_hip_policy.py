"""The AMD hand-off policy against a simulated HIP runtime that reproduces each known
failure (sim_hip.py): which path and sync mode qualification picks, whether decode
graphs stay on (on every tensor-parallel rank), and when startup is refused. The
production native backend, GpuSync classes, KernelIO and qualification run; the oracle
is the CPU coordinator's synchronous experts plus a float64 torch loop."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

pytest.importorskip("freetoken_cpu_moe")

from freetoken.backends.contract import BackendError  # noqa: E402

from freetoken.backends.handoff_io import SyncMode  # noqa: E402

from freetoken.backends.handoff_io import IOPath
from freetoken.moe.handoff import faults  # noqa: E402
from freetoken.native_gpu.sync import EventMemopSync, MemopSync, SyncFacts, copy_sync_modes  # noqa: E402
from freetoken.moe.qualify.startup import GraphSettings, QualificationError, QualifyConfig, qualify  # noqa: E402
from freetoken.moe.qualify.checks import CheckFailure, QualLayer  # noqa: E402

from .sim_hip import SimHipBackend, SimHipRuntime  # noqa: E402

CONFIG = QualifyConfig(hidden=128, intermediate=64, batch_sizes=(1, 3), eager_steps=4, replays=5)


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)


def settings(enabled: bool = True) -> GraphSettings:
    return GraphSettings(enabled=enabled, batch_sizes=[1, 2, 4] if enabled else None, max_batch_size=4)


# ---- the policy as a function: never a plain memop ready write on HIP ---------------------------


@pytest.mark.parametrize("memops,event,callbacks,kernels,graphs", list(itertools.product((True, False), repeat=5)))
def test_hip_copy_path_never_takes_a_plain_memop_ready_write(memops, event, callbacks, kernels, graphs):
    facts = SyncFacts(False, memops, memops and event, callbacks, kernels, "" if event else "no event API")
    modes, reason = copy_sync_modes(facts, graphs)
    assert SyncMode.STREAM_MEMOPS not in modes and reason
    if memops and event:
        assert modes == [SyncMode.EVENT_MEMOPS]
    elif graphs and kernels:
        assert modes[0] == SyncMode.FLAG_WAIT_KERNEL  # keeps decode graphs
    elif callbacks:
        assert modes[0] == SyncMode.HOST_CALLBACK
    if not (memops and event) and not callbacks and not kernels:
        assert modes == []


@pytest.mark.parametrize("memops", [True, False])
def test_cuda_copy_path_is_unchanged(memops):
    facts = SyncFacts(True, memops, False, True, True)
    modes, _ = copy_sync_modes(facts, graphs=True)
    assert modes == [SyncMode.STREAM_MEMOPS if memops else SyncMode.FLAG_WAIT_KERNEL]


# ---- ready visible before the copied payload ---------------------------------------------


def test_event_path_orders_copies_eager_and_graphs():
    backend = SimHipBackend()
    gs = settings()
    r = qualify(backend, torch.float16, gs, config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "event_memops", True)
    assert [(c["mode"], c["ok"]) for c in r.checks] == [("eager", True), ("graph", True)]
    assert "copy path ordered by event_memops" in r.reason
    assert backend.runtime.stale_reads == 0
    assert gs.enabled and gs.batch_sizes == [1, 2, 4]


def test_plain_memop_ready_write_reads_stale_payload():
    """The failure the event path exists for, reproduced: forcing STREAM_MEMOPS on HIP gives
    wrong results, which qualification turns into a refusal."""
    backend = SimHipBackend()
    layer = QualLayer(backend, torch.float16, CONFIG, backend.cpu_experts(), copy_sync=SyncMode.STREAM_MEMOPS)
    try:
        assert isinstance(layer.executor(IOPath.COPY).sync, MemopSync)
        with pytest.raises(CheckFailure) as info:
            layer.check(IOPath.COPY, graph=False)
        assert info.value.record["max_rel_error"] > 0.1
        assert backend.runtime.stale_reads > 0
    finally:
        layer.close()


def test_one_release_event_per_task_lives_through_replays_and_recapture():
    backend = SimHipBackend()
    rt = backend.runtime
    layer = QualLayer(backend, torch.float16, CONFIG, backend.cpu_experts(), copy_sync=SyncMode.EVENT_MEMOPS)
    try:
        for graph in (False, True, True):  # eager, then two captures of the same tasks
            assert layer.check(IOPath.COPY, graph=graph)["ok"]
        sync = layer.executor(IOPath.COPY).sync
        assert isinstance(sync, EventMemopSync)
        assert rt.events_created == len(CONFIG.batch_sizes) == len(sync.events)
        assert set(sync.events.values()) == rt.live_events
    finally:
        layer.close()
    del layer, sync
    import gc

    gc.collect()
    assert rt.live_events == set()


# ---- hipEventRecordWithFlags missing ------------------------------------------------------


def test_missing_event_api_eager_takes_host_callbacks():
    backend = SimHipBackend(SimHipRuntime(event_api=False))
    caps = backend.capabilities()
    assert caps.event_memops is False and "hipEventRecordWithFlags" in caps.extra["event_memops"]["reason"]
    r = qualify(backend, torch.float16, settings(enabled=False), config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "host_callback", False)
    assert "plain memop ready write may be seen before the copied payload" in caps.extra["copy_sync_eager"]["reason"]
    assert backend.runtime.stale_reads == 0
    with pytest.raises(BackendError, match="event-ordered copy path is unavailable.*hipEventRecordWithFlags"):
        backend.gpu_sync(SyncMode.EVENT_MEMOPS)


def test_missing_event_api_with_graphs_takes_flag_kernels():
    backend = SimHipBackend(SimHipRuntime(event_api=False))
    r = qualify(backend, torch.float16, settings(), config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "flag_wait_kernel", True)
    assert backend.runtime.stale_reads == 0


def test_no_safe_copy_ordering_refuses_to_start():
    backend = SimHipBackend(SimHipRuntime(event_api=False, host_callbacks=False, mapped=False))
    with pytest.raises(BackendError, match="no safe way to order the copy path"):
        backend.gpu_sync()
    with pytest.raises(QualificationError, match="refusing to start.*no safe way to order the copy path"):
        qualify(backend, torch.float16, settings(), config=CONFIG)


# ---- memops run at capture time and absent from replay --------------------------------------


def test_memops_not_captured_natively_use_explicit_nodes():
    backend = SimHipBackend(SimHipRuntime(memops_capture="run_at_capture"))
    probe = backend.graph_memop_probe()
    assert probe["native"] is False and probe["flag_unchanged_during_capture"] is False and probe["explicit_ok"]
    r = qualify(backend, torch.float16, settings(), config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "event_memops", True)
    assert backend.gpu_sync().explicit_nodes is True


def test_trusting_native_capture_there_is_caught_by_the_graph_check():
    backend = SimHipBackend(SimHipRuntime(memops_capture="run_at_capture"))
    layer = QualLayer(backend, torch.float16, CONFIG, backend.cpu_experts(), copy_sync=SyncMode.EVENT_MEMOPS)
    try:
        ex = layer.executor(IOPath.COPY)
        ex.sync = EventMemopSync(backend.native(), explicit_nodes=False)
        assert layer.check(IOPath.COPY, graph=False)["ok"]
        with pytest.raises(CheckFailure):
            layer.check(IOPath.COPY, graph=True)
    finally:
        layer.close()


def test_no_explicit_nodes_turns_graphs_off_with_a_warning(caplog):
    backend = SimHipBackend(SimHipRuntime(memops_capture="run_at_capture", explicit_nodes=False))
    gs = settings()
    r = qualify(backend, torch.float16, gs, config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "event_memops", False)
    assert gs.enabled is False and gs.batch_sizes == [] and gs.max_batch_size == 0
    assert any("cannot be captured here: decode graphs turned off" in w for w in r.warnings)
    assert "decode graphs turned off" in caplog.text
    assert [c["mode"] for c in r.checks] == ["eager"]


# ---- KernelIO returning stale data --------------------------------------------------------------


def test_stale_kernel_io_fails_its_probe_and_bf16_takes_event_copies():
    backend = SimHipBackend(SimHipRuntime(kio_stale_above=0))
    r = qualify(backend, torch.bfloat16, settings(), config=CONFIG)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "event_memops", True)
    assert "KernelIO probe failed" in r.reason


def test_kernel_io_wrong_in_the_check_retries_with_event_copies():
    # the probe publishes 3 x 256 activations and passes; the check's 3 x 512 go stale
    config = QualifyConfig(hidden=512, intermediate=64, batch_sizes=(1, 3), eager_steps=3, replays=3)
    backend = SimHipBackend(SimHipRuntime(kio_stale_above=1024))
    assert backend.kernel_io().probe()
    r = qualify(backend, torch.bfloat16, settings(), config=config)
    assert (r.io_path, r.sync_mode, r.graphs) == ("copy", "event_memops", True)
    assert r.checks[0]["path"] == "kernel_io" and r.checks[0]["ok"] is False
    assert any("retrying with copy + event_memops" in w for w in r.warnings)


# ---- one of two tensor-parallel ranks fails the graph check -----------------------------------


class _ThreadRanks:
    """Two ranks in threads; ``all_true`` is the AND over both, seen by both."""

    def __init__(self, size: int) -> None:
        self.values = [True] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def member(self, rank: int):
        ranks = self

        class Member:
            def all_true(self, value: bool) -> bool:
                ranks.values[rank] = bool(value)
                ranks.barrier.wait()
                result = all(ranks.values)
                ranks.barrier.wait()
                return result

        return Member()


def test_one_rank_failing_the_graph_check_turns_graphs_off_on_both():
    runtimes = [SimHipRuntime(), SimHipRuntime(memops_capture="run_at_capture", explicit_nodes=False)]
    ranks = _ThreadRanks(2)
    results: list = [None, None]
    gss = [settings(), settings()]

    def run(rank: int) -> None:
        try:
            results[rank] = qualify(SimHipBackend(runtimes[rank]), torch.float16, gss[rank], ranks.member(rank),
                                    config=CONFIG)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ok, bad = results
    assert not isinstance(ok, BaseException) and not isinstance(bad, BaseException), results
    assert ok.graphs is False and bad.graphs is False
    assert all(gs.enabled is False and gs.batch_sizes == [] for gs in gss)
    assert any("another tensor-parallel rank" in w for w in ok.warnings)
    assert any("cannot be captured here" in w for w in bad.warnings)
    assert [(c["mode"], c["ok"]) for c in ok.checks] == [("eager", True), ("graph", True)]

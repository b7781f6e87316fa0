"""The copy path's sync policy on a real GPU: on NVIDIA it is unchanged (stream memops,
no release events), on AMD never a plain memop ready write; the event-ordered copy path,
explicit graph nodes and host callbacks against the oracle where the device has them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("freetoken_cpu_moe")

from freetoken.backends.contract import BackendError  # noqa: E402

from freetoken.backends.handoff_io import SyncMode  # noqa: E402

from freetoken.backends.handoff_io import IOPath
from freetoken.native_gpu import sync as native_sync  # noqa: E402
from freetoken.moe.qualify.startup import QualifyConfig  # noqa: E402
from freetoken.moe.qualify.checks import QualLayer  # noqa: E402

CONFIG = QualifyConfig(hidden=512, intermediate=256, batch_sizes=(1, 4, 16), eager_steps=6, replays=8)


def test_host_callbacks_and_probes(backend):
    assert backend.native().host_callback_probe() == ""
    caps = backend.capabilities()
    print("copy sync:", caps.extra["copy_sync_graphs"], caps.extra["copy_sync_eager"])
    assert caps.host_callbacks is True
    probe = backend.graph_memop_probe()
    print("graph memop probe:", probe)
    assert probe["native"] or probe["explicit_ok"], probe


def test_copy_sync_policy(backend):
    modes = backend.copy_sync_modes(graphs=True)
    if backend.memop_write_orders_copies:
        assert modes == [SyncMode.STREAM_MEMOPS]  # what the CUDA copy path always used
        assert backend.capabilities().event_memops is False
        assert backend.gpu_sync().mode is SyncMode.STREAM_MEMOPS
        with pytest.raises(BackendError):
            backend.gpu_sync(SyncMode.EVENT_MEMOPS)
        return
    assert SyncMode.STREAM_MEMOPS not in modes + backend.copy_sync_modes(graphs=False)
    if backend.event_support()["available"]:
        assert modes == [SyncMode.EVENT_MEMOPS]


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_event_memops_copy_path_against_oracle(backend, dtype, mode):
    if backend.memop_write_orders_copies or not backend.event_support()["available"]:
        pytest.skip(f"no release-event path here: {backend.event_support()['reason']}")
    layer = QualLayer(backend, dtype, CONFIG, backend.cpu_experts(), copy_sync=SyncMode.EVENT_MEMOPS)
    try:
        sync = layer.executor(IOPath.COPY).sync
        assert isinstance(sync, native_sync.EventMemopSync)
        rec = layer.check(IOPath.COPY, graph=mode == "graph")
        assert rec["ok"] and len(sync.events) == len(CONFIG.batch_sizes)
    finally:
        layer.close()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_explicit_nodes_against_oracle(backend, mode):
    """Explicit graph nodes (CUDA: batch-memop nodes; HIP: flag kernels) on the copy path,
    with the err word handed to the wait."""
    if not backend.graph_memop_probe().get("explicit_ok"):
        pytest.skip(f"explicit nodes unsupported: {backend.graph_memop_probe().get('explicit_error')}")
    sync_mode = SyncMode.EVENT_MEMOPS if not backend.memop_write_orders_copies else SyncMode.STREAM_MEMOPS
    if not backend.memop_write_orders_copies and not backend.event_support()["available"]:
        pytest.skip("no release-event path here")
    layer = QualLayer(backend, torch.float16, CONFIG, backend.cpu_experts(), copy_sync=sync_mode)
    try:
        ex = layer.executor(IOPath.COPY)
        ex.sync.explicit_nodes = True
        assert layer.check(IOPath.COPY, graph=mode == "graph")["ok"]
    finally:
        layer.close()

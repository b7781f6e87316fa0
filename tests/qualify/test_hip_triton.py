"""The engine's Triton choices on a simulated HIP device: torch reports a ROCm build
(``torch.version.hip``) and one GPU whose ``gcnArchName`` is a gfx target, and reading a
compute capability fails the test. On a gfx target Triton runs (CDNA2-4, RDNA3/4) the GPU
experts, fused dense ops and decode attention take Triton, the memory plan keeps GGUF
experts packed, and locked fetch starts (banks registered mapped through the simulated HIP
runtime's staging); elsewhere everything falls back to torch, and locked fetch is refused,
with a message that names the gfx target."""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from freetoken.backends import triton_target  # noqa: E402
from freetoken.backends.options import MoEOptions  # noqa: E402
from freetoken.handoff import Fmt  # noqa: E402
from freetoken.loading.tensors import RawTensor  # noqa: E402
from freetoken.models import decode_attention, dense_ops  # noqa: E402
from freetoken.kernels import availability  # noqa: E402
from freetoken.moe.session import gpu_memory_plan  # noqa: E402
from freetoken.moe.session import gpu_session  # noqa: E402
from freetoken.moe.experts.gpu_packed_experts import DequantScratch  # noqa: E402
from freetoken.models.moe_layer import ExpertWeights  # noqa: E402

from .sim_hip import SimHipBackend, SimHipRuntime  # noqa: E402

SUPPORTED = ("gfx90a:sramecc+:xnack-", "gfx942", "gfx950", "gfx1100", "gfx1151", "gfx1201")
UNSUPPORTED = ("gfx1030", "gfx1010:xnack-", "gfx908")
DEV = torch.device("cuda", 0)


def _clear_caches() -> None:
    triton_target._device_target.cache_clear()
    decode_attention._default_impl.cache_clear()
    dense_ops._triton_ops_for.cache_clear()


@pytest.fixture
def hip_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``hip_gpu(arch)``: torch is a ROCm build with one GPU of gfx target ``arch``."""

    def no_capability(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a HIP device's gfx target was read as an NVIDIA compute capability")

    def install(arch: str) -> None:
        props = types.SimpleNamespace(gcnArchName=arch, name=f"Simulated Radeon ({arch})", multi_processor_count=64)
        monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
        monkeypatch.setattr(torch.version, "cuda", None, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", no_capability)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # nothing runs on this "GPU"
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        _clear_caches()

    yield install
    _clear_caches()


def _packed_layers(device: torch.device) -> tuple[set[int], bool]:
    """The memory plan's packed layers for GGUF layers 0 (Q4_K/Q4_K/Q6_K) and 1 (F16 experts)."""
    session = types.SimpleNamespace(options=types.SimpleNamespace(moe=MoEOptions(gpu_experts="auto")), device=device)
    shape = types.SimpleNamespace(expert_formats={0: (int(Fmt.Q4_K), int(Fmt.Q4_K), int(Fmt.Q6_K)),
                                                  1: (int(Fmt.F16),) * 3})  # fmt: skip
    layers = gpu_memory_plan.GpuMemoryPlanner._packed_layers(session, shape)  # type: ignore[arg-type]
    return layers, session.packed_capable


def _gguf_layer(seed: int, experts: int = 4, hidden: int = 256, inter: int = 32) -> ExpertWeights:
    """A host layer of GGUF experts (Q4_K gate/up, Q8_0 down) as bytes (values do not matter here)."""
    rng = np.random.default_rng(seed)

    def stack(name: str, fmt: Fmt, rows: int, cols: int, per: int, nbytes: int) -> RawTensor:
        data = rng.integers(0, 256, (experts, rows, cols // per * nbytes), dtype=np.uint8)
        return RawTensor(name, (experts, rows, cols), int(fmt), data)

    return ExpertWeights(stack("gate", Fmt.Q4_K, inter, hidden, 256, 144), stack("up", Fmt.Q4_K, inter, hidden, 256, 144),
                         stack("down", Fmt.Q8_0, hidden, inter, 32, 34), num_experts=experts, hidden=hidden,
                         intermediate=inter)  # fmt: skip


def _locked_traffic(packed_ok: bool) -> Any:
    from freetoken.moe.handoff.expert_traffic import ExpertTraffic

    options = MoEOptions(locked_fetch=0.3, locked_max_fetch=2, stream_prefill="off")
    traffic = ExpertTraffic(options, DEV, torch.bfloat16, [0, 1], 8, 4, 0, packed_ok, DequantScratch(),
                            stream_planned=False)  # fmt: skip
    for layer in (0, 1):
        traffic.add_cpu_layer(layer, _gguf_layer(layer), "silu")
    return traffic


@pytest.mark.parametrize("arch", SUPPORTED)
def test_supported_gfx_target_takes_triton_everywhere(hip_gpu, arch):
    hip_gpu(arch)
    target = arch.split(":")[0]
    impl, why = availability.default_impl(DEV)
    assert impl == "triton" and target in why
    assert availability.default_impl("cuda")[0] == "triton"  # the current device
    availability.check_triton(DEV)  # an explicit impl='triton' is accepted
    assert decode_attention.default_impl(DEV) == ("triton", why)
    ops, ops_why = dense_ops._triton_ops_for(DEV)
    assert isinstance(ops, dense_ops.TritonDenseOps) and ops_why == why
    assert gpu_session._attention_impl(DEV) == "triton"
    layers, capable = _packed_layers(DEV)
    assert capable and layers == {0}  # GGUF block experts stay packed; F16 ones are dequantized


@pytest.mark.parametrize("arch", UNSUPPORTED)
def test_other_gfx_target_falls_back_to_torch_naming_it(hip_gpu, arch):
    hip_gpu(arch)
    target = arch.split(":")[0]
    impl, why = availability.default_impl(DEV)
    assert impl == "torch" and why.startswith(f"{target} (") and "torch implementations run here" in why
    with pytest.raises(ValueError, match=f"impl='triton' on cuda:0: {target} "):
        availability.check_triton(DEV)
    assert decode_attention.default_impl(DEV) == ("torch", why)
    assert dense_ops._triton_ops_for(DEV) == (None, why)
    assert gpu_session._attention_impl(DEV) == "torch"
    assert _packed_layers(DEV) == (set(), False)


def test_locked_fetch_starts_on_a_supported_gfx_target(hip_gpu):
    """--moe-locked-fetch on gfx1201: eligible (the plan's packed_ok), the banks page-locked
    and mapped through the HIP backend's Staging, each stack readable at a device address."""
    hip_gpu("gfx1201")
    runtime = SimHipRuntime(arch="gfx1201")
    traffic = _locked_traffic(packed_ok=_packed_layers(DEV)[1])
    try:
        traffic.start(None, {}, SimHipBackend(runtime).staging())
        assert traffic.locked and traffic.registration is not None and traffic.registration.mapped
        for layer in traffic.cpu_layers.values():
            for t in (layer.gate, layer.up, layer.down):
                assert traffic.registration.device_address(t.raw_torch()) != 0
    finally:
        traffic.close()


def test_locked_fetch_refused_on_rdna2_naming_the_target(hip_gpu):
    hip_gpu("gfx1030")
    traffic = _locked_traffic(packed_ok=_packed_layers(DEV)[1])
    with pytest.raises(ValueError, match=r"--moe-locked-fetch: .*a GPU where Triton runs \(here: gfx1030 \(RDNA2\)"):
        traffic.start(None, {}, SimHipBackend(SimHipRuntime(arch="gfx1030")).staging())


@pytest.mark.parametrize("arch,usable", [("gfx942", True), ("gfx1100", True), ("gfx1030", False), ("gfx1010", False)])
def test_rocm_backend_reports_its_triton_target(arch, usable):
    pytest.importorskip("freetoken_rocm")
    from freetoken_rocm.backend import RocmBackend

    class SimRocm(SimHipBackend, RocmBackend):  # the rocm backend's own methods over the simulated runtime
        pass

    caps = SimRocm(SimHipRuntime(arch=arch)).capabilities()
    assert caps.extra["triton"]["usable"] is usable and caps.extra["triton"]["target"] == arch
    assert arch in caps.extra["triton"]["reason"]
    assert "capability" not in caps.extra["device"]

"""Backend selection: the automatic rule, the explicit rule, priorities and errors."""

from __future__ import annotations

import pytest
import torch

from freetoken.backends import registry
from freetoken.backends.platform import TorchPlatform, detect_platform
from freetoken.backends.selection import BackendSelectionError, select

ROCM_BOX = TorchPlatform("2.13.0+rocm", None, "6.2.41133", gpu_count=1)
ROCM_BOX_NO_GPU = TorchPlatform("2.13.0+rocm", None, "6.2.41133", gpu_count=0)
CUDA_BOX = TorchPlatform("2.13.0+cu128", "12.8", None, gpu_count=1)
CUDA_BUILD_NO_GPU = TorchPlatform("2.13.0+cu128", "12.8", None, gpu_count=0)
CPU_BOX = TorchPlatform("2.13.0+cpu", None, None, gpu_count=0)


# ---- the automatic rule's input: what torch reports ---------------------------------


@pytest.mark.parametrize(
    "hip, cuda, visible, expected",
    [
        ("6.2.41133", None, True, "rocm"),
        ("6.2.41133", None, False, "rocm"),  # a HIP build means ROCm even before a GPU shows up
        (None, "12.8", True, "cuda"),
        (None, "12.8", False, "cpu"),  # CUDA build without a visible GPU
        (None, None, False, "cpu"),
    ],
)
def test_detect_platform_reads_torch_build_and_gpu_visibility(monkeypatch, hip, cuda, visible, expected):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if visible else 0)
    platform = detect_platform()
    assert platform.hardware == expected
    assert platform.gpu_count == (2 if visible and (hip or cuda) else 0)
    assert platform.hip_version == hip and platform.cuda_version == cuda


def test_detect_platform_keeps_a_failing_gpu_query(monkeypatch):
    def broken() -> bool:
        raise RuntimeError("driver says no")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    platform = detect_platform()
    assert platform.hardware == "cpu"
    assert "driver says no" in platform.error


# ---- automatic selection -----------------------------------------------------------------


def test_auto_rocm_build_selects_rocm(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("rocm", hardware="rocm", priority=100),
           plugin_factory.make("cuda", hardware="cuda", priority=100)]
    chosen = select(environ={}, eps=eps, platform=ROCM_BOX)
    assert chosen.name == "rocm" and chosen.rule == "auto"
    assert "HIP 6.2.41133" in chosen.reason
    assert chosen.backend.capabilities().extra == {"plugin": "rocm"}


def test_auto_cuda_build_with_gpu_selects_cuda(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("rocm", hardware="rocm"), plugin_factory.make("cuda", hardware="cuda")]
    assert select(environ={}, eps=eps, platform=CUDA_BOX).name == "cuda"


@pytest.mark.parametrize("platform", [CUDA_BUILD_NO_GPU, CPU_BOX], ids=["cuda-build-no-gpu", "cpu-build"])
def test_auto_without_gpu_selects_cpu(plugin_factory, cpu_entry_point, platform):
    eps = [cpu_entry_point, plugin_factory.make("cuda", hardware="cuda")]
    chosen = select(environ={}, eps=eps, platform=platform)
    assert chosen.name == "cpu"
    assert chosen.record.distribution == "freetoken-cpu-moe"


@pytest.mark.parametrize(
    "platform, command",
    [(ROCM_BOX, "pip install 'freetoken[rocm]'"), (CUDA_BOX, "pip install 'freetoken[cuda]'")],
    ids=["rocm", "cuda"],
)
def test_gpu_machine_without_its_plugin_names_the_install_command(plugin_factory, cpu_entry_point, platform, command):
    # The cpu backend is installed and available; it must not be picked silently.
    eps = [cpu_entry_point, plugin_factory.make("other", hardware="fakegpu")]
    with pytest.raises(BackendSelectionError) as info:
        select(environ={}, eps=eps, platform=platform)
    message = str(info.value)
    assert command in message
    assert "--backend cpu" in message and "FREETOKEN_BACKEND=cpu" in message


def test_gpu_plugin_that_fails_to_load_is_named_in_the_error(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("rocm", hardware="rocm", import_raises="libamdhip64.so.6: cannot open")]
    with pytest.raises(BackendSelectionError) as info:
        select(environ={}, eps=eps, platform=ROCM_BOX)
    assert "libamdhip64.so.6: cannot open" in str(info.value)
    assert "pip install 'freetoken[rocm]'" in str(info.value)


def test_hip_build_whose_probe_finds_no_gpu_is_an_error_not_a_cpu_run(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("rocm", hardware="rocm", available=False, reason="no HIP device visible")]
    with pytest.raises(BackendSelectionError) as info:
        select(environ={}, eps=eps, platform=ROCM_BOX_NO_GPU)
    assert "no HIP device visible" in str(info.value)
    assert "--backend cpu" in str(info.value)


# ---- priorities ---------------------------------------------------------------------


def test_priority_breaks_ties_between_plugins_for_the_same_hardware(plugin_factory):
    eps = [
        plugin_factory.make("cuda", hardware="cuda", priority=100),
        plugin_factory.make("vendorcuda", hardware="cuda", priority=150),
        plugin_factory.make("slowcuda", hardware="cuda", priority=20),
    ]
    chosen = select(environ={}, eps=eps, platform=CUDA_BOX)
    assert chosen.name == "vendorcuda"
    assert "priority 150 beats" in chosen.reason and "cuda (priority 100)" in chosen.reason


def test_equal_top_priority_is_an_error_naming_both(plugin_factory):
    eps = [plugin_factory.make("cudaa", hardware="cuda", priority=7), plugin_factory.make("cudab", hardware="cuda", priority=7),
           plugin_factory.make("cudac", hardware="cuda", priority=1)]
    with pytest.raises(BackendSelectionError) as info:
        select(environ={}, eps=eps, platform=CUDA_BOX)
    message = str(info.value)
    assert "cudaa" in message and "cudab" in message and "cudac" not in message
    assert "FREETOKEN_BACKEND=NAME" in message


def test_unavailable_top_priority_plugin_falls_back_to_the_next_one(plugin_factory):
    eps = [
        plugin_factory.make("cuda", hardware="cuda", priority=100),
        plugin_factory.make("vendorcuda", hardware="cuda", priority=150, available=False, reason="needs sm_100"),
    ]
    chosen = select(environ={}, eps=eps, platform=CUDA_BOX)
    assert chosen.name == "cuda"
    assert "skipped vendorcuda" in chosen.reason and "needs sm_100" in chosen.reason


# ---- explicit selection ------------------------------------------------------------------


def test_explicit_name_loads_only_that_plugin(plugin_factory, cpu_entry_point, tmp_path):
    # A plugin that leaves a mark when imported (then fails): it must not even be imported.
    marker = tmp_path / "bomb-imported"
    prelude = f"open({str(marker)!r}, 'w').close()"
    bomb = plugin_factory.make("bomb", hardware="cuda", prelude=prelude, import_raises="imported although not selected")
    chosen = select(flag="cpu", environ={}, eps=[bomb, cpu_entry_point], platform=CUDA_BOX)
    assert chosen.name == "cpu" and chosen.rule == "--backend"
    assert not marker.exists()
    assert [r.name for r in chosen.candidates] == ["cpu"]
    # The same plugin set under the automatic rule does import it (so the mark is real).
    with pytest.raises(BackendSelectionError, match="imported although not selected"):
        select(environ={}, eps=[bomb, cpu_entry_point], platform=CUDA_BOX)
    assert marker.exists()


def test_environment_variable_selects_and_flag_overrides_it(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("alpha", hardware="x"), plugin_factory.make("beta", hardware="y")]
    by_env = select(environ={"FREETOKEN_BACKEND": "alpha"}, eps=eps, platform=CPU_BOX)
    assert by_env.name == "alpha" and by_env.rule == "FREETOKEN_BACKEND"
    by_flag = select(flag="beta", environ={"FREETOKEN_BACKEND": "alpha"}, eps=eps, platform=CPU_BOX)
    assert by_flag.name == "beta" and by_flag.rule == "--backend"


@pytest.mark.parametrize("name, expected", [("rocm", "pip install 'freetoken[rocm]'"), ("cuda", "pip install 'freetoken[cuda]'")])
def test_explicit_missing_builtin_names_the_install_command(cpu_entry_point, name, expected):
    with pytest.raises(BackendSelectionError) as info:
        select(flag=name, environ={}, eps=[cpu_entry_point], platform=CPU_BOX)
    assert f"backend {name!r} requested by --backend is not installed" in str(info.value)
    assert expected in str(info.value)


def test_explicit_unknown_name_lists_the_installed_backends(plugin_factory, cpu_entry_point):
    eps = [cpu_entry_point, plugin_factory.make("alpha", hardware="x")]
    with pytest.raises(BackendSelectionError) as info:
        select(environ={"FREETOKEN_BACKEND": "nope"}, eps=eps, platform=CPU_BOX)
    assert "requested by FREETOKEN_BACKEND is not installed" in str(info.value)
    assert "Installed backends: alpha, cpu" in str(info.value)


def test_explicit_plugin_whose_probe_says_absent_fails_loudly(plugin_factory):
    eps = [plugin_factory.make("cuda", hardware="cuda", available=False, reason="CUDA driver too old")]
    with pytest.raises(BackendSelectionError) as info:
        select(flag="cuda", environ={}, eps=eps, platform=CUDA_BOX)
    assert "cannot be used" in str(info.value) and "CUDA driver too old" in str(info.value)


def test_explicit_plugin_whose_probe_raises_fails_loudly(plugin_factory):
    eps = [plugin_factory.make("cuda", hardware="cuda", probe_raises="cuInit returned 999")]
    with pytest.raises(BackendSelectionError, match="probe error.*cuInit returned 999"):
        select(flag="cuda", environ={}, eps=eps, platform=CUDA_BOX)


# ---- the installed set and the process-wide registry ---------------------------------------


def test_this_machine_selects_the_builtin_cpu_backend():
    if detect_platform().hardware != "cpu":
        pytest.skip("this machine has a GPU build of torch with a GPU")
    chosen = select(environ={})
    assert chosen.name == "cpu" and chosen.record.distribution == "freetoken-cpu-moe"


def test_fake_third_party_plugin_is_installed_and_selected_by_name():
    chosen = select(flag="fakegpu", environ={})
    assert chosen.name == "fakegpu"
    assert chosen.record.distribution == "freetoken-fakegpu"
    assert type(chosen.backend).__module__ == "freetoken_fakegpu.backend"


def test_registry_resolves_once_and_records_who_asked():
    assert registry.current_selection() is None
    backend = registry.get_backend("cpu")
    selection = registry.current_selection()
    assert selection is not None and selection.backend is backend
    module, function, line = selection.triggered_by.split(":")
    assert (module, function) == (__name__, "test_registry_resolves_once_and_records_who_asked")
    assert int(line) > 0
    assert registry.get_backend() is backend and registry.get_backend("cpu") is backend
    with pytest.raises(BackendSelectionError, match="already selected"):
        registry.get_backend("fakegpu")

"""``freetoken doctor``: run as the installed command, on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.backends import registry
from freetoken.cli.doctor import REPORT_KEYS
from freetoken.cli.main import main
from freetoken.cpu_isa import RELEVANT_FLAGS, parse_cpuinfo

FREETOKEN = shutil.which("freetoken", path=str(Path(sys.executable).parent)) or "freetoken"


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "FREETOKEN_BACKEND"}
    environment.update(env)
    return subprocess.run([FREETOKEN, "doctor", *args], capture_output=True, text=True, env=environment, timeout=120)


def _doctor_in_process(capsys, monkeypatch, *args: str, env: str | None = None) -> tuple[int, str]:
    """Run the doctor command in this process with a fresh backend selection."""
    if env is None:
        monkeypatch.delenv("FREETOKEN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("FREETOKEN_BACKEND", env)
    registry.reset()
    try:
        code = main(["doctor", *args])
    finally:
        registry.reset()
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def report() -> dict:
    """The installed `freetoken` command's report, run once as a user would."""
    result = _doctor("--json")
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def _plugins(report: dict) -> dict:
    return {p["name"]: p for p in report["plugins"]}


def test_report_has_every_section(report):
    assert tuple(report) == REPORT_KEYS
    assert report["freetoken"]["packages"]["freetoken-core"] == report["freetoken"]["version"]
    torch_fields = {"torch_version", "cuda_version", "hip_version", "gpu_count", "hardware", "rule", "devices"}
    assert torch_fields <= set(report["torch"])
    assert report["cpu"]["logical_cores"] >= 1
    assert set(report["cpu"]["isa"]) <= set(RELEVANT_FLAGS)


def test_every_plugin_is_listed_with_distribution_version_status_and_error(report):
    plugins = _plugins(report)
    expected = [("cpu", "freetoken-cpu-moe"), ("fakegpu", "freetoken-fakegpu")]
    # The GPU plugins are listed wherever their distributions are installed (`make test` installs both).
    expected += [(name, dist) for name, dist in [("cuda", "freetoken-cuda"), ("rocm", "freetoken-rocm")]
                 if report["freetoken"]["packages"][dist]]
    for name, dist in expected:
        assert plugins[name]["distribution"] == dist
        assert plugins[name]["version"] == report["freetoken"]["packages"].get(dist, plugins[name]["version"])
        assert set(plugins[name]) >= {"status", "error", "hardware", "priority", "probe"}
    assert plugins["cpu"]["status"] == "available" and plugins["cpu"]["error"] is None
    assert plugins["fakegpu"]["status"] == "available"


def test_gpu_plugins_on_a_machine_without_their_gpu(report):
    if report["torch"]["gpu_count"]:
        pytest.skip("this machine has a GPU")
    plugins = _plugins(report)
    for name in ("cuda", "rocm"):
        assert plugins[name]["status"] == "unavailable", plugins[name]
        assert plugins[name]["error"]  # the reason


def test_cpu_machine_selects_cpu_with_its_reason_and_capabilities(report):
    if report["torch"]["hardware"] != "cpu":
        pytest.skip("this machine has a GPU build of torch with a GPU")
    selection = report["selection"]
    assert selection["backend"] == "cpu" and selection["rule"] == "auto" and selection["error"] is None
    assert "-> cpu" in selection["reason"]
    assert selection["triggered_by"].startswith("freetoken.cli.doctor:")
    assert report["capabilities"]["stream_memops"] is False and report["capabilities"]["mapped_memory"] is False


@pytest.mark.gpu
def test_gpu_machine_selects_cuda_with_memops_and_mapped_memory(report):
    if not report["torch"]["cuda_version"]:
        pytest.skip("not a CUDA build of torch")
    assert report["selection"]["backend"] == "cuda", report["selection"]
    assert report["capabilities"]["stream_memops"] is True
    assert report["capabilities"]["mapped_memory"] is True


def test_explicit_backend_through_the_environment_and_the_flag(capsys, monkeypatch):
    code, out = _doctor_in_process(capsys, monkeypatch, "--json", env="fakegpu")
    by_env = json.loads(out)
    assert code == 0 and (by_env["selection"]["backend"], by_env["selection"]["rule"]) == ("fakegpu", "FREETOKEN_BACKEND")
    assert by_env["capabilities"]["extra"] == {"simulated": True}
    code, out = _doctor_in_process(capsys, monkeypatch, "--json", "--backend", "cpu", env="fakegpu")
    by_flag = json.loads(out)
    assert code == 0 and (by_flag["selection"]["backend"], by_flag["selection"]["rule"]) == ("cpu", "--backend")


def test_missing_backend_fails_with_the_reason_and_exit_status_1(capsys, monkeypatch):
    code, out = _doctor_in_process(capsys, monkeypatch, "--backend", "nosuchbackend")
    assert code == 1
    assert "Selected backend: NONE" in out
    assert "'nosuchbackend' requested by --backend is not installed" in out


def test_human_report_names_the_selected_backend(capsys, monkeypatch):
    code, out = _doctor_in_process(capsys, monkeypatch, "--backend", "cpu")
    assert code == 0
    assert "Selected backend: cpu (requested by --backend)" in out
    assert "Backend plugins:" in out and "fakegpu" in out


def test_parse_cpuinfo_keeps_the_relevant_flags_of_the_first_processor():
    text = "processor : 0\nmodel name : Test CPU\nflags : fpu sse4_2 avx2 avx512f amx_tile\n\n" \
           "processor : 1\nmodel name : Other\nflags : fpu\n"
    assert parse_cpuinfo(text) == ("Test CPU", ("sse4_2", "avx2", "avx512f", "amx_tile"))


def test_report_shows_the_startup_check_outcome(report):
    q = report["qualification"]
    assert q["qualified"] is True, q
    assert q["backend"] == report["selection"]["backend"]
    assert isinstance(q["graphs"], bool) and q["io_path"] and q["reason"]
    if report["selection"]["backend"] == "cpu":
        assert q["io_path"] == "synchronous" and q["graphs"] is False


def test_kernel_tier_and_its_cap_are_shown():
    """The CPU kernels' tier in use, the tiers left under FREETOKEN_CPU_MOE_ISA and the
    attention mode, in both forms of the report."""
    cm = pytest.importorskip("freetoken_cpu_moe")
    plain = _doctor("--json", FREETOKEN_CPU_MOE_ISA="")
    tiers = json.loads(plain.stdout)["cpu_moe"]["isa_tiers"]
    assert tiers[-1] == "scalar" and json.loads(plain.stdout)["cpu_moe"]["isa_cap"] is None
    cap = "avx2" if "avx2" in tiers else "scalar"
    capped = json.loads(_doctor("--json", FREETOKEN_CPU_MOE_ISA=cap).stdout)["cpu_moe"]
    assert capped["active_isa"] == cap and capped["isa_cap"] == cap
    assert capped["isa_tiers"] == tiers[tiers.index(cap):]
    assert capped["attention"] == ("torch" if cap == "scalar" else "native")
    text = _doctor(FREETOKEN_CPU_MOE_ISA=cap).stdout
    assert f"kernel tier: {cap} (capped by {cm.ISA_ENV}={cap}); tiers available: {' '.join(tiers[tiers.index(cap):])}" \
        in text

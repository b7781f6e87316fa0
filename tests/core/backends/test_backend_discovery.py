"""Plugin discovery and loading: every failure stays with its plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from freetoken._version import __version__ as CORE_VERSION
from freetoken.backends import discovery, registry
from freetoken.backends.discovery import PluginStatus
from freetoken.backends.platform import detect_platform
from freetoken.versioning import VersionMismatchError, lockstep_error, require_core_version

from plugin_distributions import backend_source


def _loaded(ep):
    return discovery.probe(discovery.record_for(ep))


def test_import_error_is_kept_on_the_plugin(plugin_factory):
    record = _loaded(plugin_factory.make("broken", import_raises="CUDA driver library missing"))
    assert record.status is PluginStatus.LOAD_ERROR
    assert record.error == "RuntimeError: CUDA driver library missing"
    assert "CUDA driver library missing" in record.error_traceback
    assert record.backend_cls is None


def test_probe_that_raises_is_kept_on_the_plugin(plugin_factory):
    record = _loaded(plugin_factory.make("flaky", probe_raises="hipInit failed"))
    assert record.status is PluginStatus.PROBE_ERROR
    assert record.error == "RuntimeError: hipInit failed"


def test_unavailable_hardware_keeps_the_reason(plugin_factory):
    record = _loaded(plugin_factory.make("absent", available=False, reason="no device"))
    assert record.status is PluginStatus.UNAVAILABLE and record.error == "no device"
    assert record.probe_result is not None and record.probe_result.available is False


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from freetoken.backends.hookspecs import hookimpl\n@hookimpl\ndef freetoken_backend():\n    return 42\n",
            "freetoken_backend() returned 42, not a Backend subclass",
        ),
        (
            "from freetoken.backends.contract import Backend\nfrom freetoken.backends.hookspecs import hookimpl\n"
            "class Half(Backend):\n    name = 'half'\n@hookimpl\ndef freetoken_backend():\n    return Half\n",
            "Half does not implement: capabilities, device, gpu_sync, open_model, probe, staging",
        ),
        ("VALUE = 1\n", "has no @hookimpl freetoken_backend()"),
        (
            "from freetoken.backends.hookspecs import hookimpl\n@hookimpl\ndef freetoken_backend_typo():\n    pass\n",
            "PluginValidationError",
        ),
    ],
    ids=["not-a-class", "abstract", "no-hook", "unknown-hook"],
)
def test_invalid_plugins_are_load_errors(plugin_factory, source, expected):
    record = _loaded(plugin_factory.make("half", source=source))
    assert record.status is PluginStatus.LOAD_ERROR
    assert expected in record.error


def test_backend_name_must_match_its_entry_point(plugin_factory):
    record = _loaded(plugin_factory.make("shown", source=backend_source("other")))
    assert record.status is PluginStatus.LOAD_ERROR
    assert "name is 'other' but its entry point is named 'shown'" in record.error


def test_backend_class_given_directly_as_entry_point(plugin_factory):
    ep = plugin_factory.make("direct", hardware="x")
    direct = plugin_factory.make("direct", source=backend_source("direct"), entry_point_value=f"{ep.module}:PluginBackend")
    record = _loaded(direct)
    assert record.status is PluginStatus.AVAILABLE and record.backend_cls.__name__ == "PluginBackend"


def test_contract_version_mismatch(plugin_factory):
    record = _loaded(plugin_factory.make("future", api_version=99))
    assert record.status is PluginStatus.VERSION_MISMATCH
    assert "contract version 99" in record.error and "speaks version 1" in record.error


def test_package_that_checks_its_core_version_at_import(plugin_factory):
    prelude = "from freetoken.versioning import require_core_version\nrequire_core_version('freetoken-cuda', '0.0.9')"
    record = _loaded(plugin_factory.make("skewed", prelude=prelude))
    assert record.status is PluginStatus.VERSION_MISMATCH
    assert f"freetoken-cuda 0.0.9 does not match freetoken-core {CORE_VERSION}" in record.error
    assert f"pip install 'freetoken[cuda]=={CORE_VERSION}'" in record.error


def test_require_core_version():
    require_core_version("freetoken-rocm", CORE_VERSION)
    with pytest.raises(VersionMismatchError, match="freetoken-rocm 9.9 does not match"):
        require_core_version("freetoken-rocm", "9.9")


def test_lockstep_applies_to_freetoken_distributions_only():
    assert lockstep_error("freetoken-cuda", CORE_VERSION) is None
    assert "freetoken_cuda 0.0.1 does not match" in lockstep_error("freetoken_cuda", "0.0.1")
    assert lockstep_error("FreeToken-ROCm", "0.0.1") is not None
    assert lockstep_error("freetoken-fakegpu", "7.0") is None  # third party: contract version only


def test_installed_skewed_freetoken_rocm_is_caught_before_import(plugin_factory, tmp_path):
    # A freetoken-rocm 0.0.1 earlier on sys.path shadows the real one, as a stale install would.
    marker = tmp_path / "rocm-imported"
    plugin_factory.make("rocm", distribution="freetoken-rocm", version="0.0.1", installed=True,
                        prelude=f"open({str(marker)!r}, 'w').close()", hardware="rocm")
    records = {r.name: r for r in registry.plugins()}
    rocm = records["rocm"]
    assert (rocm.distribution, rocm.version) == ("freetoken-rocm", "0.0.1")
    assert rocm.status is PluginStatus.VERSION_MISMATCH
    assert f"freetoken-rocm 0.0.1 does not match freetoken-core {CORE_VERSION}" in rocm.error
    assert f"pip install 'freetoken[rocm]=={CORE_VERSION}'" in rocm.error
    assert not marker.exists()  # refused on its metadata, never imported
    assert records["cpu"].status is PluginStatus.AVAILABLE  # the others are unaffected


def _run_python(code: str, extra_path: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=extra_path, **env)
    environment.pop("FREETOKEN_BACKEND", None)
    environment.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environment, timeout=120)


def test_broken_installed_plugin_breaks_neither_import_nor_selection(plugin_factory):
    plugin_factory.make("broken", hardware="cuda", installed=True, import_raises="plugin exploded on import")
    plugin_factory.make("flaky", hardware="rocm", installed=True, probe_raises="probe exploded")
    result = _run_python(
        """
        import json, sys
        import freetoken
        lazy = not any(m.startswith("ft_test_plugin") for m in sys.modules)
        from freetoken.backends import registry
        records = {r.name: [r.status.value, r.error] for r in registry.plugins()}
        backend = registry.get_backend()
        print(json.dumps({"lazy": lazy, "records": records, "selected": backend.name}))
        """,
        str(plugin_factory.modules_dir),
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["lazy"] is True
    assert out["records"]["broken"] == ["load_error", "RuntimeError: plugin exploded on import"]
    assert out["records"]["flaky"] == ["probe_error", "RuntimeError: probe exploded"]
    assert out["records"]["cpu"][0] == "available"
    assert out["selected"] == detect_platform().hardware  # cpu here, cuda on the GPU machine


def test_import_freetoken_imports_no_plugin():
    result = _run_python(
        """
        import sys, freetoken
        print(sorted(m for m in sys.modules if m.startswith(("freetoken_", "freetoken.backends"))))
        """,
        "",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

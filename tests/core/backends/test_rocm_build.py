"""freetoken-rocm compiles with hipcc for gfx1030 through its setup.py both without and
with the event API (hipEventRecordWithFlags): Debian's HIP 5.2 lacks it, so the build
with it declares the symbol through hip_stub/ (HIPCC_COMPILE_FLAGS_APPEND) and the result
must reference it, while the build without it must load here and report the event path
unavailable with the reason."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ROCM = ROOT / "freetoken-rocm"
STUB = Path(__file__).resolve().parent / "hip_stub" / "hip_event_record_with_flags.h"

pytestmark = pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc is not installed (make toolchain)")


def _build(out: Path, event_api: str, append: str = "") -> tuple[Path, str]:
    env = dict(os.environ, FREETOKEN_ROCM_ARCH="gfx1030", FREETOKEN_ROCM_EVENT_API=event_api)
    env.pop("HIPCC_COMPILE_FLAGS_APPEND", None)
    if append:
        env["HIPCC_COMPILE_FLAGS_APPEND"] = append
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"),
           "--build-temp", str(out / "tmp")]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROCM, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    built = list((out / "lib" / "freetoken_rocm").glob("_C*.so"))
    assert len(built) == 1, built
    return built[0], r.stderr


def _undefined_symbols(so: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


def test_build_without_event_api_loads_and_reports_it(tmp_path):
    so, log = _build(tmp_path, "0")
    assert "event-ordered copy path compiled out" in log and "--offload-arch=gfx1030" in log
    assert "hipEventRecordWithFlags" not in _undefined_symbols(so)
    spec = importlib.util.spec_from_file_location("freetoken_rocm._C", so)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    assert native.API == "hip" and native.EVENT_RECORD_WITH_FLAGS is False
    support = native.event_support()
    assert support["compiled"] is False and support["available"] is False
    assert "hipEventRecordWithFlags" in support["reason"]
    for name in ("release_event_create", "release_event_record", "release_event_destroy", "host_callback_probe"):
        assert callable(getattr(native, name))


def test_build_with_event_api_references_it(tmp_path):
    so, log = _build(tmp_path, "auto", append=f"-include {STUB}")
    assert "event-ordered copy path compiled in (FREETOKEN_ROCM_EVENT_API=auto)" in log
    undefined = _undefined_symbols(so)
    assert {"hipEventRecordWithFlags", "hipEventCreateWithFlags", "hipEventRecord"} <= undefined


def test_event_api_detection_agrees_with_the_headers(monkeypatch):
    """setup.py's compile probe against the installed HIP headers' own declarations."""
    hipcc = shutil.which("hipcc")
    namespace = {"__file__": str(ROCM / "setup.py"), "__name__": "freetoken_rocm_setup"}
    source = (ROCM / "setup.py").read_text().replace("\nsetup(", "\ndict(")
    exec(compile(source, "setup.py", "exec"), namespace)  # noqa: S102 - our own build script, without setup()
    include = Path(hipcc).resolve().parent.parent / "include" / "hip"
    headers = " ".join(p.read_text(errors="replace") for p in include.rglob("*.h"))
    declared = "hipEventRecordWithFlags(" in headers and "hipEventRecordExternal" in headers
    assert namespace["has_event_record_with_flags"](hipcc) == declared
    monkeypatch.setenv("FREETOKEN_ROCM_EVENT_API", "yes")
    with pytest.raises(SystemExit, match="FREETOKEN_ROCM_EVENT_API must be auto, 0 or 1"):
        namespace["event_api_define"](hipcc)

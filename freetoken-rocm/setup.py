"""Build of freetoken-rocm: the native extension freetoken_rocm._C, compiled with hipcc.

hipcc is found through ROCM_PATH (or HIP_PATH) or PATH and always run with
HIP_PLATFORM=amd (a machine that also has nvcc would otherwise compile for NVIDIA).
FREETOKEN_ROCM_ARCH lists the gfx targets ("gfx1030;gfx1100"); by default every
RDNA2/RDNA3/RDNA3.5/RDNA4/CDNA target in CANDIDATES that the found compiler can actually
build for (each checked by compiling a small kernel, not assumed).

The event-ordered copy path needs hipEventRecordWithFlags, which older HIP (5.2 among
them) lacks: the build compiles a call to it and defines FT_HIP_EVENT_RECORD_WITH_FLAGS
to 1 when that works, else to 0 (the backend then reports the path unavailable).
FREETOKEN_ROCM_EVENT_API=0 forces it off, =1 forces it on (the build fails where the
headers lack the function). Without hipcc the pure-Python package still installs and the
backend's probe reports the extension as absent. Never links libtorch; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCE = "csrc/freetoken_rocm_ext.hip"
CANDIDATES = (
    # RDNA2
    "gfx1030", "gfx1031", "gfx1032", "gfx1034", "gfx1035", "gfx1036",
    # RDNA3
    "gfx1100", "gfx1101", "gfx1102", "gfx1103",
    # RDNA3.5
    "gfx1150", "gfx1151", "gfx1152",
    # RDNA4
    "gfx1200", "gfx1201",
    # CDNA1/2/3/4
    "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950",
)  # fmt: skip
PROBE_SOURCE = """
#include <hip/hip_runtime.h>
__global__ void ft_probe(unsigned long long* p) { atomicAdd(p, 1ull); __threadfence_system(); }
"""

EVENT_API_SOURCE = """
#include <hip/hip_runtime.h>
hipError_t ft_record(hipEvent_t e, hipStream_t s) { return hipEventRecordWithFlags(e, s, hipEventRecordExternal); }
"""


def find_hipcc() -> str | None:
    for var in ("ROCM_PATH", "HIP_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "hipcc").exists():
            return str(Path(root) / "bin" / "hipcc")
    return shutil.which("hipcc")


def hip_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HIP_PLATFORM"] = "amd"
    return env


def core_include() -> str:
    """The shared headers: from the installed freetoken-core, else the sibling checkout."""
    try:
        import freetoken

        return freetoken.get_include()
    except ImportError:
        path = HERE.parent / "freetoken-core" / "src" / "freetoken" / "include"
        if not (path / "freetoken" / "gpu" / "module_bindings.cuh").is_file():
            raise SystemExit(
                "freetoken-rocm: cannot find freetoken/gpu/module_bindings.cuh; install freetoken-core first and "
                "build without build isolation (pip install --no-build-isolation ...)"
            )
        return str(path)


def supported_targets(hipcc: str) -> list[str]:
    """The CANDIDATES this compiler builds device code for (device libraries included)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.hip"
        src.write_text(PROBE_SOURCE)

        def works(arch: str) -> bool:
            cmd = [hipcc, f"--offload-arch={arch}", "--cuda-device-only", "-c", str(src), "-o", f"{tmp}/{arch}.o"]
            r = subprocess.run(cmd, env=hip_env(), capture_output=True, text=True)
            return r.returncode == 0

        with ThreadPoolExecutor(max_workers=4) as pool:
            ok = list(pool.map(works, CANDIDATES))
    return [a for a, good in zip(CANDIDATES, ok) if good]


def has_event_record_with_flags(hipcc: str) -> bool:
    """Whether the compiler's HIP declares hipEventRecordWithFlags and hipEventRecordExternal."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "event_api.hip"
        src.write_text(EVENT_API_SOURCE)
        cmd = [hipcc, "--offload-arch=gfx1030", "--cuda-host-only", "-c", str(src), "-o", f"{tmp}/event_api.o"]
        return subprocess.run(cmd, env=hip_env(), capture_output=True, text=True).returncode == 0


def event_api_define(hipcc: str) -> str:
    """-DFT_HIP_EVENT_RECORD_WITH_FLAGS=0|1 from FREETOKEN_ROCM_EVENT_API (auto|0|1)."""
    spec = os.environ.get("FREETOKEN_ROCM_EVENT_API", "auto").strip().lower() or "auto"
    if spec not in ("auto", "0", "1"):
        raise SystemExit(f"FREETOKEN_ROCM_EVENT_API must be auto, 0 or 1, not {spec!r}")
    on = has_event_record_with_flags(hipcc) if spec == "auto" else spec == "1"
    print(f"freetoken-rocm: event-ordered copy path {'compiled in' if on else 'compiled out'} "
          f"(FREETOKEN_ROCM_EVENT_API={spec})", file=sys.stderr)  # fmt: skip
    return f"-DFT_HIP_EVENT_RECORD_WITH_FLAGS={1 if on else 0}"


class HipccBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        hipcc = find_hipcc()
        if hipcc is None:
            self.warn("hipcc not found (set ROCM_PATH or put hipcc on PATH): freetoken_rocm._C is not built")
            return
        spec = os.environ.get("FREETOKEN_ROCM_ARCH", "").strip()
        if spec:
            targets = [t for t in (s.strip() for s in spec.replace(",", ";").split(";")) if t]
        else:
            targets = supported_targets(hipcc)
            print(f"freetoken-rocm: compiler supports {targets} of {list(CANDIDATES)}", file=sys.stderr)
            if not targets:
                raise SystemExit(f"{hipcc} cannot build for any of {CANDIDATES}; set FREETOKEN_ROCM_ARCH")
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            hipcc, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-DFT_GPU_HIP=1",
            event_api_define(hipcc),
            *[f"--offload-arch={t}" for t in targets],
            "-I" + core_include(), "-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
            str(HERE / SOURCE), "-o", str(out),
        ]  # fmt: skip
        print(" ".join(cmd), file=sys.stderr)
        # hipcc leaves an empty <source>-XXXXXX folder in TMPDIR after each build: give it one
        # that goes away
        with tempfile.TemporaryDirectory(prefix="freetoken-rocm-build-") as tmp:
            subprocess.run(cmd, check=True, cwd=HERE, env={**hip_env(), "TMPDIR": tmp})


setup(
    ext_modules=[Extension("freetoken_rocm._C", sources=[SOURCE])],
    cmdclass={"build_ext": HipccBuildExt},
)

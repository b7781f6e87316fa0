"""Build of freetoken-cuda: the native extension freetoken_cuda._C, compiled with nvcc.

nvcc is found through CUDA_HOME (or CUDA_PATH) or PATH. FREETOKEN_CUDA_ARCH lists the
targets (e.g. "80;90" or "90+PTX"; "+PTX" also embeds PTX for that target so newer
GPUs can JIT it). Without nvcc the pure-Python package still installs and the backend's
probe reports the extension as absent. The extension links the CUDA runtime statically
and never links libtorch; the driver is resolved at run time. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCE = "csrc/freetoken_cuda_ext.cu"
#: Consumer and data-centre GPUs from Turing to Blackwell; PTX of sm_90 for anything newer.
DEFAULT_ARCH = "75;80;86;89;90+PTX;120"


def find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def core_include() -> str:
    """The shared headers: from the installed freetoken-core, else the sibling checkout."""
    try:
        import freetoken

        return freetoken.get_include()
    except ImportError:
        path = HERE.parent / "freetoken-core" / "src" / "freetoken" / "include"
        if not (path / "freetoken" / "gpu" / "module_bindings.cuh").is_file():
            raise SystemExit(
                "freetoken-cuda: cannot find freetoken/gpu/module_bindings.cuh; install freetoken-core first and "
                "build without build isolation (pip install --no-build-isolation ...)"
            )
        return str(path)


def gencode_flags(spec: str) -> list[str]:
    flags: list[str] = []
    for item in filter(None, (s.strip() for s in spec.replace(",", ";").split(";"))):
        ptx = item.endswith("+PTX")
        num = item.removesuffix("+PTX").removeprefix("sm_").replace(".", "")
        if not num.isdigit():
            raise SystemExit(f"FREETOKEN_CUDA_ARCH: bad target {item!r} (use e.g. '80;90+PTX')")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    if not flags:
        raise SystemExit("FREETOKEN_CUDA_ARCH is empty")
    return flags


class NvccBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        nvcc = find_nvcc()
        if nvcc is None:
            self.warn("nvcc not found (set CUDA_HOME or put nvcc on PATH): freetoken_cuda._C is not built")
            return
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            nvcc, "-O3", "-std=c++17", "-shared", "-cudart", "static", "-t0", "-lineinfo",
            "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Wno-deprecated-gpu-targets",
            "-I" + core_include(), "-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
            *gencode_flags(os.environ.get("FREETOKEN_CUDA_ARCH", DEFAULT_ARCH)),
            str(HERE / SOURCE), "-o", str(out),
        ]  # fmt: skip
        print(" ".join(cmd), file=sys.stderr)
        if subprocess.run(cmd, cwd=HERE).returncode != 0:
            # nvcc 13 compiling the targets in parallel (-t0) once failed to read its own
            # temporary file ("nvlink fatal: Could not read file ..._dlink.reg.c"); a second
            # try compiles them one after the other (a real compile error fails again)
            print("nvcc failed; once more with the targets compiled one at a time (-t1)", file=sys.stderr)
            subprocess.run(["-t1" if a == "-t0" else a for a in cmd], check=True, cwd=HERE)


setup(
    ext_modules=[Extension("freetoken_cuda._C", sources=[SOURCE])],
    cmdclass={"build_ext": NvccBuildExt},
)

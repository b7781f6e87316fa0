"""Build of freetoken_cpu_moe._core (C++17, pybind11).

The distributable build never uses -march=native: each ISA tier is its own
translation unit (csrc/isa_<tier>.cpp) compiled with that tier's flags, and the
tier is picked at run time from the CPU's features (csrc/dispatch.cpp).

The headers (csrc/*.h, csrc/*.inc) are the extension's ``depends``: setuptools
then ships them in the sdist, and rebuilds the extension when any of them (or
freetoken-core's shared headers) changes. Translation units compile in parallel
(one job per core; ``FREETOKEN_BUILD_JOBS`` sets the number).
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def freetoken_include() -> str:
    """handoff.h: from the installed freetoken-core, else the sibling checkout."""
    try:
        import freetoken

        return freetoken.get_include()
    except ImportError:
        path = os.path.join(HERE, "..", "freetoken-core", "src", "freetoken", "include")
        if not os.path.isfile(os.path.join(path, "freetoken", "handoff.h")):
            sys.exit(
                "freetoken-cpu-moe: cannot find freetoken/handoff.h; install freetoken-core first and build "
                "without build isolation (pip install --no-build-isolation ...)"
            )
        return path


ISA_FLAGS = {
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "isa_avx_vnni.cpp": ["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavxvnni"],
    "attention_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "attention_avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                             "-Wno-uninitialized", "-Wno-maybe-uninitialized"],
    "isa_avx512.cpp": [
        "-mavx2", "-mfma", "-mf16c", "-mbmi2",
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
        "-Wno-uninitialized", "-Wno-maybe-uninitialized",  # false positives in gcc 12 intrinsic headers
    ],
    "isa_amx.cpp": [
        "-mavx2", "-mfma", "-mf16c", "-mbmi2",
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16",
        "-mamx-tile", "-mamx-int8", "-mamx-bf16",
        "-Wno-uninitialized", "-Wno-maybe-uninitialized",
    ],
}


class IsaBuildExt(build_ext):
    """Adds per-file ISA flags to the tier translation units."""

    def build_extensions(self) -> None:
        compiler = self.compiler
        original = compiler._compile

        def _compile(obj: str, src: str, ext: str, cc_args: Any, extra_postargs: Any, pp_opts: Any) -> None:
            extra = list(extra_postargs) + ISA_FLAGS.get(os.path.basename(src), [])
            original(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = _compile  # type: ignore[method-assign]
        super().build_extensions()


SOURCES = [
    "aligned_buffer.cpp", "bindings.cpp", "coordinator.cpp", "dispatch.cpp", "host_driver.cpp", "moe.cpp", "pool.cpp", "stream.cpp",
    "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx_vnni.cpp", "isa_avx512.cpp", "isa_amx.cpp",
    "attention.cpp", "attention_scalar.cpp", "attention_avx2.cpp", "attention_avx512.cpp",
    "bindings_attention.cpp", "decode_ops.cpp", "deltanet.cpp", "linear_group.cpp", "linear_heads.cpp",
    "decode_step.cpp", "bindings_decode_step.cpp",
]

CORE_INCLUDE = freetoken_include()
# Relative paths (inside this project) go into the sdist; all of them decide rebuilds.
HEADERS = sorted(
    os.path.relpath(h, HERE) for pattern in ("*.h", "*.inc") for h in glob.glob(os.path.join(HERE, "csrc", pattern))
)
CORE_HEADERS = sorted(glob.glob(os.path.join(CORE_INCLUDE, "freetoken", "*.h")))

ext = Pybind11Extension(
    "freetoken_cpu_moe._core",
    [os.path.join("csrc", s) for s in SOURCES],
    include_dirs=[CORE_INCLUDE, os.path.join(HERE, "csrc")],
    depends=HEADERS + CORE_HEADERS,
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-Wall", "-Wno-unused-function"],
    extra_link_args=["-pthread"],
)

ParallelCompile("FREETOKEN_BUILD_JOBS").install()
setup(ext_modules=[ext], cmdclass={"build_ext": IsaBuildExt})

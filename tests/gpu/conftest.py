"""Fixtures of the GPU tests (run on the H200 machine; skipped without a GPU).

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, i.e. when :mod:`freetoken.kernels.moe_experts`
is imported (by the tests, after this file), so it is set here, first, for the whole
session, together with the interpreter's bfloat16 ``tl.dot`` fix below (and a cut of its
per-call cost: the language patched once per launch, not again at every helper call).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

# the engine tests' helpers (tests/engine/helpers.py) serve these tests too, also when they run alone
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))


def _widen_bf16_dots_in_interpreter() -> None:
    """Triton 3.6's interpreter holds bfloat16 values as their raw uint16 bits and its
    ``tl.dot`` multiplies those bits as integers. Widen bfloat16 operands to float32
    before the product instead (exact: a bf16 x bf16 product is exact in float32, and the
    kernels accumulate in float32), which is what the GPU's bf16 MMAs compute."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot
    if getattr(create_dot, "widens_bf16", False):
        return

    def widen(t: Any) -> Any:
        if t.dtype == tl.bfloat16 and t.data.dtype == np.uint16:
            # a bfloat16 is the top half of the float32 of the same value
            data = (t.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return t

    def create_dot_widening_bf16(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        return create_dot(self, widen(a), widen(b), d, *args)

    create_dot_widening_bf16.widens_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot_widening_bf16


def _patch_language_once_per_launch() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` for a launch (every builtin of
    the language modules the kernel's module sees, of ``tl.tensor`` and ``tl.math``, wrapped
    anew, found with ``inspect.getmembers``) and restores it after the launch; it patches
    again, the same way, at every call of a ``@triton.jit`` helper inside the kernel, and
    never undoes those: a fifth of the interpreter's time in these tests. A helper whose
    module sees only language modules already patched in the running launch (by the launch
    itself or by an earlier helper) is called with those patches in place; one that sees
    others is patched as before. The same wrappers run either way."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patch = interpreter._patch_lang
    if getattr(patch, "once_per_launch", False):
        return
    local = threading.local()  # .launches: per running launch [language modules patched in it, patched yet]

    def languages(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn: Any) -> Any:
        launches = getattr(local, "launches", None)
        if launches and launches[-1][1] and languages(fn) <= launches[-1][0]:
            return interpreter._LangPatchScope()  # a helper: the launch's patches are in place
        scope = patch(fn)
        if launches:  # the launch's own patches (its first call here), or a helper's
            launches[-1][:] = [launches[-1][0] | languages(fn), True]
        return scope

    run = interpreter.GridExecutor.__call__

    def run_patching_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(local, "launches"):
            local.launches = []
        local.launches.append([frozenset(), False])
        try:
            return run(self, *args, **kwargs)
        finally:
            local.launches.pop()

    patch_lang.once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_patching_once


def _interpret_triton_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
    except ImportError:
        return
    if triton.knobs.runtime.interpret:
        from triton.runtime.interpreter import InterpretedFunction

        import triton.language as tl

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET was set (a module collected before tests/gpu imported "
                "it, e.g. through torch.nn.attention.bias): its own helpers are compiled-mode functions, and every "
                "interpreted kernel calling them fails with \"Cannot call @triton.jit'd outside of the scope of a "
                "kernel\". Import triton lazily in that module."
            )
        _widen_bf16_dots_in_interpreter()
        _patch_language_once_per_launch()


_interpret_triton_without_gpu()


def gpu_backend_class():
    import torch

    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        from freetoken_rocm.backend import RocmBackend

        return RocmBackend
    from freetoken_cuda.backend import CudaBackend

    return CudaBackend


@pytest.fixture(scope="session")
def backend():
    cls = gpu_backend_class()
    if cls is None:
        pytest.skip("no GPU visible")
    probe = cls.probe()
    assert probe.available, probe.reason
    return cls()

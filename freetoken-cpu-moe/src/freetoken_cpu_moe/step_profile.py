"""Where a CPU model step's time goes: a timing harness for the benchmarks.

:class:`StepProfiler` wraps the parts of a loaded engine's model (the embedding, each
layer's fused q/k/v and output projections (a hybrid model's gated-attention and
DeltaNet projections among them, multi-head latent attention's projections and
up-projections), paged attention, dense MLP layers and shared experts, router, routed
experts, the output head) and the session's ``forward`` with wall-clock timers, and splits
prefill and decode steps apart. A part is put in place as a :class:`TimedPart`: calls to it
and to its fused entry points (:data:`TIMED_METHODS`: a fused projection's
``add_norm_call``, which includes the residual add and the input RMSNorm before the
projections) count as that part's time, and everything else the models read from it
passes through. What the wrapped parts do not cover is ``other``: the other norms, rope,
the KV cache write, and Python between the calls. ``pool sync`` is an
estimate: the calls into the worker pool per step times the cost of one call that
computes almost nothing (waking the workers, handing out items, the join), measured
on the same pool (:func:`pool_call_us`), back to back and after an idle gap.

A decode step the session runs as one native call (:mod:`freetoken_cpu_moe.decode_step`)
times its parts with its own clock (turned on while the profiler is active); its ``other``
is the native norms, RoPE + KV write and top-k plus the Python around the call.

Used by ``freetoken bench decode --cpu-profile``; nothing here runs in serving.
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

#: parts in report order; "other" is the step's time outside them. For multi-head latent
#: attention (freetoken.models.mla) "qkv" is the query and latent projections, "kv_b" the
#: up-projections (decode: the absorbed products per head; prompts: the expansion of the
#: context to per-head keys and values) and "attention" the attention over the cache; "mlp"
#: is the dense MLP layers and shared experts
PARTS = ("embed", "qkv", "kv_b", "attention", "o_proj", "mlp", "router", "experts", "lm_head")
#: parts that call into the worker pool once per call (attention: when it runs natively)
POOL_PARTS = ("qkv", "kv_b", "attention", "o_proj", "mlp", "router", "experts", "lm_head")
#: attributes of a multi-head latent attention block (freetoken.models.mla.MlaAttention) and
#: their parts; the attention functions of its module count as "attention"
MLA_PARTS = (("proj_a", "qkv"), ("q_b", "qkv"), ("uk", "kv_b"), ("uv", "kv_b"), ("expand", "kv_b"),
             ("o", "o_proj"))
MLA_ATTENTION = ("absorbed_attention", "expanded_attention")
#: a wrapped part's methods that are timed as calls of the part: the models' fused entry into a
#: projection (freetoken.models.layers.FusedLinears.add_norm_call: residual add, RMSNorm, q/k/v)
TIMED_METHODS = ("add_norm_call",)


@dataclass
class Split:
    """Summed wall time (seconds) and calls of each part over the steps of one kind."""

    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0
    part_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))


def pool_call_us(pool: Any, repeats: int = 200, gap_us: float = 0.0) -> float:
    """Median microseconds of one pool call that computes almost nothing (two items of 16 x 64
    F32 rows per worker, one token, straight to the native call): the wake-up, hand-out and
    join cost every pooled call pays. ``gap_us``: the calling thread first computes alone for that long (as
    it does between a decode step's pooled calls: norms, attention, Python), so the workers
    have been spinning, or have gone to sleep, when the call comes."""
    import torch

    from freetoken_cpu_moe import _core
    from freetoken_cpu_moe.weights import Weights

    rng = np.random.default_rng(0)
    rows = 32 * pool.num_threads  # linear_forward's T=1 split: 16-row items, all workers woken
    w = Weights(rng.standard_normal((rows, 64)).astype(np.float32), "f32", 1, rows, 64)
    x = torch.from_numpy(rng.standard_normal((1, 64)).astype(np.float32))
    out = torch.empty((1, rows), dtype=torch.float32)
    core, addr = pool._core, w.address
    times = []
    for _ in range(repeats):
        if gap_us > 0:
            until = time.perf_counter() + gap_us * 1e-6
            while time.perf_counter() < until:
                pass
        t0 = time.perf_counter()
        _core.linear(addr, x.data_ptr(), 0, 1, out.data_ptr(), 0, False, core, "")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class TimedPart:
    """A part of the model (a projection, the embedding, a bound method, a module's function)
    with a timer around it: a call of it, or of one of its :data:`TIMED_METHODS`, adds its wall
    time and one call to ``part`` of the profiler's current split; every other attribute is
    read from, written to and deleted on the wrapped object (a fused projection's ``groups``, a
    linear's ``nbytes``, an embedding's ``table``). The wrapped object is ``__wrapped__``.
    Type checks see the wrapper, as they see any replaced part."""

    __slots__ = ("__wrapped__", "_profiler", "_part")

    def __init__(self, wrapped: Any, profiler: "StepProfiler", part: str) -> None:
        object.__setattr__(self, "__wrapped__", wrapped)
        object.__setattr__(self, "_profiler", profiler)
        object.__setattr__(self, "_part", part)

    def __call__(self, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.__wrapped__(*a, **k)
        finally:
            self._profiler._add(self._part, t0)

    def __getattr__(self, name: str) -> Any:
        if name in TimedPart.__slots__:  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        attr = getattr(self.__wrapped__, name)
        if name in TIMED_METHODS:
            return self._profiler._timed(self._part, attr)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__wrapped__, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<TimedPart {self._part}: {self.__wrapped__!r}>"


class StepProfiler:
    """Timers around the parts of ``eng.model`` and ``eng.session.forward`` (a context
    manager: on exit the very objects that were there are put back, so a check of the
    parts' identity afterwards, as :meth:`freetoken_cpu_moe.decode_step.NativeDecode.intact`
    makes, sees the parts it was built from)."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.splits = {"prefill": Split(), "decode": Split()}
        self._kind = "decode"
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------- wrapping
    def _add(self, part: str, t0: float) -> None:
        """One call of ``part`` that began at ``t0`` (``time.perf_counter``), ending now."""
        s = self.splits[self._kind]
        s.part_s[part] += time.perf_counter() - t0
        s.calls[part] += 1

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._add(part, t0)
        return wrapper

    def _replace(self, obj: Any, name: str, new: Any) -> None:
        """Put ``new`` in place of ``obj.<name>``; the undo puts back exactly what was there:
        the same object in the instance's (or module's) own attribute or slot, or, for a
        method that came from the class, no instance attribute at all."""
        orig = getattr(obj, name)
        own = (name in getattr(obj, "__dict__", {})
               or isinstance(getattr(type(obj), name, None), types.MemberDescriptorType))  # a slot
        setattr(obj, name, new)
        if own:
            self._undo.append(lambda: setattr(obj, name, orig))
        else:
            self._undo.append(lambda: delattr(obj, name))

    def _wrap_attr(self, obj: Any, name: str, part: str) -> None:
        """``obj.<name>`` (when there is one) as a :class:`TimedPart` of ``part``."""
        if obj is None or getattr(obj, name, None) is None:
            return
        self._replace(obj, name, TimedPart(getattr(obj, name), self, part))

    def _step(self, fn: Callable[..., Any], native: Any) -> Callable[..., Any]:
        def forward(input_ids: Any, positions: Any, meta: Any) -> Any:
            self._kind = "decode" if getattr(meta, "decode", False) else "prefill"
            before = native.part_seconds() if native is not None else None
            t0 = time.perf_counter()
            try:
                return fn(input_ids, positions, meta)
            finally:
                s = self.splits[self._kind]
                s.step_s += time.perf_counter() - t0
                s.steps += 1
                s.tokens += int(input_ids.shape[0])
                if before is not None:
                    self._add_native(s, before, native)
        return forward

    @staticmethod
    def _add_native(s: Split, before: dict[str, float], native: Any) -> None:
        """A step the native decode ran (freetoken_cpu_moe.decode_step): its parts' time, from
        its own clock; one call of each part per layer."""
        after = native.part_seconds()
        if after["experts"] == before["experts"]:
            return  # the step took the per-op path
        for part, t in after.items():
            if part in s.part_s:
                s.part_s[part] += t - before[part]
                s.calls[part] += native.num_layers

    def __enter__(self) -> "StepProfiler":
        model, session = self.eng.model, self.eng.session
        self._wrap_attr(model, "embed", "embed")
        self._wrap_attr(model, "compute_logits", "lm_head")
        for L in getattr(model, "layers", []):
            self._wrap_attr(L, "qkv", "qkv")
            self._wrap_attr(L, "o", "o_proj")
            # hybrid layers (freetoken.models.qwen_hybrid): gated attention's fused q/k/v/gate,
            # and a Gated DeltaNet layer's input and output projections, count as qkv / o_proj
            self._wrap_attr(L, "qkvg", "qkv")
            deltanet = getattr(L, "linear", None)
            if deltanet is not None:
                self._wrap_attr(deltanet, "proj", "qkv")
                self._wrap_attr(deltanet, "out", "o_proj")
            mla = getattr(L, "attn", None)
            if mla is not None and hasattr(mla, "absorbed"):
                for name, part in MLA_PARTS:
                    self._wrap_attr(mla, name, part)
                module = sys.modules.get(type(mla).__module__)
                for name in MLA_ATTENTION:
                    if module is not None and getattr(module, name, None) is not None:
                        if not isinstance(getattr(module, name), TimedPart):  # once for all layers
                            self._wrap_attr(module, name, "attention")
            self._wrap_attr(L, "mlp", "mlp")
            moe = getattr(L, "moe", None)
            if moe is not None:
                self._wrap_attr(moe, "router", "router")
                self._wrap_attr(moe, "run_experts", "experts")
                self._wrap_attr(moe, "shared", "mlp")
        # the attention the model's forward calls, in the module of its class or of a base
        # class (a family's model class may inherit its forward: qwen_hybrid)
        modules = {sys.modules.get(cls.__module__) for cls in type(model).__mro__}
        for module in modules:
            self._wrap_attr(module, "paged_attention", "attention")
        # a decode step that runs as one native call times its parts itself
        native = getattr(session, "native_decode", None)
        if native is not None:
            native.set_profile(True)
            self._undo.append(lambda: native.set_profile(False))
        # greedy picks in the head's pool call (freetoken_cpu_moe.greedy_head) are the head's time
        head = getattr(session, "greedy_head", None)
        if head is not None:
            self._wrap_attr(session, "greedy_tokens", "lm_head")
            head.set_profile(True)
            self._undo.append(lambda: head.set_profile(False))
        self._replace(session, "forward", self._step(session.forward, native))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------- report
    def report(self, layers: int, call_us: Optional[float] = None, gap_call_us: Optional[float] = None) -> str:
        """One table per kind of step: ms per step and per layer for each part (``gap_call_us``:
        the pool call after an idle gap, :func:`pool_call_us`)."""
        lines = []
        for kind, s in self.splits.items():
            if not s.steps:
                continue
            n = s.steps
            per_step = {p: s.part_s[p] / n * 1e3 for p in PARTS}
            logits_ms = per_step["lm_head"]  # outside session.forward: added to the step
            step_ms = s.step_s / n * 1e3 + logits_ms
            other = step_ms - sum(per_step.values())
            lines.append(f"{kind}: {n} steps, {s.tokens / n:.0f} tokens/step, {step_ms:.2f} ms/step "
                         f"({s.tokens / (s.step_s + s.part_s['lm_head']):.1f} tok/s)")
            lines.append(f"  {'part':<10} {'ms/step':>9} {'ms/layer':>9} {'share':>6} {'calls/step':>10}")
            for p in PARTS:
                lines.append(f"  {p:<10} {per_step[p]:9.3f} {per_step[p] / max(layers, 1):9.3f} "
                             f"{per_step[p] / step_ms:6.1%} {s.calls[p] / n:10.1f}")
            lines.append(f"  {'other':<10} {other:9.3f} {other / max(layers, 1):9.3f} {other / step_ms:6.1%}"
                         "            (norms, rope, KV write, Python)")
            if call_us is not None:
                pooled = sum(s.calls[p] for p in POOL_PARTS) / n
                sync = pooled * call_us / 1e3
                lines.append(f"  pool sync ~{sync:.3f} ms/step ({pooled:.0f} pooled calls x {call_us:.1f} us, "
                             f"inside the parts above; {sync / step_ms:.1%})"
                             + ("" if gap_call_us is None else f"; {gap_call_us:.1f} us after a 300 us idle gap"))
        return "\n".join(lines)

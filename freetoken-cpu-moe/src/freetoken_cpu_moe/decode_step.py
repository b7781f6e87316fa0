"""A whole decode step of a Qwen3-MoE model in one native call (``csrc/decode_step.cpp``).

The CPU backend's per-op path runs a decode step as ~10 native calls per layer with Python
and torch between them (output allocations, argument checks, views), and a decode step pays
that glue with cold caches: every call follows a weight stream that has flushed the caller's
L2 and much of L3, so the interpreter's and torch's code and data come back from memory
(on the 2-core VM, ~100 us per layer of glue around ~5 us of norm/RoPE/top-k arithmetic).
:class:`NativeDecode` hands the step to one native call that makes the same native calls in
the same order on the same values -- residual add + RMSNorm, fused q/k/v (``linear_group``),
q/k RMSNorm + RoPE + K/V write, paged attention, o, residual add + RMSNorm, the float32
router, top-k, the experts; the final norm -- so the result is bit-identical to the per-op
path. The output head stays in Python, and so does the embedding lookup of steps of
several tokens (a one-token step's row is read in place: ``NativeDecode._one_row``).

It takes models of :class:`freetoken.models.qwen3_moe.Qwen3MoeModel` whose every layer is
a MoE layer with packed projections (:class:`freetoken_cpu_moe.dense.GroupLinear` q/k/v),
the CPU backend's experts and dense ops, and the native attention; :meth:`NativeDecode.build`
says why it declines anything else, and the session then keeps the per-op path.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from freetoken.handoff import Fmt
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.dense import ACT_FMT, DualLinear, GroupLinear, PackedLinear, kernel_desc
from freetoken_cpu_moe.pool import Pool

#: parts of a profiled step, in the order of ``DecodeStep.part_ns`` (csrc/decode_step.h);
#: names as :mod:`freetoken_cpu_moe.step_profile` reports them, ``other`` last
PROFILE_PARTS = ("qkv", "attention", "o_proj", "router", "experts", "other")


def _vector(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n


class NativeDecode:
    """One step's call (:meth:`__call__`) over a model's layers, built by :meth:`build`."""

    def __init__(self, step: Any, model: Any, pool: Pool, max_tokens: int, keep: list[Any]) -> None:
        self._step = step
        self._model = model
        self._forward = type(model).forward
        # the parts the native step stands in for, as they were at build time (see intact())
        self._parts = [(L, L.qkv, L.o, L.moe, L.moe.router, L.moe._experts_fn, len(L.moe.__dict__))
                       for L in model.layers]
        self._check = True
        self._pool = pool._core
        self.max_tokens = max_tokens
        self._hidden = model.config.hidden_size
        self._dtype = model.dtype
        self._keep = keep  # tensors whose addresses the native step holds
        self._tables = np.zeros(64, dtype=np.int32)  # q_start, q_len, ctx_len, block table rows
        self._tables_addr = self._tables.ctypes.data
        self._outs: dict[int, torch.Tensor] = {}  # the output buffer per number of tokens
        # the embedding as built: a one-token step reads its row in place (_one_row)
        from freetoken.models.layers import Embedding

        self._embed = model.embed if isinstance(model.embed, Embedding) else None
        table = getattr(self._embed, "table", None)
        self._table = table if (isinstance(table, torch.Tensor) and table.is_contiguous() and table.dim() == 2
                                and table.dtype == model.dtype and table.shape[1] == self._hidden) else None

    @classmethod
    def build(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops: Any, attention_mode: str,
              pool: Pool) -> tuple[Optional["NativeDecode"], str]:  # fmt: skip
        """The native step for ``model``, or None and why the per-op path stays."""
        from freetoken.models.qwen3_moe import Qwen3MoeModel

        if type(model) is not Qwen3MoeModel:
            return None, f"{type(model).__name__} is not a Qwen3-MoE model"
        if attention_mode not in ("native", "decode"):
            return None, f"decode attention runs through torch (attention mode {attention_mode!r})"
        if getattr(model, "ops", None) is not ops:
            return None, f"the model's dense ops are {getattr(model.ops, 'name', '?')!r}, not the session's native ops"
        c = model.config
        fmt = ACT_FMT.get(model.dtype)
        if fmt is None:
            return None, f"activations in {model.dtype}"
        H, Hq, Hkv, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        norm_dtype = model.norm.dtype
        norm_fmt = ACT_FMT.get(norm_dtype)
        rot = model.rotary
        if norm_fmt is None or not _vector(model.norm, H):
            return None, "the final norm's weight is not a contiguous activation-dtype vector"
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 2 and t.shape[1] == D
                   for t in (rot.cos, rot.sin_signed)):
            return None, "the rotary tables are not float32 [positions, head_dim]"
        if len(kv_caches) != len(model.layers) or not model.layers:
            return None, "the KV cache does not have one (K, V) pair per layer"
        kv_dtype = kv_caches[0][0].dtype
        kv_fmt = ACT_FMT.get(kv_dtype)
        nb, bs = kv_caches[0][0].shape[:2]
        if kv_fmt is None:
            return None, f"KV cache in {kv_dtype}"
        max_tokens = 1 << 30
        layers: list[tuple[Any, ...]] = []
        keep: list[Any] = [model.norm, rot.cos, rot.sin_signed]
        E = K = 0
        norm_topk = False
        for i, (L, (kc, vc)) in enumerate(zip(model.layers, kv_caches)):
            moe = L.moe
            if moe is None:
                return None, f"layer {i} has a dense MLP"
            if moe.ops is not ops:
                return None, f"layer {i}'s router top-k is not the session's native op"
            for t in (kc, vc):
                if (t.dtype != kv_dtype or not t.is_contiguous() or tuple(t.shape) != (nb, bs, Hkv, D)
                        or t.device.type != "cpu"):
                    return None, f"layer {i}'s KV cache is not a contiguous [{nb}, {bs}, {Hkv}, {D}] {kv_dtype} tensor"
            if not all(_vector(t, n) and t.dtype == norm_dtype
                       for t, n in ((L.in_norm, H), (L.post_norm, H), (L.q_norm, D), (L.k_norm, D))):
                return None, f"layer {i}'s norm weights are not contiguous {norm_dtype} vectors"
            groups = L.qkv.groups
            if len(groups) != 1 or not isinstance(groups[0][0], GroupLinear):
                return None, f"layer {i}'s q/k/v are not one grouped packed projection"
            group, sizes = groups[0]
            if list(sizes) != [Hq * D, Hkv * D, Hkv * D]:
                return None, f"layer {i}'s q/k/v rows {list(sizes)} do not match {Hq}/{Hkv} heads of {D}"
            max_tokens = min(max_tokens, group.max_group_tokens)
            for part in group.parts:
                if isinstance(part, DualLinear):
                    max_tokens = min(max_tokens, part.max_kernel_rows)
            o_addr, o_max = kernel_desc(L.o)
            if o_addr is None:
                return None, f"layer {i}'s o projection is not a packed projection"
            max_tokens = min(max_tokens, o_max)
            router = moe.router
            if not isinstance(router, PackedLinear) or router._out_dtype != torch.float32 or router.fmt != Fmt.F32:
                return None, f"layer {i}'s router is not the CPU policy's float32 projection"
            bank = getattr(moe._experts_fn, "bank", None)
            if bank is None:
                return None, f"layer {i}'s experts are not the CPU backend's expert bank"
            if i == 0:
                E, K, norm_topk = router.out_features, moe.top_k, bool(moe.norm_topk_prob)
            elif (router.out_features, moe.top_k, bool(moe.norm_topk_prob)) != (E, K, norm_topk):
                return None, f"layer {i}'s routing differs from layer 0's"
            keep += [L.in_norm, L.post_norm, L.q_norm, L.k_norm, kc, vc, group, L.o, router, bank]
            layers.append((L.in_norm.data_ptr(), L.post_norm.data_ptr(), [int(a) for a in group._descs],
                           [int(col) for col in group._cols], L.q_norm.data_ptr(), L.k_norm.data_ptr(), o_addr,
                           router._address, bank.address, kc.data_ptr(), vc.data_ptr()))
        try:
            step = _core.DecodeStep(
                fmt=fmt, norm_fmt=norm_fmt, kv_fmt=kv_fmt, H=H, Hq=Hq, Hkv=Hkv, D=D, E=E, K=K, norm_topk=norm_topk,
                eps=float(c.rms_norm_eps), scale=float(model.scale), final_norm=model.norm.data_ptr(),
                cos=rot.cos.data_ptr(), sin_signed=rot.sin_signed.data_ptr(), max_pos=rot.cos.shape[0],
                num_blocks=nb, block_size=bs, layers=layers,
            )
        except ValueError as exc:
            return None, str(exc)
        return cls(step, model, pool, max_tokens, keep), "one native call per decode step"

    # ------------------------------------------------------------------ steps

    def intact(self) -> bool:
        """Whether the model's parts are still those the native step was built from. A part
        replaced since (a wrapper that counts routes, a test double, a patched forward) sends
        the steps back to the per-op path, where the replacement runs. The step profiler's
        wrappers do not count: the native step times its parts itself (:meth:`set_profile`)."""
        if not self._check:
            return True
        if type(self._model).forward is not self._forward:
            return False
        for L, qkv, o, moe, router, experts, n in self._parts:
            if (L.qkv is not qkv or L.o is not o or L.moe is not moe or moe.router is not router
                    or moe._experts_fn is not experts or len(moe.__dict__) != n):
                return False
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
        """The final-normed hidden states ``[T, hidden]`` of a decode step, or None for a step
        this call does not take (the caller runs the per-op path). Into ``out`` (a contiguous
        tensor of that shape and the activation dtype) when given, else into this object's
        buffer for T tokens, which the next step of T tokens overwrites (a session's step
        result is valid until its next step; an allocation per step costs ~14 us on the
        caches the weight stream leaves)."""
        T = input_ids.shape[0]
        slots = meta.slot_mapping
        if (T > self.max_tokens or positions.dtype != torch.int64 or slots.dtype != torch.int64
                or not positions.is_contiguous() or not slots.is_contiguous() or not self.intact()):
            return None
        seqs = meta.seqs
        S = len(seqs)
        width = self._fill_tables(seqs)
        x_addr = self._one_row(meta.host_ids) if T == 1 else 0
        if not x_addr:
            x = self._model.embed(input_ids)
            if x.dtype != self._dtype or not x.is_contiguous():
                return None
            x_addr = x.data_ptr()
        if out is None:
            out = self._outs.get(T)
            if out is None:
                out = self._outs[T] = torch.empty((T, self._hidden), dtype=self._dtype)
        elif out.shape != (T, self._hidden) or out.dtype != self._dtype or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous [{T}, {self._hidden}] {self._dtype} tensor")
        a = self._tables_addr
        self._step.run(T, x_addr, positions.data_ptr(), slots.data_ptr(), S, a, a + 4 * S, a + 8 * S,
                       a + 12 * S, width, out.data_ptr(), self._pool)
        return out

    def _fill_tables(self, seqs: list[Any]) -> int:
        """Write the step's per-sequence q_start, q_len, ctx_len and block-table rows (padded
        to the longest) into the native step's table; returns the rows' width."""
        S = len(seqs)
        if S == 1:  # batch-1 decode: no per-column lists
            s = seqs[0]
            r = s.blocks if s.blocks is not None else s.block_table.tolist()
            width = max(1, len(r))
            vals = [s.q_start, s.q_len, s.ctx_len, *r] if r else [s.q_start, s.q_len, s.ctx_len, 0]
        else:
            rows = [s.blocks if s.blocks is not None else s.block_table.tolist() for s in seqs]
            width = max(1, max(len(r) for r in rows))
            vals = [s.q_start for s in seqs] + [s.q_len for s in seqs] + [s.ctx_len for s in seqs]
            for r in rows:
                vals += r
                if len(r) < width:
                    vals += [0] * (width - len(r))
        n = len(vals)
        if n > self._tables.shape[0]:
            self._tables = np.zeros(2 * n, dtype=np.int32)
            self._tables_addr = self._tables.ctypes.data
        self._tables[:n] = vals
        return width

    def _one_row(self, host_ids: Optional[list[int]]) -> int:
        """The address of a one-token step's embedding row where the native step can read it
        in place, or 0 (the caller runs the embedding). The lookup's torch ops (an index or
        a stack) cost ~50 us on the caches the weight stream leaves: a float table's row is
        read where it is, a packed table's row where its cache of dequantized rows keeps it
        (a hit, through :meth:`freetoken.models.layers.Embedding.cached_row`). An embedding
        replaced since build (the step profiler's timer) is called."""
        emb = self._embed
        if emb is None or host_ids is None or self._model.embed is not emb:
            return 0
        tok = host_ids[0]
        table = self._table
        if table is not None:
            if emb.table is not table or not 0 <= tok < table.shape[0]:
                return 0
            return table.data_ptr() + tok * self._hidden * table.element_size()
        if emb.table is not None:
            return 0
        row = emb.cached_row(tok)
        if row is None or row.dtype != self._dtype or row.shape != (self._hidden,) or not row.is_contiguous():
            return 0  # (the embedding call that follows marks a hit as used too)
        return row.data_ptr()

    # -------------------------------------------------------------- profiling

    def set_profile(self, on: bool) -> None:
        """Accumulate the parts' wall time per step (:meth:`part_seconds`) while ``on``; the
        profiler's wrappers around the model's parts then do not send steps to the per-op path."""
        self._step.profile = on
        self._check = not on
        self._step.reset_profile()

    def part_seconds(self) -> dict[str, float]:
        """Seconds spent in each of :data:`PROFILE_PARTS` since profiling was turned on."""
        return {p: ns * 1e-9 for p, ns in zip(PROFILE_PARTS, self._step.part_ns())}

    @property
    def num_layers(self) -> int:
        return len(self._model.layers)

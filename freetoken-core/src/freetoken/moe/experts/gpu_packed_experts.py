"""Routed experts resident on the GPU in their GGUF block formats (Q4_K, Q5_K, Q6_K, Q8_0).

:class:`PackedGpuExperts` has :class:`freetoken.moe.experts.gpu_experts.GpuExperts`' interface
(``forward(x, gpu_ids, w, out=None)``, ``warmup(batch_sizes, top_k, x_dtype)``) but keeps
the experts as the file's bytes on the device: for Qwen3-30B-A3B at Q4_K_M about 0.3 GiB
per layer instead of 1.12 GiB in BF16. Two paths, by the batch's route count ``T * K``:

* ``<= config.max_routes`` (decode): the backend's routed-expert kernels
  (:meth:`freetoken.backends.contract.PackedGemv.experts`, given as ``native``) where they
  serve the experts' formats, else the packed kernels of
  :mod:`freetoken.kernels.moe_packed`, which dequantize each weight tile in registers
  (two launches, float32 arithmetic, weights read once per route);
* above (prefill): the grouped kernels of :mod:`freetoken.kernels.moe_grouped` (routes
  sorted by expert on the device, each expert's blocks read and dequantized in registers
  once per block of its routes, BF16 tensor-core products); nothing is dequantized to
  memory. ``large_batch="dequantize"`` keeps the earlier path instead: the layer's experts
  dequantized to BF16 into a scratch (:class:`DequantScratch`, shareable by all layers, in
  groups of ``dequant_group`` experts), then the BF16 kernels of
  :func:`freetoken.kernels.moe_experts.launch`.

Capture safety as in GpuExperts: Triton compiles a kernel variant on its first launch,
which must not happen during stream capture. Run :meth:`PackedGpuExperts.warmup` (or one
eager forward with the same shapes) first; a capture that meets a variant not yet compiled
dequantizes the experts into the scratch and computes with GpuExperts' torch
implementation instead (logged once, counted in ``capture_fallbacks``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

from freetoken.backends.contract import on_gpu
from freetoken.moe.experts.gpu_experts import ACTIVATIONS, GpuExperts, finish_output, float32_output, stored_output
from freetoken.moe.experts.routed import GpuRoutedExperts

if TYPE_CHECKING:
    from freetoken.loading.tensors import RawTensor
    from freetoken.models.moe_layer import ExpertWeights

log = logging.getLogger(__name__)

#: ggml types these experts hold as the file's bytes (those of
#: :mod:`freetoken.kernels.moe_packed`): what streaming, the expert cache and locked fetch
#: can copy or map from the host's banks unchanged
PACKED_FORMATS = frozenset({8, 12, 13, 14, 39})  # Q8_0, Q4_K, Q5_K, Q6_K, MXFP4

#: FP8 block-scaled experts (Fmt.FP8_E4M3_B128): resident GPU experts keep them packed too,
#: rearranged once at load into rows of 132-byte blocks (3.1% over the codes;
#: moe_packed.FMT_FP8_B128); streaming, the cache and locked fetch do not (the device
#: layout is not the host's)
FMT_FP8_ROWS = 100


def _fp8_rows_to(stack: Any, out: Any) -> Any:
    """FP8 experts in their device rows (``PackedStack.from_fp8``) dequantized into ``out``
    (``[E, rows, cols]``) with torch ops, one expert at a time."""
    import torch

    for e in range(stack.data.shape[0]):
        blocks = stack.data[e].reshape(stack.rows, stack.cols // 128, 132)
        scale = blocks[..., :4].contiguous().view(torch.float32)  # [rows, cols / 128, 1]
        codes = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        out[e].copy_((codes * scale).reshape(stack.rows, stack.cols))
    return out


def fp8_rows_bytes(values: int) -> int:
    """Device bytes of ``values`` FP8 expert weights in their rows of 132-byte blocks."""
    return values // 128 * 132


def fp8_rows_fit(formats: Any, hidden: int, intermediate: int) -> bool:
    """Whether experts whose (gate, up, down) have ``formats`` are FP8 block-scaled with
    rows of whole 128-value blocks (``hidden`` and ``intermediate`` multiples of 128): the
    device rows of :meth:`~freetoken.kernels.moe_packed.PackedStack.from_fp8`."""
    return set(formats) == {FMT_FP8_ROWS} and hidden % 128 == 0 and intermediate % 128 == 0

#: Values per chunk of the BF16 dequantization (bounds its float32 temporaries: ~32 MiB)
DEQUANT_CHUNK_VALUES = 8 << 20


class DequantScratch:
    """BF16 buffers the large-batch path dequantizes a layer's experts into. One instance
    may serve every layer of a model (layers run one after another on one stream); its
    buffers grow to the largest layer and are allocated on first use."""

    def __init__(self) -> None:
        self._bufs: dict[str, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        import math

        import torch

        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            self._bufs.pop(name, None)
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def _stack_to_device(raw: "RawTensor", device: Any, on_device: Any = None) -> Any:
    """The raw tensor's bytes (``[E, rows, row_bytes]``) on ``device``: copied once, or
    ``on_device`` (uint8, the same bytes already there) used as it is."""
    import torch

    from freetoken.kernels import moe_packed as tp

    if len(raw.shape) != 3:
        raise ValueError(f"{raw.source}: expert stack {raw.name} must be [E, rows, cols], got {list(raw.shape)}")
    e, rows, cols = (int(s) for s in raw.shape)
    if int(raw.fmt) not in tp.FORMATS:
        raise ValueError(
            f"{raw.source}: expert stack {raw.name} is ggml type {int(raw.fmt)}; packed GPU experts hold "
            f"{', '.join(tp.FORMAT_NAMES.values())} (dequantize other formats with GpuExperts)"
        )
    if int(raw.fmt) == tp.FMT_FP8_B128 and on_device is None:  # (bytes on the device: already its rows)
        if raw.scale is None:
            raise ValueError(f"{raw.source}: FP8 expert stack {raw.name} has no block scales (weight_scale_inv)")
        return tp.PackedStack.from_fp8(raw.raw_torch(), raw.scale, device)
    if on_device is not None:
        return tp.PackedStack.from_bytes(on_device, raw.fmt, e, rows, cols)
    data = raw.raw_torch()
    if data.dtype == torch.int8:
        data = data.view(torch.uint8)
    return tp.PackedStack.from_bytes(data.reshape(-1).to(device), raw.fmt, e, rows, cols)


class PackedGpuExperts(GpuRoutedExperts):
    def __init__(
        self, gate: "RawTensor", up: "RawTensor", down: "RawTensor", device: Any, activation: str = "silu",
        config: Any = None, scratch: Optional[DequantScratch] = None, bf16_config: Any = None,
        on_device: Optional[tuple[Any, Any, Any]] = None, warm: bool = True, dequant_group: Optional[int] = None,
        large_batch: str = "grouped", native: Any = None,
    ) -> None:  # fmt: skip
        import torch

        from freetoken.kernels import moe_packed as tp

        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        g_shape, u_shape, d_shape = (tuple(int(s) for s in t.shape) for t in (gate, up, down))
        if g_shape != u_shape or len(g_shape) != 3 or d_shape != (g_shape[0], g_shape[2], g_shape[1]):
            raise ValueError(
                f"expert shapes: gate/up must be [E, I, H] and down [E, H, I]; got gate {list(g_shape)}, "
                f"up {list(u_shape)}, down {list(d_shape)}"
            )
        self.device = torch.device(device)
        self.num_experts, self.intermediate, self.hidden = g_shape
        placed = on_device or (None, None, None)
        self.gate, self.up, self.down = (
            b if isinstance(b, tp.PackedStack) else _stack_to_device(t, self.device, b)
            for t, b in zip((gate, up, down), placed)
        )  # fmt: skip
        self.file_bytes = int(gate.nbytes + up.nbytes + down.nbytes)
        self.activation = activation
        self.config = config or tp.default_config(self.device)
        self.config.validate()
        self.bf16_config = bf16_config
        self.scratch = scratch if scratch is not None else DequantScratch()
        #: experts dequantized at a time by the large-batch path (bounds the scratch)
        self.dequant_group = min(self.num_experts, dequant_group or self.num_experts)
        if large_batch not in ("grouped", "dequantize"):
            raise ValueError(f"large_batch={large_batch!r}: expected 'grouped' or 'dequantize'")
        #: batches above ``config.max_routes`` routes: the grouped kernels over the blocks
        #: (moe_grouped), or the experts dequantized to BF16 in groups through the scratch
        self.large_batch = large_batch
        #: the backend's routed-expert kernels (a PackedGemv) for decode batches, where they serve
        #: these experts (else None, and ``native_refusal`` says why)
        self.native: Any = None
        self.native_refusal = "not offered" if native is None else native.experts_refusal(
            (self.gate.fmt, self.up.fmt, self.down.fmt), self.hidden, self.intermediate, 1, activation, None)
        if native is not None and not self.native_refusal:
            self.native = native
        self._native_serves: dict[tuple[int, Any], bool] = {}
        self.capture_fallbacks = 0
        if on_gpu(self.device):
            # the capture fallback's matmuls need a cuBLAS handle, which cannot be created
            # during stream capture (no other path of these experts creates one)
            with torch.cuda.device(self.device):
                torch.cuda.current_blas_handle()
        self._compiled: set[tuple[Any, ...]] = set()
        if warm:
            self._warm_dequant()

    @classmethod
    def from_expert_weights(cls, experts: "ExpertWeights", device: Any, **kwargs: Any) -> "PackedGpuExperts":
        return cls(experts.gate, experts.up, experts.down, device, **kwargs)

    @classmethod
    def over_device_bytes(
        cls, experts: "ExpertWeights", data: tuple[Any, Any, Any], device: Any, **kwargs: Any
    ) -> "PackedGpuExperts":
        """Experts whose bytes are already where the kernels read them (``data``: uint8 gate,
        up, down on the device, e.g. a streaming buffer or cache slots, or ready
        :class:`~freetoken.kernels.moe_packed.PackedStack` objects, e.g. slots of a
        buffer), nothing copied; the capture fallback's constants are not prepared."""
        return cls(experts.gate, experts.up, experts.down, device, on_device=data, warm=False, **kwargs)

    @classmethod
    def over_slots(cls, experts: "ExpertWeights", data: Any, count: int, device: Any,
                   **kwargs: Any) -> "PackedGpuExperts":  # fmt: skip
        """``count`` experts of the layer's stacks laid one after another in ``data`` (uint8
        gate, up, down on the device: a streaming window, locked fetch's staging slots), ids
        ``0 .. count - 1`` indexing them; as :meth:`over_device_bytes`."""
        from freetoken.kernels import moe_packed as tp

        stacks = tuple(tp.PackedStack.from_bytes(b, int(t.fmt), count, *(int(s) for s in t.shape[1:]))
                       for b, t in zip(data, (experts.gate, experts.up, experts.down)))
        view = cls.over_device_bytes(experts, stacks, device, **kwargs)
        view.num_experts = view.dequant_group = count
        return view

    @property
    def device_bytes(self) -> int:
        """Bytes the expert stacks take on the device (the file's bytes; scratch excluded)."""
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @property
    def formats(self) -> tuple[str, str, str]:
        from freetoken.kernels.moe_packed import FORMAT_NAMES

        return tuple(FORMAT_NAMES[s.fmt] for s in (self.gate, self.up, self.down))  # type: ignore[return-value]

    def forward(self, x: Any, gpu_ids: Any, w: Any, out: Optional[Any] = None, slot_table: Optional[Any] = None) -> Any:
        """``x [T, H]`` (any float dtype), ``gpu_ids [T, K]`` (-1 = not on the GPU), ``w [T, K]``.
        Returns ``[T, H]`` in ``x.dtype`` (written into ``out`` when given). With
        ``slot_table`` (int32 ``[n]`` on the device, -1 = none) the ids index the table, which
        gives this stack's experts (an expert cache's slots); the decode kernels read it
        themselves, larger batches map the ids first."""
        import torch

        from freetoken.kernels import moe_experts

        from freetoken.kernels import moe_grouped

        from freetoken.kernels import moe_packed
        from freetoken.moe.experts.route_slots import route_slots

        tokens, top_k = gpu_ids.shape
        x, ids, w = x.contiguous(), gpu_ids.contiguous(), w.contiguous()
        packed = tokens * top_k <= self.config.max_routes
        if slot_table is not None and not packed:
            ids, slot_table = route_slots(ids, slot_table), None
        # the packed kernels store the output once, in its dtype: no conversion kernel after them
        y, direct = (stored_output if packed else float32_output)(out, x, tokens, self.hidden, self.device)
        if packed and x.data_ptr() % 16 == 0 and self._native_for(top_k, x.dtype):  # (its rows read 16 B at a time)
            self.native.experts(x, ids, w, (self.gate, self.up, self.down), y, table=slot_table,
                                activation=self.activation)
            return finish_output(y, out, direct, x.dtype)
        bf16_config = self.bf16_config or moe_experts.DEFAULT_CONFIG
        grouped = not packed and self.large_batch == "grouped"
        if packed:
            key: tuple[Any, ...] = ("packed", *moe_packed.variant_key(x, ids, w, y, self.config, slot_table))
        elif grouped:
            key = moe_grouped.variant_key(x, ids, w)
        else:
            key = ("bf16", *moe_experts.variant_key(x, ids, w, y, bf16_config))
        if key not in self._compiled and x.is_cuda and torch.cuda.is_current_stream_capturing():
            if not self.capture_fallbacks:
                log.warning(
                    "packed GPU experts: Triton variant for %d tokens x %d routes (%s) not compiled before stream "
                    "capture; this graph dequantizes the experts and uses the torch implementation (call "
                    "PackedGpuExperts.warmup before capture)",
                    tokens, top_k, x.dtype,
                )  # fmt: skip
            self.capture_fallbacks += 1
            g, u, d = self._dequantized()
            own = ids if slot_table is None else route_slots(ids, slot_table)
            return GpuExperts(g, u, d, self.activation, impl="torch")._forward_torch(x, own, w, out)
        if packed:
            h = torch.empty(tokens, top_k, self.intermediate, dtype=torch.float32, device=self.device)
            moe_packed.launch(x, ids, w, self.gate, self.up, self.down, y, h, self.activation, self.config,
                                     table=slot_table)
        elif grouped:
            moe_grouped.launch(x, ids, w, self.gate, self.up, self.down, y, self.activation)
        elif self.dequant_group >= self.num_experts:
            g, u, d = self._dequantized()
            h = torch.empty(tokens, top_k, self.intermediate, dtype=g.dtype, device=self.device)
            moe_experts.launch(x, ids, w, g, u, d, y, h, self.activation, bf16_config)
        else:
            self._grouped(x, ids, w, y, bf16_config)
        self._compiled.add(key)
        return finish_output(y, out, direct, x.dtype)

    def _native_for(self, top_k: int, dtype: Any) -> bool:
        """Whether the native kernels run a decode batch of ``top_k`` routes per token and
        activations of ``dtype`` (asked once per pair)."""
        if self.native is None:
            return False
        key = (top_k, dtype)
        if key not in self._native_serves:
            why = self.native.experts_refusal((self.gate.fmt, self.up.fmt, self.down.fmt), self.hidden,
                                              self.intermediate, top_k, self.activation, dtype)
            if why:
                log.info("packed GPU experts: %d routes of %s run the Triton kernels (native: %s)", top_k, dtype, why)
            self._native_serves[key] = not why
        return self._native_serves[key]

    def warmup(
        self, batch_sizes: Iterable[int], top_k: int, x_dtype: Any = None, ids_dtype: Any = None, w_dtype: Any = None,
        slot_table: Optional[Any] = None,
    ) -> None:  # fmt: skip
        """Compile the Triton variants these shapes use (eagerly, on random inputs) so that
        a later stream capture finds them; defaults: bfloat16 x, int32 ids, float32 weights,
        ids of this stack (else through ``slot_table``, as :meth:`forward`). The packed
        kernels' output is x's dtype, or float32 for a caller's float32 ``out``: both are
        compiled."""
        import torch

        dev = self.device
        n = self.num_experts if slot_table is None else int(slot_table.numel())
        for tokens in batch_sizes:
            x = torch.randn(tokens, self.hidden, device=dev).to(x_dtype or torch.bfloat16)
            ids = torch.randint(-1, n, (tokens, top_k), device=dev).to(ids_dtype or torch.int32)
            w = torch.rand(tokens, top_k, device=dev).to(w_dtype or torch.float32)
            self.forward(x, ids, w, slot_table=slot_table)
            if tokens * top_k <= self.config.max_routes and x.dtype != torch.float32:
                self.forward(x, ids, w, out=torch.empty(tokens, self.hidden, dtype=torch.float32, device=dev),
                             slot_table=slot_table)

    # ---- the large-batch path -----------------------------------------------------------
    def _grouped(self, x: Any, ids: Any, w: Any, y: Any, config: Any) -> None:
        """The large-batch path one group of experts at a time: each group dequantized into
        the scratch, its routes (ids shifted into the group, the others -1) through the BF16
        kernels, the groups' outputs summed into ``y``."""
        import torch

        from freetoken.kernels import moe_experts
        from freetoken.kernels.moe_packed import dequantize_experts

        tokens, top_k = ids.shape
        part = torch.empty_like(y)
        h = torch.empty(tokens, top_k, self.intermediate, dtype=torch.bfloat16, device=self.device)
        minus = torch.full_like(ids, -1)
        for first in range(0, self.num_experts, self.dequant_group):
            n = min(self.dequant_group, self.num_experts - first)
            bufs = []
            for name, s in (("gate", self.gate), ("up", self.up), ("down", self.down)):
                buf = self.scratch.get(name, (n, s.rows, s.cols), torch.bfloat16, self.device)
                bufs.append(dequantize_experts(s, buf, first=first, count=n))
            local = torch.where((ids >= first) & (ids < first + n), ids - first, minus)
            moe_experts.launch(x, local, w, *bufs, part if first else y, h, self.activation, config)
            if first:
                y.add_(part)

    def _dequantized(self) -> tuple[Any, Any, Any]:
        """All experts as BF16 ``gate/up [E, I, H]``, ``down [E, H, I]`` in the scratch."""
        import torch

        from freetoken.backends import triton_target
        from freetoken.loading.dequant import dequantize
        from freetoken.kernels.moe_packed import dequantize_experts

        out = []
        for name, s in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            shape = (self.num_experts, s.rows, s.cols)
            buf = self.scratch.get(name, shape, torch.bfloat16, self.device)
            if triton_target.for_device(self.device).usable:
                dequantize_experts(s, buf)  # one Triton launch per stack
            elif s.fmt == FMT_FP8_ROWS:
                _fp8_rows_to(s, buf)
            else:
                dequantize(s.data, s.fmt, shape, torch.bfloat16, out=buf, chunk_values=DEQUANT_CHUNK_VALUES)
            out.append(buf)
        return out[0], out[1], out[2]

    def _warm_dequant(self) -> None:
        """Dequantize one row of each stack: creates the dequantization's device constants
        now, so that a fallback during stream capture makes no host-to-device copy."""
        import torch

        from freetoken.loading.dequant import dequantize

        for s in (self.gate, self.up, self.down):
            if s.fmt != FMT_FP8_ROWS:  # (torch ops only: no constants to prepare)
                dequantize(s.data[0, :1], s.fmt, (1, s.cols), torch.bfloat16)

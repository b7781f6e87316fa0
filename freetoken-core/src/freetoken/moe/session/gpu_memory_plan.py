"""The GPU memory plan of a whole model, made before any weight is read.

The budget is ``--gpu-memory-limit``/``--gpu-memory-utilization``, else the device's total.
Out of it come the dense part (dequantized, or a GGUF file's blocks kept packed:
``--gpu-dense``; a packed embedding table may stay in page-locked host memory:
``--gpu-embedding``), a minimum KV cache, a reserve for the CUDA context and workspaces, the
global expert cache, the long-prompt streaming buffers and locked fetch's copy slots; then
which layers' experts fit on the device (``--moe-cpu-layers``, default: as many layers as
fit and, of those, the most bytes: :func:`~freetoken.moe.placement.layers_that_fit`). A plan
that does not fit fails here, naming the sizes and the flags. On CUDA devices the budget is also set as the
allocator's hard per-process limit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from freetoken.backends.contract import Backend, BackendError, MemoryPlanError, ModelShape, on_gpu

from freetoken.backends.options import CPU_PREFILL_CHUNK, EngineOptions
from freetoken.models.layers import DeviceWeightPolicy
from freetoken.moe.experts.gpu_packed_experts import FMT_FP8_ROWS, PACKED_FORMATS, fp8_rows_bytes, fp8_rows_fit
from freetoken.moe.experts.locked_fetch import FetchStaging, planned_fraction
from freetoken.moe.placement import cpu_layers, layers_that_fit
from freetoken.moe.experts.prefill_stream import buffer_bytes

log = logging.getLogger(__name__)

GIB = float(1 << 30)

#: Device memory kept out of the plan, inside torch's allocator, for what loading the
#: weights holds for a moment, cuBLAS/Triton workspaces, decode graphs' pools and the small
#: tensors of a step. The CUDA context and whatever else holds device memory outside the
#: allocator is measured at plan time, and a prompt chunk's activations are planned from
#: the model's shape (both on top of this).
WORKSPACE_BYTES = 1 << 30

#: Device memory outside torch's allocator grows after the plan is made (library handles,
#: loaded kernel modules, decode graphs' executables): 0.16-0.17 GiB between the plan and the
#: first prompts on an H100 at 12 and 16 GiB limits (whole-process peak against the cap plus
#: what was outside at plan time). The plan counts this much on top of what it measures.
OUTSIDE_GROWTH_BYTES = 384 << 20

#: A prompt chunk's activations may take this share of the budget (at least
#: MIN_ACTIVATION_BYTES): the plan lowers the prefill chunk to the largest power of two
#: whose activations fit, rather than give the experts' and the KV cache's room to them.
ACTIVATION_SHARE = 1 / 16
MIN_ACTIVATION_BYTES = 256 << 20
MIN_PREFILL_CHUNK = 64
#: Without a --prefill-chunk, a plan under a budget places the experts as for chunks of this
#: many tokens, then doubles the chunk (up to the GPU's default) while its activations fit in
#: what the placement leaves beyond the KV cache's minimum: a larger chunk never costs a
#: layer of experts on the device.
PLACEMENT_CHUNK = CPU_PREFILL_CHUNK

#: The KV cache the plan guarantees at least (tokens) when no context length is given.
MIN_KV_TOKENS = 4096


def gib(n: float) -> str:
    """Bytes for a message: GiB, or MiB below an eighth of one."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 8 else f"{n / (1 << 20):.1f} MiB"


def _reserve_detail(chunk: int, activations: int, outside: int, workspace: int) -> str:
    return (f"prompt chunks of {chunk} tokens {gib(activations)}: --prefill-chunk lowers it; "
            f"outside the allocator {gib(outside)}; workspaces {gib(workspace)}")


@dataclasses.dataclass
class MemoryPlan:
    """Device bytes by part, and where each MoE layer's experts are."""

    budget: Optional[int]  # bytes this process may use on the device (None: not planned)
    dense: int
    expert_layer_bytes: int  # the largest layer's routed experts on the device
    gpu_layers: list[int]
    cpu_layers: list[int]
    kv_budget: Optional[int]
    reserve: int  # workspace + outside + activations: the step's own memory
    packed_layers: list[int] = dataclasses.field(default_factory=list)  # GPU layers kept in the file's blocks
    expert_bytes: int = 0  # all GPU layers' experts on the device
    cache: int = 0  # the global expert cache
    scratch: int = 0  # the streaming buffers (a window of a layer's experts, or two layers) and locked fetch's copy slots
    #: "dequantized", "packed" (the file's block formats kept on the device) or "both" (those
    #: and copies at the activation dtype for prompts)
    dense_form: str = "dequantized"
    embedding: str = "device"  # or "host": a packed embedding table in page-locked host memory
    prefill_chunk: int = 0  # the most prompt tokens a step computes (0: as the engine asks)
    activations: int = 0  # of reserve: a prompt chunk's activations at that chunk
    outside: int = 0  # of reserve: device memory outside torch's allocator (CUDA context, other users)
    workspace: int = 0  # of reserve: workspaces and graph pools inside the allocator
    #: the expert cache takes what the KV cache leaves of kv_budget once allocated
    #: (``--moe-cache-size auto`` with the layers placed by the plan and some on the CPU)
    cache_auto: bool = False

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gpu_layers"] = len(self.gpu_layers)
        out["packed_layers"] = len(self.packed_layers)
        out["cpu_layers"] = layer_ranges(self.cpu_layers)
        return out


def layer_ranges(layers: list[int]) -> str:
    """Layer indices as ranges ("0-6,9"), or "none"."""
    if not layers:
        return "none"
    parts: list[str] = []
    start = prev = layers[0]
    for i in layers[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if i is not None:
            start = prev = i
    return ",".join(parts)


@dataclasses.dataclass
class TrafficPlan:
    """What the plan decided for the expert traffic of the CPU layers."""

    locked_fetch: float  # the share of missed routes fetched from locked memory (0: off)
    locked_setting: str  # "given", "auto", or "auto: off ..." with the reason
    streams: bool  # long prompts stream the CPU layers' experts to the GPU


class GpuMemoryPlanner:
    """Makes a :class:`MemoryPlan` for one model on one device and chooses, on the way, the
    forms that decide its sizes: the dense part's (and its weight policy), whether packed
    experts can stay packed, and the backend's expert kernels offered to them."""

    def __init__(self, backend: Backend, options: EngineOptions, device: torch.device, act_dtype: torch.dtype) -> None:
        self.backend = backend
        self.options = options
        self.device = device
        self.act_dtype = act_dtype
        self.weight_policy: Any = DeviceWeightPolicy(device, act_dtype)
        self.dense_form = "dequantized"
        self.embedding_place = "device"  # or "host": the packed embedding table in page-locked host memory
        self.packed_capable = False
        self.experts_kernel: Any = None  # what --moe-gpu-kernel offers packed GPU experts
        self.traffic_plan = TrafficPlan(0.0, "off", False)

    def plan(self, shape: ModelShape) -> MemoryPlan:
        """The plan for ``shape``, or :class:`MemoryPlanError` naming the sizes and the flags."""
        o = self.options
        elt = torch.empty((), dtype=self.act_dtype).element_size()
        dequantized = 3 * shape.num_experts * shape.hidden * shape.moe_intermediate * elt
        packed = self._packed_layers(shape)
        if self.packed_capable or self.options.moe.gpu_kernel != "auto":  # (no packed experts: nothing to offer)
            self.experts_kernel = self._experts_kernel()
        per_layer = {i: self._packed_bytes(shape, i, dequantized) if i in packed else dequantized
                     for i in shape.moe_layers}
        as_stored = {i for i in packed if set((shape.expert_formats or {})[i]) <= PACKED_FORMATS}
        n = len(shape.moe_layers)
        mem = self.backend.device_memory()
        total = mem[1] if mem else None
        caps = {name: c for name, c in (
            ("--gpu-memory-limit", o.gpu_memory_limit),
            ("--gpu-memory-utilization", int(o.gpu_memory_utilization * total)
             if (o.gpu_memory_utilization and total) else None),
            ("the device total", total)) if c}  # fmt: skip
        budget = min(caps.values()) if caps else None
        budget_from = min(caps, key=lambda k: caps[k]) if caps else None
        # the KV cache holds at least one request of the longest context given (the engine
        # allocates that much whatever the budget), else MIN_KV_TOKENS; an explicit size in full
        bs = max(1, o.kv_block_size)
        kv_tokens = o.kv_cache_tokens or (-(-o.max_model_len // bs) * bs if o.max_model_len else MIN_KV_TOKENS)
        kv_min = kv_tokens * shape.kv_bytes_per_token
        chunk, activations = self._prefill_chunk(shape, budget)
        outside = self._outside_allocator(mem) if budget is not None else 0
        workspace = WORKSPACE_BYTES if budget is not None else 0
        reserve = workspace + outside + activations if budget is not None else 0
        self.reserve_detail = _reserve_detail(chunk, activations, outside, workspace)
        cache = o.moe.cache_bytes or (int(o.moe.cache_fraction * budget) if budget else 0)
        # the prefill of packed (or streamed) experts runs the grouped kernels, which read the
        # blocks where they are (their temporaries, ~70 MB per 1024 tokens, fit the reserve):
        # no dequantization scratch; streaming keeps a window of a layer's experts (two
        # layers with --moe-stream-experts all). `auto` streams when the file's expert formats are
        # known to be computable as stored (GGUF blocks the packed kernels read), or when
        # there is no budget to protect; an HF checkpoint on a planned GPU needs `on`.
        mode = o.moe.stream_prefill
        streams = n > 0 and (mode == "on" or (mode == "auto" and (len(as_stored) == n or budget is None)))
        layer_bytes = list(per_layer.values() if shape.expert_file_bytes is None else shape.expert_file_bytes.values())
        buffers = buffer_bytes(o.moe.stream_experts, layer_bytes, shape.num_experts, o.moe.stream_windows) \
            if streams else 0
        m = o.moe
        fetchable = n > 0 and len(as_stored) == n and m.lock_host != "off"
        locked, locked_setting = planned_fraction(m.locked_fetch, self.device, fetchable, self.backend.locked_fetch_share)
        if locked > 0 and m.locked_max_fetch > 0 and n > 0:
            # locked fetch by copy: device slots for the experts a step fetches
            buffers += FetchStaging.bytes_for(max(per_layer.values()) // max(shape.num_experts, 1), m.locked_max_fetch)
        dense = self._dense_form(shape, budget, reserve + kv_min + cache + buffers, per_layer)
        fixed = reserve + dense + kv_min + cache + buffers
        try:
            if o.moe_cpu_layers is None and budget is not None:
                fit = set(layers_that_fit(per_layer, budget - fixed))
                cpu = [i for i in shape.moe_layers if i not in fit]
            else:  # the placement given, or (no budget to plan against) every layer's experts on the host
                cpu = cpu_layers(o.moe_cpu_layers, shape.moe_layers, n)
        except ValueError as exc:
            raise MemoryPlanError(str(exc)) from None
        cpu_set = set(cpu)
        gpu = [i for i in shape.moe_layers if i not in cpu_set]
        if not cpu:
            cache = buffers = 0  # nothing to cache or stream
        cache_auto = bool(cpu) and not cache and o.moe.cache_auto and o.moe_cpu_layers is None and budget is not None
        experts = sum(per_layer[i] for i in gpu)
        kv_budget = None
        if budget is not None and o.prefill_chunk is None:
            spare = budget - (reserve + dense + kv_min + cache + buffers + experts)
            chunk, activations = self._grown_chunk(shape, budget, chunk, spare)
            reserve = workspace + outside + activations
            self.reserve_detail = _reserve_detail(chunk, activations, outside, workspace)
        if budget is not None:
            fixed = reserve + dense + kv_min + cache + buffers
            need = fixed + experts
            if need > budget:
                self._refuse(shape, per_layer, gpu, need, budget, budget_from, fixed, cache, buffers, kv_min,
                             reserve, dense)
            kv_budget = budget - reserve - dense - experts - cache - buffers
            if on_gpu(self.device) and total:
                # the limit is the card's: what lies outside the allocator comes off its cap
                torch.cuda.set_per_process_memory_fraction(min(1.0, max(budget - outside, 0) / total), self.device)
        result = MemoryPlan(budget, dense, max(per_layer.values(), default=0), gpu, cpu, kv_budget, reserve,
                            sorted(set(gpu) & packed), experts, cache, buffers, self.dense_form, self.embedding_place,
                            chunk, activations, outside, workspace, cache_auto)
        self.traffic_plan = TrafficPlan(locked, locked_setting, streams and bool(cpu))
        log.info("GPU memory plan: budget %s, dense %s (%s, embedding on the %s), experts of %d layers on the GPU "
                 "(%s, %d packed), expert cache %s%s, streaming buffers %s, CPU layers %s; step reserve %s (prompt "
                 "chunks of %d tokens %s, outside the allocator %s, workspaces %s)",
                 gib(budget) if budget else "-", gib(dense), self.dense_form, self.embedding_place, len(gpu),
                 gib(experts), len(result.packed_layers), gib(cache),
                 " (auto: what the KV cache leaves)" if cache_auto else "", gib(buffers), layer_ranges(cpu),
                 gib(reserve), chunk, gib(activations), gib(outside), gib(workspace))
        return result

    def _prefill_chunk(self, shape: ModelShape, budget: Optional[int]) -> tuple[int, int]:
        """The prompt chunk a step computes and its activations' bytes: the engine's chunk
        (with none given, under a budget, :data:`PLACEMENT_CHUNK`: :meth:`_grown_chunk`
        enlarges it once the experts are placed), lowered (to a power of two, at least
        :data:`MIN_PREFILL_CHUNK`) while its activations exceed :data:`ACTIVATION_SHARE` of
        the budget (no budget: as asked)."""
        asked = max(1, self.options.prompt_chunk(on_gpu(self.device)))
        if self.options.prefill_chunk is None and budget is not None:
            asked = min(asked, PLACEMENT_CHUNK)
        per_token = shape.activation_bytes_per_token
        if budget is None or per_token <= 0:
            return asked, asked * per_token
        allowed = self._activation_share(budget)
        chunk = asked
        if chunk * per_token > allowed:
            chunk = max(MIN_PREFILL_CHUNK, 1 << max(0, (allowed // per_token).bit_length() - 1))
            chunk = min(chunk, asked)
            log.info("prefill chunk lowered from %d to %d tokens: a chunk's activations take about %s per token, "
                     "and the plan gives them %s of the %s budget", asked, chunk, gib(per_token), gib(allowed),
                     gib(budget))
        return chunk, chunk * per_token

    @staticmethod
    def _activation_share(budget: int) -> int:
        return max(MIN_ACTIVATION_BYTES, int(budget * ACTIVATION_SHARE))

    def _grown_chunk(self, shape: ModelShape, budget: int, chunk: int, spare: int) -> tuple[int, int]:
        """The default chunk once the experts are placed: ``chunk`` doubled, up to the
        device's default (:meth:`EngineOptions.prompt_chunk`), while the added activations
        fit in ``spare`` (the budget beyond the placement and the KV cache's minimum) and
        within :data:`ACTIVATION_SHARE`."""
        per_token = shape.activation_bytes_per_token
        top = self.options.prompt_chunk(on_gpu(self.device))
        if per_token <= 0:
            return top, 0
        allowed = self._activation_share(budget)
        while 2 * chunk <= top and chunk * per_token <= spare and 2 * chunk * per_token <= allowed:
            spare -= chunk * per_token
            chunk *= 2
        return chunk, chunk * per_token

    def _outside_allocator(self, mem: Optional[tuple[int, int]]) -> int:
        """Device memory outside torch's allocator: in use now (the CUDA context, library
        handles, other processes on the same card, which this process cannot have either)
        plus :data:`OUTSIDE_GROWTH_BYTES`. 0 on devices that are not GPUs."""
        if mem is None or not on_gpu(self.device):
            return 0
        free, total = mem
        return max(0, total - free - torch.cuda.memory_reserved(self.device)) + OUTSIDE_GROWTH_BYTES

    def _dense_form(self, shape: ModelShape, budget: Optional[int], other: int, per_layer: dict[int, int]) -> int:
        """Choose the dense part's form (``--gpu-dense``), install its weight policy and
        return its device bytes. ``auto``, where the file has a packed form and Triton runs:
        packed when packing lets more layers' experts onto the device than dequantized (the
        default placement) or is needed to fit (explicit ``--moe-cpu-layers``); else both
        when the two forms together (the head only packed) hold as many layers' experts as
        dequantized (decode reads the blocks, prompts multiply the copies); else
        dequantized. ``both``: packed, and copies at the activation dtype of every packed
        linear but the head for prompts. ``other``: the plan's fixed bytes but the dense part."""
        from freetoken.models.packed_linear import PackedWeightPolicy, packed_dense_impl

        mode = self.options.gpu_dense
        if mode not in ("auto", "packed", "dequantized", "both"):
            raise MemoryPlanError(f"--gpu-dense {mode!r}: expected 'auto', 'packed', 'dequantized' or 'both'")
        packed = None if shape.dense_file_bytes is None else shape.dense_file_bytes + shape.dense_scratch_bytes
        if mode in ("packed", "both") and packed is None:
            raise MemoryPlanError(f"--gpu-dense {mode}: this checkpoint's dense weights have no packed form (GGUF "
                                  "files only); use --gpu-dense dequantized or auto")
        form = mode
        if mode == "auto":
            form = "dequantized"
            if packed is not None and budget is not None and packed < shape.dense_bytes \
                    and packed_dense_impl(self.device)[0] == "triton":
                dequantized = self._layers_fit(shape, budget - other - shape.dense_bytes, per_layer)
                if self._layers_fit(shape, budget - other - packed, per_layer) > dequantized:
                    form = "packed"
                elif dequantized >= 0 and dequantized <= self._layers_fit(
                        shape, budget - other - packed - shape.prompt_copy_bytes, per_layer):
                    form = "both"
        self.dense_form = form
        if form in ("packed", "both"):
            assert packed is not None
            if form == "both":
                packed += shape.prompt_copy_bytes
            host = self._embedding_on_host(shape, budget, other, packed, per_layer)
            self.embedding_place = "host" if host else "device"
            self.weight_policy = PackedWeightPolicy(self.device, self.act_dtype, host_embedding=host,
                                                    gemv=self._packed_gemv(), prompt_copies=form == "both")
            return packed - (shape.embedding_file_bytes if host else 0)
        if self.options.gpu_embedding == "host":
            raise MemoryPlanError("--gpu-embedding host keeps a packed embedding table in host memory; the dense "
                                  "part here is dequantized (--gpu-dense packed keeps a GGUF file's blocks)")
        return shape.dense_bytes

    def _packed_gemv(self) -> Any:
        """``--gpu-gemv``: the backend's one-token GEMV over packed blocks, or None (the
        Triton kernels run every packed linear)."""
        mode = self.options.gpu_gemv
        if mode not in ("auto", "native", "triton"):
            raise ValueError(f"--gpu-gemv {mode!r}: expected 'auto', 'native' or 'triton'")
        gemv = None if mode == "triton" else self.backend.packed_gemv()
        if gemv is None and mode == "native":
            raise BackendError(f"--gpu-gemv native: backend {self.backend.name} has no native one-token GEMV (the "
                               "NVIDIA build of freetoken-cuda has it); use --gpu-gemv auto or triton")
        return gemv

    def _experts_kernel(self) -> Any:
        """``--moe-gpu-kernel``: the backend's kernels over packed blocks offered to packed
        GPU experts for decode (they use them where they serve the experts' formats), or None
        (the Triton kernels run them)."""
        mode = self.options.moe.gpu_kernel
        if mode not in ("auto", "native", "triton"):
            raise ValueError(f"--moe-gpu-kernel {mode!r}: expected 'auto', 'native' or 'triton'")
        kernels = None if mode == "triton" else self.backend.packed_gemv()
        if mode == "native" and (kernels is None or not kernels.serves_experts):
            raise BackendError(f"--moe-gpu-kernel native: backend {self.backend.name} has no native routed-expert "
                               "kernels (the NVIDIA build of freetoken-cuda has them); use --moe-gpu-kernel auto or "
                               "triton")
        return kernels

    def _embedding_on_host(self, shape: ModelShape, budget: Optional[int], other: int, packed: int,
                           per_layer: dict[int, int]) -> bool:  # fmt: skip
        """``--gpu-embedding``: whether the packed embedding table stays in host memory.
        ``auto``: when the default plan, with the table on the device, leaves some layers'
        experts on the CPU (or nothing fits): each of its bytes then holds experts instead,
        for a few microseconds of PCIe reads per step."""
        from freetoken.models.packed_linear import packed_dense_impl

        mode = self.options.gpu_embedding
        if mode not in ("auto", "device", "host"):
            raise MemoryPlanError(f"--gpu-embedding {mode!r}: expected 'auto', 'device' or 'host'")
        usable = shape.embedding_file_bytes > 0 and packed_dense_impl(self.device)[0] == "triton"
        if mode == "host" and not usable:
            raise MemoryPlanError("--gpu-embedding host: " + (
                "this model's embedding is also its output head, or not in a packed block format"
                if shape.embedding_file_bytes <= 0 else
                f"the table is read by Triton kernels, which do not run here ({packed_dense_impl(self.device)[1]})")
                + "; use --gpu-embedding auto or device")
        if mode != "auto" or not usable or budget is None:
            return mode == "host"
        fit = self._layers_fit(shape, budget - other - packed, per_layer)
        return fit < 0 or (self.options.moe_cpu_layers is None and fit < len(shape.moe_layers))

    def _layers_fit(self, shape: ModelShape, room: int, per_layer: dict[int, int]) -> int:
        """How many MoE layers' experts the plan puts on the device with ``room`` bytes for
        them (-1: not even the rest fits). With ``--moe-cpu-layers`` given: its GPU layers'
        count when they fit, else -1."""
        if room < 0:
            return -1
        if self.options.moe_cpu_layers is not None:
            try:
                cpu = set(cpu_layers(self.options.moe_cpu_layers, shape.moe_layers, len(shape.moe_layers)))
            except ValueError:
                return 0  # the plan reports the bad spec
            gpu = [i for i in shape.moe_layers if i not in cpu]
            return len(gpu) if sum(per_layer[i] for i in gpu) <= room else -1
        return len(layers_that_fit(per_layer, room))

    def _packed_bytes(self, shape: ModelShape, layer: int, dequantized: int) -> int:
        """Device bytes of a packed layer's experts: the file's bytes, FP8 in its device rows."""
        fmts = (shape.expert_formats or {})[layer]
        if FMT_FP8_ROWS in fmts:
            return fp8_rows_bytes(3 * shape.num_experts * shape.hidden * shape.moe_intermediate)
        return (shape.expert_file_bytes or {}).get(layer, dequantized)

    def _packed_layers(self, shape: ModelShape) -> set[int]:
        """The MoE layers whose experts can stay packed on this device: the file's block
        formats, or FP8 block-scaled (all three stacks) in its device rows."""
        from freetoken.kernels import availability

        mode = self.options.moe.gpu_experts
        if mode not in ("auto", "dequantized"):
            raise MemoryPlanError(f"--moe-gpu-experts {mode!r}: expected 'auto' or 'dequantized'")
        self.packed_capable = mode == "auto" and availability.default_impl(self.device)[0] == "triton"
        if not self.packed_capable or not shape.expert_formats:
            return set()
        return {i for i, f in shape.expert_formats.items()
                if set(f) <= PACKED_FORMATS
                or (FMT_FP8_ROWS in f and fp8_rows_fit(f, shape.hidden, shape.moe_intermediate))}

    def _refuse(self, shape: ModelShape, per_layer: dict[int, int], gpu: list[int], need: int, budget: int,
                budget_from: Optional[str], fixed: int, cache: int, buffers: int, kv_min: int,
                reserve: int, dense: int) -> None:  # fmt: skip
        n = len(shape.moe_layers)
        fit, room = 0, budget - fixed
        for i in sorted(gpu, reverse=True):
            if per_layer[i] > room:
                break
            room -= per_layer[i]
            fit += 1
        ctx_tokens = kv_min // shape.kv_bytes_per_token if shape.kv_bytes_per_token else 0
        parts = [f"dense weights {gib(dense)} ({self.dense_form})",
                 f"routed experts of {len(gpu)} layers {gib(sum(per_layer[i] for i in gpu))}",
                 f"KV cache for {ctx_tokens} tokens {gib(kv_min)}", f"step reserve {gib(reserve)} ({self.reserve_detail})"]
        if cache:
            parts.append(f"expert cache {gib(cache)} (--moe-cache-size)")
        if buffers:
            parts.append(f"streaming buffers {gib(buffers)} (--moe-stream-prefill off saves them, "
                         "--moe-stream-windows N shrinks them)")
        if self.dense_form in ("dequantized", "both") and shape.dense_file_bytes is not None:
            parts[0] += (f"; --gpu-dense packed keeps the file's blocks alone: about "
                         f"{gib(shape.dense_file_bytes + shape.dense_scratch_bytes)}")
        advice = (f"Keep at most {fit} layers' experts on the GPU: --moe-cpu-layers {n - min(fit, n)} (or 'all'), "
                  "or raise the GPU memory limit." if fixed <= budget else
                  "Even the dense part does not fit: raise --gpu-memory-limit/--gpu-memory-utilization, lower "
                  "--max-model-len" + (" or --moe-cache-size." if cache else "."))
        raise MemoryPlanError(f"the model's GPU part does not fit: {gib(need)} needed ({', '.join(parts)}) but the "
                              f"budget is {gib(budget)} ({budget_from}). {advice}")


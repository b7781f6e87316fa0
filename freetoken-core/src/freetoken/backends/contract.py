"""The backend contract: read this module first to write a FreeToken backend.

A backend moves one hybrid MoE layer's work between a GPU stream and the CPU
expert workers of ``freetoken-cpu-moe``. It provides one object per capability:

* :class:`GpuSync`      -- ordering between a GPU stream and the CPU workers.
* :class:`KernelIO`     -- mapped-memory publish/combine kernels (no copies).
* :class:`Staging`      -- pinned/mapped host buffers and registered expert banks.
* :class:`GraphCapture` -- capture/replay of decode steps per batch size.
* :class:`Backend`      -- name, API version, priority, ``probe()``, capabilities
  and the factories for the four objects above.

The engine seam: the engine runs a model only through :meth:`Backend.open_model`, which
returns a :class:`ModelSession` -- the :class:`WeightPolicy` (how dense weights are held
and run), the routed-experts function of each MoE layer (:meth:`ModelSession.routed_experts`),
the model-start hook (qualification, decode graphs), the step (eager or graph replay) and
the report shown in ``/health`` and ``freetoken doctor``. The engine never branches on the
device type and never looks for methods this module does not declare. Backends whose MoE
layers run routed experts on the CPU get that half from ``freetoken-cpu-moe`` through
:class:`CpuExperts`.

The hand-off itself happens on a :class:`HandoffTask`: one per (layer, batch-size
slot), with stable host buffers and a flag slot whose C layout lives in
``include/freetoken/handoff.h`` (mirrored by :mod:`freetoken.handoff`). The
protocol per hand-off is::

    GPU  : inputs visible in host memory, then ready = 1
    CPU  : sees ready == 1 (acquire), ready = 0, computes, writes y, done = 1 (release)
    GPU  : waits done == 1, reads y, done = 0

Streams are passed as integer handles (``torch.cuda.current_stream().cuda_stream``)
and buffers as torch tensors; native code only ever sees raw addresses, so a
backend's extension never links libtorch.

A backend is published through the ``freetoken.backends`` entry point group; the
entry point names a module or object implementing the pluggy hook
``freetoken_backend()`` (see :mod:`freetoken.backends.hookspecs`) which returns the
:class:`Backend` subclass.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import enum
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

from freetoken import handoff
from freetoken.backends.handoff_task import HandoffError, HandoffTask, HostBuffer, allocate_task

#: Version of this contract. A backend declares the version it implements in
#: ``Backend.api_version``; the registry refuses a backend whose value differs.
BACKEND_API_VERSION = 1


class SyncMode(str, enum.Enum):
    """How a :class:`GpuSync` orders a stream against the CPU workers."""

    STREAM_MEMOPS = "stream_memops"
    """``cuStreamWriteValue64``/``cuStreamWaitValue64`` (graph-capturable)."""
    EVENT_MEMOPS = "event_memops"
    """HIP: a system-release event recorded between the copies and the memop ready write
    (as an external event-record node under capture, so graph replays keep the order)."""
    HOST_CALLBACK = "host_callback"
    """Host functions on the stream (``cudaLaunchHostFunc``/``hipStreamAddCallback``) submit
    and wait (eager only)."""
    FLAG_WAIT_KERNEL = "flag_wait_kernel"
    """A GPU kernel spinning on the flag (when memops are missing)."""
    SYNCHRONOUS = "synchronous"
    """No GPU: the CPU backend runs the task at publish time."""


class IOPath(str, enum.Enum):
    """How activations reach the CPU and results come back."""

    KERNEL_IO = "kernel_io"
    """Publish/combine kernels on mapped memory (BF16 only)."""
    COPY = "copy"
    """D2H copies + memop ready; memop wait + H2D + add (any dtype)."""
    HOST_CALLBACK = "host_callback"
    """Copies ordered by host callbacks (eager only)."""
    SYNCHRONOUS = "synchronous"
    """The CPU backend: the layer calls the CPU kernels directly."""


@dataclasses.dataclass
class ProbeResult:
    """What :meth:`Backend.probe` found: is the hardware there, and why not."""

    available: bool
    reason: str = ""
    device_name: Optional[str] = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Capabilities:
    """Capability flags a backend reports (shown by ``freetoken doctor``).

    ``None`` means "not probed / unknown"; probes fill these with real answers.
    """

    stream_memops: Optional[bool] = None
    mapped_memory: Optional[bool] = None
    graph_capture: Optional[bool] = None
    memops_in_graphs: Optional[bool] = None
    kernel_io: Optional[bool] = None
    host_callbacks: Optional[bool] = None
    flag_wait_kernel: Optional[bool] = None
    event_memops: Optional[bool] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BackendError(RuntimeError):
    """A backend could not be found, loaded, probed or selected."""


# --------------------------------------------------------------------------------------
# Capabilities
# --------------------------------------------------------------------------------------


class GpuSync(abc.ABC):
    """Ordering between one GPU stream and the CPU workers, on a task's flag slot.

    Both methods only *enqueue* work on ``stream``; neither blocks the host (except
    in :attr:`SyncMode.SYNCHRONOUS`). Both must be capturable into a graph unless
    :attr:`graph_safe` is False.
    """

    mode: ClassVar[SyncMode]
    graph_safe: ClassVar[bool] = True

    @abc.abstractmethod
    def publish(self, stream: int, task: HandoffTask) -> None:
        """Raise ``ready`` on ``task`` after everything enqueued before it.

        Guarantee: every kernel and copy enqueued on ``stream`` before this call has
        completed and its writes to host memory are visible to a CPU thread that
        reads ``ready == 1`` with acquire ordering.
        """

    @abc.abstractmethod
    def wait(self, stream: int, task: HandoffTask) -> None:
        """Hold later work on ``stream`` until the CPU set ``done``, then reset it.

        Guarantee: work enqueued on ``stream`` after this call starts only after the
        CPU release-stored ``done == 1``, so it observes every write the CPU made to
        ``task.y`` before that store; ``done`` is back to 0 before the next hand-off
        on the same slot can be published.
        """


class KernelIO(abc.ABC):
    """Mapped-memory publish/combine kernels: no copies, no events.

    BF16 activations only; other dtypes use the copy path.
    """

    @abc.abstractmethod
    def publish(self, stream: int, task: HandoffTask, x: Any, cpu_ids: Any, weights: Any) -> None:
        """Store ``x``, ``cpu_ids`` (-1 = GPU route) and ``weights`` into the task's
        mapped buffers, fence at system scope, then raise ``ready``.

        Guarantee: the CPU reading ``ready == 1`` (acquire) sees all stored values.
        When no route of the batch goes to the CPU the kernel completes the task
        itself (``done`` semantics satisfied) without waking the CPU.
        """

    @abc.abstractmethod
    def combine(self, stream: int, task: HandoffTask, out: Any) -> None:
        """Wait for ``done``, then ``out += y_cpu`` (read from mapped memory), reset.

        Guarantee: the add reads ``y`` only after observing ``done == 1``; later work
        on ``stream`` sees the combined ``out``.
        """

    @abc.abstractmethod
    def probe(self) -> bool:
        """Exercise publish/combine on random data, eager and captured; True if exact."""


class Staging(abc.ABC):
    """Host memory the GPU can reach, and the expert-cache fetches that use it."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        """Allocate page-locked host memory (mapped into the GPU's space if asked).

        Guarantee: the memory stays valid while the returned buffer (or its
        ``tensor``) is alive; device_ptr is valid for kernels on any stream.
        """

    @abc.abstractmethod
    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        """Lock an existing host tensor (an expert bank) and register it with the
        driver so H2D copies from it run at full speed. ``mapped``: kernels may also read
        it in place (the handle's ``device_ptr`` is its device address); ``read_only``:
        the memory is a read-only mapping (a model file). Returns a handle whose lifetime
        bounds the registration (raises if the driver refuses); the tensor must outlive it."""

    @abc.abstractmethod
    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        """Enqueue an H2D copy of ``src`` (registered host) into ``dst`` (device).

        Guarantee: work enqueued on ``stream`` after this call sees ``dst`` filled.
        """

    def new_task(
        self,
        layer: int,
        slot: int,
        max_tokens: int,
        top_k: int,
        hidden: int,
        act_dtype: Any,
        out_dtype: Any,
        bank_addr: int = 0,
        mapped: bool = True,
    ) -> HandoffTask:
        """Allocate the stable buffers and descriptors of one hand-off task."""
        return allocate_task(
            self, layer, slot, max_tokens, top_k, hidden, act_dtype, out_dtype, bank_addr, mapped
        )


class PackedGemv(abc.ABC):
    """One token through a dense matrix kept on the device as a GGUF file's blocks, by the
    backend's own kernels (what it refuses runs through the engine's Triton kernels); and,
    where the backend has them, a few tokens through their routed experts kept so
    (:meth:`experts`)."""

    #: what reports call it
    name: ClassVar[str]

    @abc.abstractmethod
    def refusal(self, fmt: int, cols: int, dtype: Any) -> str:
        """'' when :meth:`gemv` serves matrices of this ggml format and width with
        activations of ``dtype`` (a torch dtype), else why not."""

    @abc.abstractmethod
    def gemv(self, x: Any, data: Any, fmt: int, y: Any) -> None:
        """``y [1, N] = x [1, K] @ W.T`` on the device's current stream (capturable in
        graphs): ``W``'s rows are those of ``data`` (``[N, row_bytes]`` uint8 on the device,
        ``fmt``'s blocks), ``x`` and ``y`` contiguous tensors on the device."""

    #: the most matrices one :meth:`norm_gemv` call takes (0: it has none)
    norm_parts: ClassVar[int] = 0

    def norm_gemv(self, h: Any, delta: Any, weight: Any, eps: float,
                  parts: Sequence[tuple[Any, int]]) -> Optional[tuple[Any, Any, list[Any]]]:  # fmt: skip
        """A decoder's pre-norm and the projections that read it, for one token, in one launch:
        ``x = weight * rmsnorm(h + delta)`` (``delta`` None: ``h``; rounded to the activation
        dtype where :meth:`freetoken.models.dense_ops.DenseOps.add_rms_norm` rounds), then
        ``x @ W.T`` for each ``(data, fmt)`` of ``parts`` (as :meth:`gemv`'s). Returns
        ``(h + delta, x, [y per part])`` in ``h``'s dtype, or None where it declines (the
        caller runs the norm and :meth:`gemv`). This implementation: None."""
        return None

    @property
    def serves_experts(self) -> bool:
        """Whether :meth:`experts` runs anything (for some formats). This implementation: False."""
        return False

    def experts_refusal(self, formats: tuple[int, int, int], hidden: int, intermediate: int, top_k: int,
                        activation: str, dtype: Any) -> str:  # fmt: skip
        """'' when :meth:`experts` serves experts whose gate, up and down have these ggml
        ``formats``, of these sizes, ``top_k`` routes per token, this activation and
        activations of ``dtype``; else why not. This implementation: it has no such kernels."""
        return f"{self.name} has no routed-expert kernels"

    def experts(self, x: Any, ids: Any, w: Any, stacks: Sequence[Any], y: Any, table: Any = None) -> None:
        """``y [T, H] = sum_k w[t, k] * down_e(act(gate_e x_t) * up_e x_t)`` for ``e = ids[t, k]``
        (``table[ids[t, k]]`` with a slot table, int32 on the device; routes to -1 add nothing),
        on the device's current stream (capturable in graphs). ``stacks``: gate, up
        (``[E, I, row_bytes]``) and down (``[E, H, row_bytes]``) as
        :class:`freetoken.kernels.moe_packed.PackedStack`; ``x [T, H]``, ``ids`` and ``w
        [T, K]``, ``y [T, H]`` contiguous on the device. Only where :meth:`experts_refusal` is ''."""
        raise NotImplementedError(self.experts_refusal((0, 0, 0), 0, 0, 0, "", None))


class CapturedGraph(abc.ABC):
    """One captured decode step for one batch size."""

    @abc.abstractmethod
    def replay(self, stream: Optional[int] = None) -> None:
        """Launch the captured work; same ordering as running it eagerly."""


class GraphCapture(abc.ABC):
    """Capture and replay of decode steps per batch size."""

    @abc.abstractmethod
    def capture(self, fn: Callable[[], Any], stream: Optional[int] = None) -> CapturedGraph:
        """Run ``fn`` under stream capture and return the graph.

        Guarantee: GpuSync/KernelIO operations enqueued by ``fn`` are present in the
        graph (natively or as explicit nodes), and the flag slots are not written
        during capture.
        """

    def memops_captured_natively(self) -> Optional[bool]:
        """Whether stream capture records memops as graph nodes (None: unknown)."""
        return None


# --------------------------------------------------------------------------------------
# The engine seam: what the engine needs from a backend to run a model
# --------------------------------------------------------------------------------------

#: ``experts(x [T, H], ids [T, K] int32, weights [T, K] float32) -> y [T, H]`` in x's dtype:
#: the routed experts of one MoE layer (the weighted sum over each token's top-k routes).
ExpertsFn = Callable[[Any, Any, Any], Any]


class Linear(Protocol):
    """A runnable projection ``y = x @ W.T`` (what :meth:`WeightPolicy.linear` returns)."""

    out_features: int
    in_features: int
    nbytes: int  # bytes of weight one call reads

    def __call__(self, x: Any) -> Any: ...


class WeightPolicy(abc.ABC):
    """How a backend holds and runs a model's dense weights (everything but the routed
    experts): which checkpoint formats stay packed, which are dequantized, on which
    device, and the linear that runs them. Model code turns every
    :class:`~freetoken.loading.tensors.RawTensor` into something runnable through it.

    Ordering: the returned tensors and linears live on :attr:`device`; calling a linear
    enqueues work on that device's current stream (or runs it, on the CPU) like any torch op.
    """

    device: Any  # torch.device of the dense part
    dtype: Any  # activation dtype

    @abc.abstractmethod
    def tensor(self, raw: Any) -> Any:
        """A small float tensor in :attr:`dtype` on :attr:`device` (norm weights, biases)."""

    @abc.abstractmethod
    def linear(self, raw: Any) -> Linear:
        """A projection over the 2-D ``raw`` (``[out, in]``), input and output in :attr:`dtype`."""

    @abc.abstractmethod
    def router(self, raw: Any) -> Linear:
        """The router projection of a MoE layer: output logits in float32."""

    @abc.abstractmethod
    def embedding(self, raw: Any) -> Callable[[Any], Any]:
        """Token embedding lookup: int64 ids ``[T]`` -> ``[T, hidden]`` in :attr:`dtype`."""

    def stacked_linear(self, raws: list[Any]) -> Optional[Linear]:
        """One projection over several matrices of the same input width stacked along their
        rows (q/k/v of a layer), whatever their formats, or None when this policy only
        stacks matrices of one format (the caller then groups by format)."""
        return None

    def describe(self) -> dict[str, Any]:
        """What this policy does with each format (shown in the startup log and /health)."""
        return {}


@dataclasses.dataclass
class MoELayerSpec:
    """One MoE layer's routed experts, as a backend gets them to build the layer's
    :data:`ExpertsFn`. ``experts`` is a :class:`freetoken.models.moe_layer.ExpertWeights`
    (gate/up ``[E, I, H]``, down ``[E, H, I]`` in their checkpoint format, host memory)."""

    layer: int
    experts: Any
    top_k: int
    activation: str  # "silu", "gelu_tanh" or "swiglu_oai"


@dataclasses.dataclass
class ModelShape:
    """What a backend needs to plan memory before any weight is loaded."""

    num_layers: int
    moe_layers: list[int]  # indices of the layers with routed experts
    hidden: int
    num_experts: int
    moe_intermediate: int
    top_k: int
    dense_bytes: int  # the dense part (attention, norms, routers, embedding, head) at the activation dtype
    kv_bytes_per_token: int
    #: per MoE layer: its routed experts' bytes as the host holds them (the checkpoint's; with
    #: folded biases where the family has expert biases), and the formats (ggml types, or
    #: ``Fmt``) of (gate, up, down), read from a GGUF header or an HF checkpoint's expert
    #: tensors (None: unknown; an HF checkpoint gives the bytes only for MXFP4 experts)
    expert_file_bytes: Optional[dict[int, int]] = None
    expert_formats: Optional[dict[int, tuple[int, int, int]]] = None
    #: the dense part as it takes device memory when the file's block formats (Q4_K, Q5_K,
    #: Q6_K, Q8_0) stay packed: their bytes in the file, other tensors at the activation
    #: dtype, routers float32 (None: no packed form known, e.g. HF files)
    dense_file_bytes: Optional[int] = None
    #: the prefill scratch of that form (the largest packed linear's chunk of rows dequantized)
    dense_scratch_bytes: int = 0
    #: of ``dense_file_bytes``: the token embedding's packed bytes when it is not also the
    #: output head (what ``gpu_embedding`` ``host`` keeps off the device; 0: none such)
    embedding_file_bytes: int = 0


@dataclasses.dataclass
class MoEOptions:
    """How a GPU backend keeps and moves routed experts (``freetoken serve --moe-*``).

    ``gpu_experts``: the form of GPU-resident experts: ``auto`` keeps GGUF block formats
    the GPU kernels read (Q4_K, Q5_K, Q6_K, Q8_0) packed, as in the file, and dequantizes
    the others to the activation dtype; ``dequantized`` always dequantizes.
    ``cache_bytes`` / ``cache_fraction``: the global expert cache for the CPU layers' experts
    (bytes, or a fraction of the memory budget; 0: none). ``hybrid_max_fetch``: experts
    per layer and step copied into the cache for later steps (the most routed uncached ones,
    each replacing a clearly less routed cached one; ``freetoken.moe.experts.expert_cache``).
    ``stream_prefill``: ``auto`` (prefill chunks of at least ``stream_min_tokens`` tokens
    compute the CPU layers' experts on the GPU, their bytes streamed over PCIe; None: the
    threshold from a measured profile), ``on``, ``off``; ``stream_experts``: ``routed`` copies
    only the experts the chunk routes to, once its router has run, ``all`` every expert of
    the layer, the next layer's copy overlapping this one's compute; ``stream_windows``:
    ``routed`` streams a layer in this many windows of experts through one buffer of a
    window's bytes (more windows: less device memory). ``lock_host``: register (page-lock)
    the host expert banks with the driver (``auto``: when streaming or fetching uses them).
    ``locked_fetch``: share of a decode step's missed routes that the GPU computes from the
    page-locked banks in the same step (at most ``locked_max_fetch`` per layer; 0: off; None:
    ``auto``, :func:`freetoken.moe.experts.locked_fetch.planned_fraction`), its kernels reading them
    from device slots a gather kernel first copies them into.
    ``collect_stats`` with the log summary every ``stats_interval_s`` seconds.
    ``gpu_kernel``: what runs a decode step's routes through packed GPU experts: ``native``
    (the backend's :meth:`PackedGemv.experts`), ``triton`` (the engine's Triton kernels), or
    ``auto`` (native for the formats and shapes it serves, where the backend has it).
    """

    gpu_experts: str = "auto"
    cache_bytes: int = 0
    cache_fraction: float = 0.0
    hybrid_max_fetch: int = 0
    stream_prefill: str = "auto"
    stream_min_tokens: Optional[int] = None
    stream_experts: str = "routed"
    stream_windows: int = 4
    lock_host: str = "auto"
    locked_fetch: Optional[float] = None
    locked_max_fetch: int = 2
    collect_stats: bool = False
    stats_interval_s: float = 60.0
    gpu_kernel: str = "auto"


@dataclasses.dataclass
class EngineOptions:
    """The engine settings a backend acts on (from ``freetoken serve``/``generate``/``bench``).

    ``moe_cpu_layers``: which layers' routed experts run on the CPU workers: a count (the
    first N MoE layers), a list/range of layer indices (``"0-11,40"``) or ``"all"``
    (:func:`freetoken.moe.placement.cpu_layers`); None is the backend's default (a GPU
    backend: as many layers on the GPU as the memory allows).
    ``cpu_threads``: CPU expert workers (None: the backend's default).
    ``cpu_spin_ms``: how long the CPU expert workers spin after a hand-off before they sleep
    (None: longer than a decode step on a GPU device, the CPU experts' default elsewhere).
    ``graphs``: decode-graph settings; ``graph_batch_sizes`` an explicit list of buckets,
    else powers of two (and multiples of 8) up to ``graph_max_batch_size``.
    ``gpu_memory_limit`` (bytes) and ``gpu_memory_utilization`` (fraction of the device's
    total): the most this process may use on the device; the smaller wins.
    ``gpu_dense``: the form of the dense part on the device: ``dequantized`` (the activation
    dtype), ``packed`` (a GGUF file's block formats kept as in the file), or ``auto``
    (packed when that lets more layers' experts onto the device, or is needed to fit).
    ``gpu_embedding``: where a packed token embedding's table lives: ``device``, ``host``
    (page-locked host memory the GPU reads a step's rows from over PCIe; not for an embedding
    that is also the output head), or ``auto`` (host when the memory plan leaves layers'
    experts on the CPU, so its bytes go to expert layers instead).
    ``gpu_gemv``: what runs one token through a packed dense matrix: ``native`` (the
    backend's :class:`PackedGemv`), ``triton`` (the engine's Triton kernels), or ``auto``
    (native for the formats it serves, where the backend has one).
    ``pin_host_threads``: ``on`` (on a GPU device whose model has CPU expert layers, the
    threads that step the model and enqueue expert copies run on the CPUs the expert
    workers leave free, :mod:`freetoken.moe.session.host_threads`) or ``off``.
    """

    act_dtype: Any = None
    moe_cpu_layers: Optional[str] = None
    cpu_threads: Optional[int] = None
    cpu_spin_ms: Optional[float] = None
    graphs: bool = True
    graph_batch_sizes: Optional[list[int]] = None
    graph_max_batch_size: int = 16
    gpu_memory_limit: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    max_running_requests: int = 16
    max_model_len: int = 4096
    kv_block_size: int = 16
    kv_cache_tokens: Optional[int] = None  # an explicit KV cache size (the plan keeps room for it)
    gpu_dense: str = "auto"
    gpu_embedding: str = "auto"
    gpu_gemv: str = "auto"
    pin_host_threads: str = "on"
    moe: MoEOptions = dataclasses.field(default_factory=lambda: MoEOptions())


class ModelSession(abc.ABC):
    """Everything one loaded model needs from a backend; the engine talks to nothing else.

    The engine calls, in this order: :meth:`plan` (before loading: may refuse with the
    sizes and the flag to change), :attr:`weight_policy` while the model loads,
    :meth:`routed_experts` once per MoE layer, :meth:`kv_cache_budget` to size the KV
    cache, :meth:`start` once with the loaded model and its KV cache (qualification,
    decode-graph preparation), then :meth:`forward` once per step from one thread (after a
    step whose sampled requests are all plain greedy ones, :meth:`greedy_tokens`), and
    :meth:`close` at the end. :meth:`report` may be called at any time after
    :meth:`start` (``/health``, ``/metrics``, ``freetoken doctor``).
    """

    weight_policy: WeightPolicy

    def plan(self, shape: ModelShape) -> None:
        """Check the model fits this backend's memory with the options; raise
        :class:`MemoryPlanError` naming the sizes and the flag to change if not."""

    @abc.abstractmethod
    def routed_experts(self, spec: MoELayerSpec) -> ExpertsFn:
        """The experts function of one MoE layer. Ordering: its result is ready for the
        next operation on the dense device's stream (no host wait needed)."""

    def kv_cache_budget(self) -> Optional[int]:
        """Bytes the KV cache may take on the dense device, or None (the engine decides)."""
        return None

    @abc.abstractmethod
    def start(self, model: Any, kv: Any) -> None:
        """The model is loaded and its KV cache allocated (``kv``:
        :class:`freetoken.engine.kv_cache.KVCache`; a session may take blocks from it for
        its own use, e.g. a scratch block for padded graph rows): qualify the hand-off,
        prepare decode graphs. Raises (with the reason) when the model must not be served."""

    @abc.abstractmethod
    def forward(self, input_ids: Any, positions: Any, meta: Any) -> Any:
        """One step: the model's final hidden states for ``input_ids`` at ``positions``
        (``meta``: :class:`freetoken.models.attention.AttentionMetadata`). Eager or by
        graph replay; the result is valid until the next call."""

    def greedy_tokens(self, hidden: Any) -> Optional[list[int]]:
        """The greedy token of each row of ``hidden`` (final hidden states ``[B, hidden]`` from
        :meth:`forward`, the rows that sample): the index of the first largest value of the
        row of ``model.compute_logits(hidden)``, a NaN counting as the largest (as
        :func:`freetoken.engine.sampling.argmax_rows`), found without handing the logits to
        the engine; or None (the default: no such way), and the engine computes the logits
        and samples from them. The engine asks only when every sampled request is greedy with
        no penalty, constraint or log-probabilities, and no logits observer is registered."""
        return None

    def decode_ahead(self, input_ids: Any, positions: Any, meta: Any) -> Optional[Any]:
        """Launch a decode step whose token ids are still on the device (``input_ids``: the
        previous step's greedy tokens, not yet read back; ``meta.host_ids`` is None) and
        return its final hidden states as :meth:`forward` does, without waiting for the
        device; or None (the default: this session cannot), and the engine runs the step
        once the tokens are on the host. The inputs the engine made for such a step reach
        the device by non-blocking copies; the session must not wait on the device either
        (the point is that the host's work between two steps overlaps the step in flight)."""
        return None

    @abc.abstractmethod
    def report(self) -> dict[str, Any]:
        """The backend's decisions for this model: at least ``backend``, ``io_path``,
        ``sync_mode``, ``graphs`` (bool) and ``reason``; shown in ``/health`` and doctor."""

    def start_stage_trace(self) -> bool:
        """Start recording where batch-1 decode steps spend their time (a diagnostic for
        ``freetoken bench decode --stages``); False when this session records nothing."""
        return False

    def stage_split(self) -> Optional[dict[str, float]]:
        """Medians in microseconds of the stages of the decode steps since
        :meth:`start_stage_trace` (names as :func:`freetoken.moe.session.stage_trace.split_trace`),
        or None when nothing was recorded."""
        return None

    def close(self) -> None:
        """Release workers, tasks and graphs."""


class CpuExperts(abc.ABC):
    """The CPU half of MoE layers: expert banks over checkpoint bytes in host memory, the
    synchronous kernels, and the coordinator that serves hand-off tasks from a GPU stream.
    ``freetoken-cpu-moe`` implements it (``freetoken_cpu_moe.host_experts``)."""

    @abc.abstractmethod
    def bank(self, experts: Any, activation: str) -> Any:
        """A bank over ``experts`` (:class:`freetoken.models.moe_layer.ExpertWeights`) without
        copying them; its ``address`` goes into hand-off task descriptors and it keeps
        the weights alive."""

    @abc.abstractmethod
    def run(self, bank: Any, x: Any, ids: Any, weights: Any, out_dtype: Any = None) -> Any:
        """Synchronously: ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` over routes with
        ``ids >= 0`` (host tensors; result in ``out_dtype``, default x's dtype)."""

    @abc.abstractmethod
    def coordinator(self, threads: Optional[int] = None, watchdog_ms: float = 2000.0,
                    spin_us: Optional[float] = None) -> Any:
        """A started coordinator with ``add_task(desc_addr)``, ``remove_task(desc_addr)``,
        ``stop()`` and ``free_cpus()`` (the logical CPUs on physical cores none of its workers
        is pinned to; empty if they are not pinned): it serves the tasks' hand-offs on
        ``threads`` CPU workers (None: the implementation's default, which leaves a core to
        the thread driving the GPU); after a hand-off they spin ``spin_us`` microseconds for
        the next before they sleep (None: the implementation's default)."""


class MemoryPlanError(ValueError):
    """The model's part on the device does not fit; the message names sizes and flags."""


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------


class Backend(abc.ABC):
    """A FreeToken backend: identity, probe, capabilities and factories.

    Class attributes a plugin sets:

    * ``name``        -- what ``--backend``/``FREETOKEN_BACKEND`` select by.
    * ``api_version`` -- must equal :data:`BACKEND_API_VERSION`.
    * ``priority``    -- breaks ties when several plugins claim the same hardware;
      higher wins.
    * ``hardware``    -- "cuda", "rocm" or "cpu": which automatic rule picks it.
    """

    name: ClassVar[str]
    api_version: ClassVar[int] = BACKEND_API_VERSION
    priority: ClassVar[int] = 0
    hardware: ClassVar[str] = "cpu"

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> ProbeResult:
        """Is the hardware this backend drives present and usable? Never raises
        for absent hardware: returns ``available=False`` with the reason."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Run the capability probes (memops, mapped memory, graph capture...)."""

    @abc.abstractmethod
    def device(self) -> Any:
        """The ``torch.device`` the dense part of a model runs on."""

    @abc.abstractmethod
    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        """A GpuSync in ``mode`` (default: the best the device supports)."""

    @abc.abstractmethod
    def staging(self) -> Staging:
        """The backend's Staging."""

    def kernel_io(self) -> Optional[KernelIO]:
        """The KernelIO, or None when the backend has none."""
        return None

    def copy_sync_modes(self, graphs: bool) -> list[SyncMode]:
        """The GpuSync modes the copy path may use on this device, best first (graph
        capturable ones first when ``graphs``); startup qualification takes the first and
        checks it. Empty: the backend's default (:meth:`gpu_sync` with no mode)."""
        return []

    def graph_capture(self) -> Optional[GraphCapture]:
        """The GraphCapture, or None when graphs are not supported."""
        return None

    def packed_gemv(self) -> Optional[PackedGemv]:
        """The backend's one-token GEMV over packed blocks, or None when it has none."""
        return None

    def current_stream(self) -> int:
        """Handle of the current stream of :meth:`device` (0 when there is none)."""
        return 0

    def synchronize(self) -> None:
        """Block the host until all work on the device is complete."""

    #: The activation dtype ``--dtype auto`` means on this backend.
    default_dtype: ClassVar[str] = "bfloat16"

    @abc.abstractmethod
    def open_model(self, options: EngineOptions) -> ModelSession:
        """A :class:`ModelSession` for one model with these options (the engine seam)."""

    def cpu_experts(self) -> Optional["CpuExperts"]:
        """The CPU half of hybrid MoE layers, for backends that hand routes to the CPU
        workers (None: this backend never does)."""
        return None

    def device_memory(self) -> Optional[tuple[int, int]]:
        """``(free, total)`` bytes of the dense device's memory, or None when it has no
        memory of its own to plan (the host)."""
        return None

    def stream_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a graph now (False without graphs).

        Work recorded while this is True is not executed until replay, so host-side
        writes (e.g. a task's ``num_tokens``) must not depend on it."""
        return False


def flag_slot_at(address: int) -> handoff.FlagSlot:
    """A ctypes view of the flag slot at a host address."""
    return handoff.FlagSlot.from_address(address)


def c_address(obj: ctypes.Structure) -> int:
    """Address of a ctypes structure."""
    return ctypes.addressof(obj)

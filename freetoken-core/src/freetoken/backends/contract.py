"""The backend contract: read this module first to write a FreeToken backend.

A backend moves one hybrid MoE layer's work between a GPU stream and the CPU
expert workers of ``freetoken-cpu-moe``. :class:`Backend` declares its name, API version,
priority, ``probe()``, capabilities and the factories of the parts it provides:

* the hand-off primitives of :mod:`freetoken.backends.handoff_io` -- :class:`GpuSync`
  (ordering between a GPU stream and the CPU workers), :class:`KernelIO` (mapped-memory
  publish/combine kernels, no copies), :class:`Staging` (pinned/mapped host buffers and
  registered expert banks) on a :class:`~freetoken.backends.handoff_io.HandoffTask`;
* :class:`GraphCapture` -- capture/replay of decode steps per batch size;
* :class:`PackedGemv` -- native kernels over a GGUF file's blocks on the device.

The engine seam: the engine runs a model only through :meth:`Backend.open_model` (with the
:class:`~freetoken.backends.options.EngineOptions`), which returns a :class:`ModelSession`
-- the :class:`WeightPolicy` (how dense weights are held and run), the routed-experts
function of each MoE layer (:meth:`ModelSession.routed_experts`), the model-start hook
(qualification, decode graphs), the step (eager or graph replay) and the report shown in
``/health`` and ``freetoken doctor``. The engine and the MoE code ask a backend and its
parts only what this module and :mod:`~freetoken.backends.handoff_io` declare (each optional
capability has a default here), never branch on which backend it is, and ask "a real GPU,
or the host standing in for one?" only through :func:`on_gpu`. Backends whose MoE layers
run routed experts on the CPU get that half from ``freetoken-cpu-moe`` through
:class:`CpuExperts`.

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
import dataclasses
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

from freetoken.backends.handoff_io import GpuSync, KernelIO, Staging, SyncMode
from freetoken.backends.options import CPU_PREFILL_CHUNK, EngineOptions

#: Version of this contract. A backend declares the version it implements in
#: ``Backend.api_version``; the registry refuses a backend whose value differs.
BACKEND_API_VERSION = 1

#: The clamped SwiGLU of GPT-OSS's experts (activation ``swiglu_oai``):
#: ``min(g, LIMIT) * sigmoid(ALPHA * min(g, LIMIT)) * (clamp(u, -LIMIT, LIMIT) + 1)``.
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def on_gpu(device: Any) -> bool:
    """Whether ``device`` is a GPU (torch's ``cuda`` device type: NVIDIA, and AMD through
    HIP) rather than the host standing in for one (the CPU backend, and the test backends
    that run the GPU code paths on host tensors). The one question of this kind the engine
    and the MoE code ask; what a GPU offers beyond that is in :class:`Capabilities`."""
    import torch

    return torch.device(device).type == "cuda"


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

    def experts(self, x: Any, ids: Any, w: Any, stacks: Sequence[Any], y: Any, table: Any = None,
                activation: str = "silu") -> None:  # fmt: skip
        """``y [T, H] = sum_k w[t, k] * down_e(act(gate_e x_t, up_e x_t))`` for ``e = ids[t, k]``
        (``table[ids[t, k]]`` with a slot table, int32 on the device; routes to -1 add nothing),
        ``act`` the gated ``activation`` (``silu``: ``silu(g) * u``; ``swiglu_oai``: see
        :data:`SWIGLU_OAI_ALPHA`),
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

#: work of a MoE layer that does not depend on its routed experts (a shared expert): a
#: no-argument callable returning a new ``[T, H]`` tensor in x's dtype, added to their output
BesideFn = Callable[[], Any]


def plus_beside(y: Any, beside: Optional[BesideFn]) -> Any:
    """The experts' output ``y`` plus the beside work's, computed now (``y`` if none)."""
    return y if beside is None else y + beside()


@dataclasses.dataclass(frozen=True)
class OverlappedExpertsFn:
    """An :data:`ExpertsFn` that can also take the layer's :data:`BesideFn` and run it while
    the routed experts run elsewhere (a hybrid layer: after the hand-off to the CPU, before
    its result is awaited), returning the experts' output plus the beside work's. Called
    with three arguments it is the plain experts function."""

    run: Callable[[Any, Any, Any, Optional[BesideFn]], Any]

    def __call__(self, x: Any, ids: Any, w: Any) -> Any:
        return self.run(x, ids, w, None)


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

    def output_head(self, raw: Any) -> Linear:
        """The output head over the 2-D ``raw`` (``[vocab, hidden]``, the embedding's table
        when tied): :meth:`linear` unless a policy holds heads apart (it runs a row or a few
        per request, never a prompt's every position)."""
        return self.linear(raw)

    def stacked_linear(self, raws: list[Any]) -> Optional[Linear]:
        """One projection over several matrices of the same input width stacked along their
        rows (q/k/v of a layer), whatever their formats, or None when this policy only
        stacks matrices of one format (the caller then groups by format)."""
        return None

    def head_linear(self, raw: Any) -> Optional[Callable[[Any], Any]]:
        """One projection per head over the 3-D ``raw`` (``[heads, out, in]``): input ``[T,
        heads, in]`` -> output ``[T, heads, out]``, both in :attr:`dtype` (the absorbed
        up-projections of multi-head latent attention); or None when this policy has none
        (the caller then runs the dequantized weights)."""
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
    #: the copies at the activation dtype that ``gpu_dense`` ``both`` keeps beside the blocks
    #: for prompts: every packed 2-D matrix but the embedding and the output head
    prompt_copy_bytes: int = 0
    #: device bytes per token of a prompt chunk's activations at their peak inside a layer
    #: (:func:`freetoken.models.loader.activation_bytes_per_token`; 0: not known)
    activation_bytes_per_token: int = 0


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

    def kv_cache_allocated(self, nbytes: int) -> None:
        """The engine allocated ``nbytes`` of :meth:`kv_cache_budget` (its KV cache and any
        recurrent state), before :meth:`start`: a session may give the rest to its own uses."""

    def prefill_chunk(self, requested: Optional[int]) -> int:
        """The most prompt tokens one step may compute, given ``requested`` (the engine's
        ``prefill_chunk``; None: the default for the session's device): what the session's
        memory plan holds the activations of (the default: as requested, else
        :data:`~freetoken.backends.options.CPU_PREFILL_CHUNK`)."""
        return requested or CPU_PREFILL_CHUNK

    def warmup_prompt_lengths(self, chunk: int) -> list[int]:
        """Prompt lengths (at most ``chunk``, the engine's prefill chunk) the engine prefills
        once after :meth:`start`, before any request, so that kernels built at their first
        use for a size (a GPU's JIT-compiled kernels) are built then and not inside the first
        users' steps. The default: none."""
        return []

    def warmup_done(self) -> None:
        """The warm-up prefills are over: forget them where the session counts or learns
        from steps (routes, streamed bytes). The default does nothing."""

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

    def step_failed(self) -> None:
        """A step raised and the engine goes on serving: wait for the device work the step
        launched, drop what it left half done, and give back the device memory its
        allocations left cached. The default does nothing (nothing is kept between steps)."""

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
    * ``hardware``    -- "cuda", "rocm" or "cpu": which automatic rule picks it (backend
      selection only: the engine and the MoE code ask the attributes below).
    * ``hands_off``   -- the MoE layers hand CPU routes to the workers across a GPU stream
      (False: the layers call the CPU kernels in place, so there is no hand-off to qualify).
    * ``locked_fetch_share`` -- whether ``--moe-locked-fetch auto`` applies on this backend
      (0: off; a backend sets what was measured to pay on its hardware) and the share of a
      decode step's missed routes the memory plan assumes; where it applies, the session's
      start times the fetched route counts and takes the fastest.
    """

    name: ClassVar[str]
    api_version: ClassVar[int] = BACKEND_API_VERSION
    priority: ClassVar[int] = 0
    hardware: ClassVar[str] = "cpu"
    hands_off: ClassVar[bool] = True
    locked_fetch_share: ClassVar[float] = 0.0

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

    def out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a step, is an allocation that failed because the memory
        it needed was not there (the device's or the host's), rather than a fault. The engine
        then fails the step's largest request with a memory error and recomputes the others,
        instead of failing every request in flight."""
        import torch

        return isinstance(exc, (MemoryError, torch.OutOfMemoryError))

    def stream_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a graph now (False without graphs).

        Work recorded while this is True is not executed until replay, so host-side
        writes (e.g. a task's ``num_tokens``) must not depend on it."""
        return False



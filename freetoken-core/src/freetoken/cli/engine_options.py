"""The engine options shared by ``freetoken serve``, ``generate`` and ``bench decode``.

:func:`add_engine_arguments` registers the flags (one argument group, the same names,
checks and help everywhere); :func:`engine_config_from_args` turns the parsed namespace
into an :class:`~freetoken.engine.config.EngineConfig`. A bad value ends the command
with one error line that names the flag and the accepted forms, and exit status 2
(argparse's usage error), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Union

from freetoken.cli.backend_option import backend_help

if TYPE_CHECKING:
    from freetoken.engine.config import EngineConfig

#: --dtype values (canonical name first) and the aliases the loader also accepts.
DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")
SIZE_FORMS = ("a number of bytes or a size like 16GiB, 24G, 1.5GiB, 512MiB "
              "(K/M/G/T and KiB/MiB/GiB/TiB: powers of 1024; KB/MB/GB/TB: powers of 1000)")


# ---------------------------------------------------------------- value parsers


def parse_size(text: str) -> int:
    """Bytes of ``text``: a whole number of bytes, or a number with a unit (``16GiB``,
    ``24G``, ``1.5GiB``, ``500MB``). Raises ValueError naming the accepted forms."""
    m = _SIZE_RE.match(str(text).lower())
    if m is None or m.group(2) not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: expected {SIZE_FORMS}")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if value < 1:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a whole number >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be >= {minimum}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def any_int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a whole number") from None


def dtype_name(text: str) -> str:
    name = str(text).strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected one of {', '.join(DTYPES)} "
            f"(aliases: {', '.join(sorted(DTYPE_ALIASES))})"
        )
    return name


def layer_spec(text: str) -> str:
    from freetoken.moe.placement import parse_layer_spec

    try:
        parse_layer_spec(text)
    except ValueError as exc:
        msg = str(exc)
        prefix = f"--moe-cpu-layers {text!r}: "
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: {msg[len(prefix):] if msg.startswith(prefix) else msg}"
        ) from None
    return str(text).strip()


def batch_sizes(text: str) -> list[int]:
    forms = "expected comma-separated batch sizes >= 1, like 1,2,4,8"
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {forms}")
    sizes = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: bad item {part!r}; {forms}")
        sizes.append(int(part))
    return sorted(set(sizes))


def fraction(text: str) -> float:
    forms = "expected a fraction of the GPU's total memory in (0, 1], like 0.9"
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {forms}") from None
    if not 0 < value <= 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {forms}")
    return value


def byte_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cache_size(text: str) -> Union[float, str]:
    """``--moe-cache-size``: GiB as a bare number (``8``), a size with a unit (``6GiB``,
    ``512MiB``), or a fraction of the GPU memory budget below 1 (``0.25``); ``0``: no cache;
    ``auto``: the spare memory of a planned placement. Returns bytes, or the fraction when
    below 1, or ``"auto"``."""
    t = str(text).strip().lower()
    if t == "auto":
        return t
    forms = ("expected auto, GiB like 8, a size like 6GiB or 512MiB, a fraction of the GPU memory budget like 0.25, "
             "or 0")
    try:
        value = float(t)
    except ValueError:
        try:
            return float(parse_size(t))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {forms}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {forms}")
    return value if value < 1 else value * (1 << 30)


def _checked_float(text: str, ok: Callable[[float], bool], expected: str) -> float:
    """``text`` as a number for which ``ok`` holds, else a usage error saying what was expected."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {expected}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {expected}")
    return value


def unit_fraction(text: str) -> float:
    return _checked_float(text, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")


def fraction_or_auto(text: str) -> Optional[float]:
    """``auto`` (None) or a fraction in [0, 1]."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return unit_fraction(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected auto or a fraction in [0, 1]") from None


def choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if t not in values:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected one of {', '.join(values)}")
        return t

    return parse


def positive_float(text: str) -> float:
    return _checked_float(text, lambda v: v > 0 and v != float("inf"), "a number > 0")


def spin_ms(text: str) -> float:
    return _checked_float(text, lambda v: 0 <= v <= 1000, "milliseconds in [0, 1000]")


# ---------------------------------------------------------------- the options


@dataclasses.dataclass(frozen=True)
class _Option:
    field: str  # the EngineConfig field (also the argparse dest)
    flag: str
    help: str  # "{default}" is replaced by the default's description
    type: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None
    flag_only: bool = False  # store_true
    turns_off: bool = False  # with flag_only: store_false (the field is on by default)


_OPTIONS: tuple[_Option, ...] = (
    _Option("model", "--model", "HF model directory or .gguf file (default: {default})", str, "PATH"),
    _Option("backend", "--backend", "", str, "NAME"),  # help from backend_option
    _Option("dtype", "--dtype",
            "activation and dense-weight dtype: auto, bfloat16, float16 or float32 "
            "(default: {default}; auto is the backend's choice)", dtype_name, "DTYPE"),
    _Option("kv_cache_dtype", "--kv-cache-dtype",
            "the KV cache's dtype: auto (the activation dtype), bfloat16, float16 or float32; another dtype "
            "than the activations' on the cpu backend only (default: {default})", dtype_name, "DTYPE"),
    _Option("max_model_len", "--max-model-len",
            "longest sequence (prompt + generated tokens) a request may reach (default: {default})",
            int_at_least(2), "N"),
    _Option("max_running_requests", "--max-running-requests",
            "requests decoded together in one batch (default: {default})", positive_int, "N"),
    _Option("kv_cache_tokens", "--kv-cache-tokens",
            "KV cache size in tokens, shared by all running requests (default: {default})", positive_int, "N"),
    _Option("prefill_chunk", "--prefill-chunk",
            "most prompt tokens one step computes, so a long prompt does not stall running decodes "
            "(default: {default})", positive_int, "N"),
    _Option("seed", "--seed", "engine random seed, used by requests without their own seed (default: {default})",
            any_int, "N"),
    _Option("moe_cpu_layers", "--moe-cpu-layers",
            "MoE layers whose routed experts run on the CPU: 'all', a count N (the first N MoE layers) or "
            "layer indices and ranges like 0-11,40 (one index: 7,) (default: {default})", layer_spec, "SPEC"),
    _Option("cpu_threads", "--cpu-threads",
            "CPU expert worker threads (default: {default})", positive_int, "N"),
    _Option("cpu_spin_ms", "--cpu-spin-ms",
            "how long the CPU expert workers of a GPU session spin after a hand-off, waiting for the next, before "
            "they sleep (a sleeping worker takes tens of microseconds to wake) (default: {default})",
            spin_ms, "MS"),
    _Option("pin_host_threads", "--pin-host-threads",
            "on a GPU with CPU expert layers: on (the threads that launch the GPU's work and enqueue expert copies "
            "run on the cores the CPU expert workers leave free, so they never take a worker's core) or off "
            "(wherever the OS puts them) (default: {default})",
            choice("on", "off"), "MODE"),
    _Option("enforce_eager", "--enforce-eager",
            "run decode steps eagerly, without capturing CUDA/HIP graphs (default: graphs where the backend "
            "supports them)", flag_only=True),
    _Option("decode_ahead", "--no-decode-ahead",
            "read each decode step's tokens back before launching the next; by default (GPU backends) a "
            "greedy step, or one sampled on the device (temperature, top-k), is launched from the previous "
            "step's tokens on the device before they are read back, "
            "so the host's work between steps overlaps the GPU's, and a step launched for a request that then "
            "stops (end of sequence, stop string) is discarded", flag_only=True, turns_off=True),
    _Option("cuda_graph_max_bs", "--cuda-graph-max-bs",
            "largest decode batch captured as a graph; bigger batches run eagerly (default: {default}; none is "
            "captured above --max-running-requests)",
            positive_int, "N"),
    _Option("cuda_graph_bs", "--cuda-graph-bs",
            "decode batch sizes to capture graphs for, comma-separated like 1,2,4,8 (default: {default})",
            batch_sizes, "B,B,..."),
    _Option("gpu_memory_utilization", "--gpu-memory-utilization",
            "most of the GPU's total memory this process may use, as a fraction in (0, 1] "
            "(default: {default}; with --gpu-memory-limit the smaller wins)", fraction, "FRACTION"),
    _Option("gpu_memory_limit", "--gpu-memory-limit",
            "most GPU memory this process may use: bytes or a size like 16GiB, 24G, 1.5GiB "
            "(K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000) (default: {default})",
            byte_size, "SIZE"),
    _Option("gpu_dense", "--gpu-dense",
            "form of the dense weights (attention, output head, embedding) on the GPU: dequantized (the "
            "activation dtype), packed (GGUF Q4_K/Q5_K/Q6_K/Q8_0 kept as in the file, about a third of the "
            "memory), both (packed for decode plus dequantized copies of the linears for prompts: the memory "
            "of both) or auto (packed when that lets more layers' experts onto the GPU, else both where it fits as many, "
            "else dequantized) (default: {default})",
            choice("auto", "packed", "dequantized", "both"), "MODE"),
    _Option("gpu_embedding", "--gpu-embedding",
            "where a packed token embedding table lives: device, host (page-locked host memory; the GPU reads "
            "each step's rows over PCIe, a few microseconds, and its bytes hold experts instead) or auto (host "
            "when some layers' experts would run on the CPU) (default: {default})",
            choice("auto", "device", "host"), "MODE"),
    _Option("gpu_gemv", "--gpu-gemv",
            "what runs one token through a packed dense matrix (attention, output head): native (the "
            "backend's CUDA kernel: Q4_K and Q6_K), triton (the Triton kernels) or auto (native for the "
            "formats it serves, where the backend has it) (default: {default})",
            choice("auto", "native", "triton"), "MODE"),
    _Option("moe_gpu_experts", "--moe-gpu-experts",
            "form of GPU-resident experts: auto (GGUF Q4_K/Q5_K/Q6_K/Q8_0/MXFP4 stay packed as in the file, FP8 "
            "block-scaled in rows of scaled blocks, other formats are dequantized to the activation dtype) or "
            "dequantized (default: {default})",
            choice("auto", "dequantized"), "MODE"),
    _Option("moe_gpu_kernel", "--moe-gpu-kernel",
            "what runs a decode step's routes through packed GPU experts: native (the backend's CUDA kernels: "
            "Q4_K and Q6_K experts with SiLU), triton (the Triton kernels) or auto (native for the experts it "
            "serves, where the backend has it) (default: {default})",
            choice("auto", "native", "triton"), "MODE"),
    _Option("moe_cache_size", "--moe-cache-size",
            "GPU cache for experts of the CPU layers, from any layer: GiB like 4, a size like 512MiB, a "
            "fraction of the GPU memory budget like 0.25, 0 (none) or auto; routes to cached experts run on the "
            "GPU (default: {default})", cache_size, "SIZE"),
    _Option("moe_hybrid_max_fetch", "--moe-hybrid-max-fetch",
            "experts per layer and decode step copied into the expert cache for later steps, without "
            "stalling the current one: the most routed ones not cached (recent decode routes, a quarter weight "
            "for prompt routes), each replacing the least routed cached expert when clearly hotter "
            "(default: {default})", non_negative_int, "N"),
    _Option("moe_stream_prefill", "--moe-stream-prefill",
            "prefill chunks compute the CPU layers' experts on the GPU, streaming their bytes over PCIe: auto "
            "(GGUF K-quant/Q8_0/MXFP4 experts, chunks of at least --moe-stream-min-tokens), on (also HF checkpoints' "
            "experts in the activation dtype), off (default: {default})",
            choice("auto", "on", "off"), "MODE"),
    _Option("moe_stream_min_tokens", "--moe-stream-min-tokens",
            "smallest prefill chunk that streams experts to the GPU with --moe-stream-prefill auto "
            "(default: {default})", positive_int, "N"),
    _Option("moe_stream_experts", "--moe-stream-experts",
            "which experts a streamed prefill chunk copies to the GPU: routed (those its tokens route to, once "
            "the layer's router has run, copied and computed in overlapping parts), all (the whole layer, "
            "the next layer's copy behind this one's compute) (default: {default})",
            choice("routed", "all"), "MODE"),
    _Option("moe_stream_windows", "--moe-stream-windows",
            "routed streaming copies and computes a layer in this many windows of its experts through one GPU "
            "buffer of a window's size: more windows, less GPU memory for the buffer and more for resident "
            "expert layers (default: {default}, a quarter of a layer)", positive_int, "N"),
    _Option("moe_lock_host", "--moe-lock-host",
            "page-lock the host expert banks and register them with the GPU driver, for copies at full PCIe "
            "speed: auto (when streaming or fetching uses them), on, off (default: {default})",
            choice("auto", "on", "off"), "MODE"),
    _Option("moe_locked_fetch", "--moe-locked-fetch",
            "share of a decode step's missed expert routes the GPU computes in the same step, beside the CPU "
            "workers: one gather kernel per stack copies their experts from the page-locked host banks over "
            "PCIe into a few device slots (a few MiB), then the GPU's kernels compute from there (about PCIe / "
            "(PCIe + RAM bandwidth); GGUF K-quant/Q8_0/MXFP4 experts); 0: off; auto: on an NVIDIA GPU when the "
            "banks can be page-locked, the start times a CPU layer's step with 0 to --moe-locked-max-fetch "
            "routes fetched and takes the fewest within 5%% of the fastest (none: off), else off "
            "(default: {default})", fraction_or_auto, "auto|FRACTION"),
    _Option("moe_locked_max_fetch", "--moe-locked-max-fetch",
            "most missed routes per layer and step served that way (default: {default})", non_negative_int, "N"),
    _Option("moe_collect_stats", "--moe-collect-stats",
            "collect MoE statistics (active experts, cache hits and misses per layer, fetched bytes, CPU expert "
            "time) for /metrics and a periodic log line (default: off)", flag_only=True),
    _Option("moe_stats_interval", "--moe-stats-interval",
            "seconds between MoE statistics log lines with --moe-collect-stats (default: {default})",
            positive_float, "SECONDS"),
    _Option("enable_prefix_cache", "--no-prefix-cache",
            "compute every prompt in full instead of reusing the KV blocks of a prefix an earlier request "
            "computed (default: prefix caching on)", flag_only=True, turns_off=True),
)

#: Flag of each EngineConfig field the shared options set.
FLAGS: dict[str, str] = {o.field: o.flag for o in _OPTIONS}

_DEFAULT_TEXT: dict[str, str] = {
    "model": "the built-in demo model, created on first use",
    "max_model_len": "the model's context, capped by the KV cache",
    "kv_cache_tokens": "--max-running-requests full-length sequences, capped by the memory left after the weights",
    "moe_cpu_layers": "the backend's choice: a GPU backend keeps as many layers on the GPU as its memory allows",
    "cpu_threads": "$FREETOKEN_CPU_MOE_THREADS, else one per physical core, but one core left to the GPU's "
                   "thread on GPU backends",
    "cpu_spin_ms": "20 on a GPU device, longer than a decode step, so the workers are awake for the next step's "
                   "first hand-off; 2 elsewhere",
    "cuda_graph_bs": "powers of two and multiples of 8 up to --cuda-graph-max-bs",
    "prefill_chunk": "2048 on a GPU (under a memory budget: the largest of 256, 512, 1024 and 2048 whose "
                     "activations fit beside the experts placed as for 256), 256 on the CPU",
    "gpu_memory_utilization": "no limit",
    "gpu_memory_limit": "no limit",
    "moe_cache_size": "auto: where the memory plan places the layers (no --moe-cpu-layers) and some stay on "
                      "the CPU, the device memory left beside the GPU layers and the KV cache; else none",
    "moe_stream_min_tokens": "measured at startup from PCIe and CPU expert speed",
    "moe_locked_fetch": "auto",
}

_ENGINE_DESTS = "_engine_option_fields"
_ENGINE_PARSER = "_engine_option_parser"


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    default_text: Optional[Mapping[str, str]] = None,
    exclude: Iterable[str] = (),
) -> argparse._ArgumentGroup:
    """Register the engine options on ``parser`` (in a group "engine options").

    ``defaults`` changes a field's default for this command (``generate`` decodes one
    request: ``{"max_running_requests": 1}``); ``default_text`` says in the help what a
    default of None means there; ``exclude`` leaves flags out (the command defines its own
    flag of that name). The fields added are remembered on the namespace, so
    :func:`engine_config_from_args` reads exactly those."""
    base = {f.name: f.default for f in dataclasses.fields(_engine_config_class())}
    base.update(defaults or {})
    texts = {**_DEFAULT_TEXT, **(default_text or {})}
    skipped = set(exclude)
    unknown = skipped.union(defaults or {}).union(default_text or {}) - set(FLAGS)
    if unknown:
        raise ValueError(f"not engine options: {sorted(unknown)}")
    group = parser.add_argument_group("engine options")
    added: list[str] = []
    for opt in _OPTIONS:
        if opt.field in skipped:
            continue
        default = base[opt.field]
        if opt.field == "backend":
            help_text = backend_help()
        else:
            shown = texts.get(opt.field) if (default is None or opt.field in (default_text or {})) else None
            if shown is None:
                shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
            help_text = opt.help.replace("{default}", shown)
        if opt.flag_only:
            action = "store_false" if opt.turns_off else "store_true"
            group.add_argument(opt.flag, dest=opt.field, action=action, default=bool(default), help=help_text)
        else:
            group.add_argument(opt.flag, dest=opt.field, type=opt.type, default=default, metavar=opt.metavar,
                               help=help_text)
        added.append(opt.field)
    parser.set_defaults(**{_ENGINE_DESTS: tuple(added), _ENGINE_PARSER: parser})
    return group


def _engine_config_class() -> type[EngineConfig]:
    from freetoken.engine.config import EngineConfig

    return EngineConfig


def engine_options_given(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields ``args`` holds (those :func:`add_engine_arguments` registered)."""
    return {name: getattr(args, name) for name in getattr(args, _ENGINE_DESTS, ())}


def usage_error(args: argparse.Namespace, message: str) -> None:
    """End the command with ``message`` as the parser's usage error (exit status 2), for
    option checks that need several values; raises ValueError on a namespace that did not
    come from a parser with the engine options."""
    parser = getattr(args, _ENGINE_PARSER, None)
    if parser is None:
        raise ValueError(message)
    parser.error(message)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """An :class:`~freetoken.engine.config.EngineConfig` from the engine options in
    ``args``; ``overrides`` (EngineConfig fields) replace or add values. A field left None
    whose EngineConfig default is not None takes that default. A value EngineConfig
    refuses ends the command like a bad flag: the parser's usage error (exit status 2)."""
    cls = _engine_config_class()
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    values = engine_options_given(args)
    values.update(overrides)
    kwargs = {k: v for k, v in values.items() if not (v is None and defaults.get(k) is not None)}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        message = str(exc)
        for field, flag in FLAGS.items():
            if "_" in field:  # one-word fields (model, seed) are also ordinary words in messages
                message = re.sub(rf"\b{field}\b", flag, message)
        usage_error(args, message)
        raise  # usage_error exits

"""Open a checkpoint (HF directory or .gguf file) and build the runnable model."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from typing import Any, Optional

import torch

from freetoken.backends.contract import ModelSession, ModelShape
from freetoken.handoff import Fmt
from freetoken.loading.hf import CheckpointError, HFCheckpoint, hf_architecture
from freetoken.loading.memory import check_fits
from freetoken.loading.tokenizer import IdsOnlyTokenizer, Tokenizer, has_hf_tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from freetoken.models.config import ModelConfig
from freetoken.models.registry import family_for_gguf, family_for_hf

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    model: Any
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    path: str
    name: str
    format: str  # "hf" | "gguf"
    checkpoint: Any = None  # keeps the memory mapping alive


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None, lambda i: None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None, lambda i: None
    bar = tqdm(total=total, desc=desc, unit="layer", leave=False)
    return bar, lambda i: bar.update(1)


def resolve_dtype(dtype: str, default: str = "bfloat16") -> torch.dtype:
    """The torch dtype of ``--dtype`` (``auto``: the backend's default)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        dtype = default
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}") from None


def activation_bytes_per_token(cfg: ModelConfig, elt: int) -> int:
    """Device bytes per token of a prompt chunk at its peak inside a layer: the residual
    stream and its normed copies (float32, conservatively), plus the larger of the attention
    block (q/k/v and their normed, rotated copies, the output; fused attention keeps no
    scores) and the feed-forward block (router scores, each route's gathered input, gate/up,
    activation and float32 output, the combined result; or a dense MLP)."""
    H, D = cfg.hidden_size, cfg.head_dim
    stream = 6 * H * 4
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D * elt
    attention = 2 * qkv + cfg.num_heads * D * elt + cfg.num_heads * 4
    routes = cfg.top_k * (H * elt + 3 * cfg.moe_intermediate_size * elt + H * 4 + 12)
    moe = 2 * cfg.num_experts * 4 + routes + H * 4
    dense_mlp = 3 * cfg.intermediate_size * elt
    return stream + max(attention, moe, dense_mlp)


def model_shape(cfg: ModelConfig, act: torch.dtype) -> ModelShape:
    """The sizes a backend plans memory with, from the config alone (before loading)."""
    elt = torch.empty((), dtype=act).element_size()
    H = cfg.hidden_size
    attn = cfg.attention_weights() + 2 * H + 2 * cfg.head_dim
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    dense_mlp = 3 * H * (cfg.intermediate_size * (cfg.num_layers - len(moe_layers))
                         + cfg.shared_expert_intermediate() * len(moe_layers))
    router = cfg.num_experts * H * len(moe_layers)  # float32
    emb = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2)
    dense = (attn * cfg.num_layers + dense_mlp + emb + H) * elt + router * 4
    return ModelShape(
        num_layers=cfg.num_layers, moe_layers=moe_layers, hidden=H, num_experts=cfg.num_experts,
        moe_intermediate=cfg.moe_intermediate_size, top_k=cfg.top_k, dense_bytes=dense,
        kv_bytes_per_token=cfg.kv_bytes_per_token(elt), activation_bytes_per_token=activation_bytes_per_token(cfg, elt),
    )


def load(path: str, session: ModelSession, show_progress: Optional[bool] = None) -> LoadedModel:
    """Load ``path`` (an HF directory or a ``.gguf`` file) with the weight policy of
    ``session``, after ``session.plan`` accepted the model's sizes."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory (give an HF model directory or a .gguf file)")
    if os.path.isdir(path):
        return _load_hf(path, session, show_progress)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, session, show_progress)
    raise CheckpointError(f"{path}: not an HF model directory and not a GGUF file (magic {magic!r})")


def _load_hf(path: str, session: ModelSession, show: Optional[bool]) -> LoadedModel:
    ck = HFCheckpoint(path)
    arch = hf_architecture(ck.config)
    fam = family_for_hf(arch, os.path.join(path, "config.json"))
    mod = fam.load()
    cfg = mod.config_from_hf(ck.config, ck.generation_config)
    total = ck.total_bytes()
    # Per-expert HF tensors are stacked into one buffer per layer: one copy of them.
    expert_bytes = int(total * _expert_fraction(cfg))
    check_fits(path, weights=total, copies=expert_bytes)
    policy = session.weight_policy
    shape = model_shape(cfg, policy.dtype)
    shape.dense_bytes = _hf_dense_bytes(ck, cfg, policy.dtype)
    _hf_expert_formats(ck, shape)
    session.plan(shape)
    policy = session.weight_policy  # the plan may choose the dense part's form
    t0 = time.time()
    show = total > (1 << 30) if show is None else show
    bar, prog = _progress(cfg.num_layers, "loading", show)
    model = getattr(mod, fam.model_class)(cfg, ck, mod.HF_NAMES, policy, progress=prog)
    if bar is not None:
        bar.close()
    if has_hf_tokenizer(path):
        tok = load_hf_tokenizer(path, cfg.eos_token_ids)
    else:
        logger.warning("%s has no tokenizer.json or tiktoken.model: token ids only", path)
        tok = IdsOnlyTokenizer(cfg.eos_token_ids, cfg.vocab_size, path)
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = tuple(tok.eos_token_ids)
    logger.info("loaded %s (%s, %d layers) in %.1fs", path, arch, cfg.num_layers, time.time() - t0)
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(model, cfg, tok, ck.generation_config, path, name, "hf", ck)


def _expert_fraction(cfg: ModelConfig) -> float:
    e = 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size * sum(
        cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    attn = cfg.num_layers * cfg.attention_weights()
    emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return e / max(1, e + attn + emb)


def _load_gguf(path: str, session: ModelSession, show: Optional[bool]) -> LoadedModel:
    from freetoken.loading.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    fam = family_for_gguf(ck.architecture, path)
    mod = fam.load()
    cfg = mod.config_from_gguf(ck.metadata, has_output=ck.has(mod.GGUF_NAMES.lm_head))
    if cfg.vocab_size <= 0 and ck.has(mod.GGUF_NAMES.embed):
        cfg.vocab_size = int(ck.get(mod.GGUF_NAMES.embed).shape[0])
    total = ck.total_bytes()
    # the file is memory-mapped and read in place (the routed experts always are)
    check_fits(path, weights=total)
    policy = session.weight_policy
    session.plan(_gguf_shape(ck, mod.GGUF_NAMES, cfg, policy.dtype))
    policy = session.weight_policy  # the plan may choose the dense part's form
    t0 = time.time()
    show = total > (1 << 30) if show is None else show
    bar, prog = _progress(cfg.num_layers, "loading", show)
    model = getattr(mod, fam.model_class)(cfg, ck, mod.GGUF_NAMES, policy, progress=prog)
    if bar is not None:
        bar.close()
    tok = load_gguf_tokenizer(ck, cfg.vocab_size)
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = tuple(tok.eos_token_ids)
    logger.info("loaded %s (%s, %d layers) in %.1fs", path, ck.architecture, cfg.num_layers, time.time() - t0)
    name = str(ck.metadata.get("general.name") or os.path.splitext(os.path.basename(path))[0])
    return LoadedModel(model, cfg, tok, {}, path, name, "gguf", ck)


def gguf_model_shape(path: str, act: torch.dtype) -> ModelShape:
    """The sizes a backend plans a GGUF file with (what :func:`load` gives ``session.plan``),
    from the file's header alone."""
    from freetoken.loading.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    mod = family_for_gguf(ck.architecture, path).load()
    cfg = mod.config_from_gguf(ck.metadata, has_output=ck.has(mod.GGUF_NAMES.lm_head))
    if cfg.vocab_size <= 0 and ck.has(mod.GGUF_NAMES.embed):
        cfg.vocab_size = int(ck.get(mod.GGUF_NAMES.embed).shape[0])
    return _gguf_shape(ck, mod.GGUF_NAMES, cfg, act)


def _gguf_shape(ck: Any, names: Any, cfg: ModelConfig, act: torch.dtype) -> ModelShape:
    shape = model_shape(cfg, act)
    _gguf_expert_layout(ck, names, shape)
    _gguf_dense_layout(ck, names, shape, act)
    return shape


#: an HF checkpoint's routed-expert tensors (not ``shared_experts``), routers, and layer index
_HF_ROUTED = re.compile(r"(?<!shared_)experts\.")
_HF_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router)\.weight$")
_HF_LAYER = re.compile(r"layers\.(\d+)\.")


def _hf_dense_bytes(ck: Any, cfg: ModelConfig, act: torch.dtype) -> int:
    """The dense part's device bytes counted from the checkpoint's tensors: every tensor but
    the routed experts and the layers past the model's last (next-token prediction), at the
    activation dtype, routers float32. (The families' attention blocks differ too much, e.g.
    linear-attention layers, for the config to say it.)"""
    elt = torch.empty((), dtype=act).element_size()
    total = 0
    for name in ck.names():
        if _HF_ROUTED.search(name):
            continue
        m = _HF_LAYER.search(name)
        if m and int(m.group(1)) >= cfg.num_layers:
            continue
        n = 1
        for d in ck.get(name).shape:
            n *= int(d)
        total += n * (4 if _HF_ROUTER.search(name) else elt)
    return total


#: an HF checkpoint's per-expert tensors of expert 0: (layer, projection)
_HF_EXPERT0 = re.compile(r"layers\.(\d+)\..*experts\.0\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_HF_PROJ = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


#: an HF checkpoint's MXFP4 expert blocks (GPT-OSS: ``quant_method = "mxfp4"``)
_HF_MXFP4_BLOCKS = re.compile(r"layers\.(\d+)\.mlp\.experts\.gate_up_proj_blocks$")


def _hf_expert_formats(ck: Any, shape: ModelShape) -> None:
    """Fill ``shape.expert_formats`` from an HF checkpoint with one tensor per expert (the
    formats of expert 0's gate/up/down in each MoE layer), when every MoE layer has them.
    MXFP4 experts (GPT-OSS's ``*_blocks``/``*_scales``, held in ggml's layout with their
    biases folded in as ``BIAS_PAD`` more columns) also get their bytes as held. Other fused
    expert tensors leave the formats unset; per-expert float and FP8 tensors leave the bytes
    unset (the plan counts FP8 in its device rows from the sizes)."""
    from freetoken.models.moe_block import BIAS_PAD

    quant = (ck.config.get("quantization_config") or {}).get("quant_method")
    mxfp4 = {int(m.group(1)) for m in map(_HF_MXFP4_BLOCKS.search, ck.names()) if m} if quant == "mxfp4" else set()
    if mxfp4 and set(shape.moe_layers) <= mxfp4:
        mx = int(Fmt.MXFP4)
        shape.expert_formats = {i: (mx, mx, mx) for i in shape.moe_layers}
        held = 3 * shape.num_experts * shape.moe_intermediate * (shape.hidden + BIAS_PAD) // 32 * 17
        shape.expert_file_bytes = {i: held for i in shape.moe_layers}
        return
    found: dict[int, list[Optional[int]]] = {}
    for name in ck.names():
        m = _HF_EXPERT0.search(name)
        if m:
            found.setdefault(int(m.group(1)), [None, None, None])[_HF_PROJ[m.group(2)]] = int(ck.get(name).fmt)
    formats = {i: tuple(found.get(i, ())) for i in shape.moe_layers}
    if all(len(f) == 3 and None not in f for f in formats.values()):
        shape.expert_formats = formats  # type: ignore[assignment]


def _gguf_expert_name(names: Any, layer: int, stack: str) -> str:
    """A GGUF expert stack's name: the family's role if it names one, else llama.cpp's
    ``blk.{layer}.ffn_{gate,up,down}_exps.weight`` (what every converter writes)."""
    try:
        return str(names.layer(layer, f"{stack}_exps"))
    except (KeyError, AttributeError):
        return f"blk.{layer}.ffn_{stack}_exps.weight"


def _gguf_expert_layout(ck: Any, names: Any, shape: ModelShape) -> None:
    """Fill ``shape.expert_file_bytes``/``expert_formats`` from the file's expert stacks
    (``gate_exps``/``up_exps``/``down_exps`` of each MoE layer), when it has them all. Experts
    with biases (``ffn_gate_exps.bias``) are held with their biases folded in as ``BIAS_PAD``
    more columns of gate/up and rows of down (:class:`~freetoken.models.moe_decoder.BiasedMoELayer`),
    so their bytes are counted in that layout."""
    from freetoken.models.moe_block import BIAS_PAD

    sizes: dict[int, int] = {}
    formats: dict[int, tuple[int, int, int]] = {}
    for i in shape.moe_layers:
        parts = [ck.tensor_layout(_gguf_expert_name(names, i, r)) for r in ("gate", "up", "down")]
        if any(p is None for p in parts):  # a family whose stacks are fused or named otherwise
            return
        size = sum(p[1] for p in parts)
        if ck.has(f"blk.{i}.ffn_gate_exps.bias"):
            size = size * (shape.hidden + BIAS_PAD) // shape.hidden
        sizes[i] = size
        formats[i] = (parts[0][0], parts[1][0], parts[2][0])
    shape.expert_file_bytes, shape.expert_formats = sizes, formats


#: a GGUF layer tensor's layer
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")

#: ggml types a packed dense policy keeps as the file's bytes (Q8_0, Q4_K, Q5_K, Q6_K)
_PACKED_DENSE_TYPES = frozenset({8, 12, 13, 14})


def _gguf_dense_layout(ck: Any, names: Any, shape: ModelShape, act: torch.dtype) -> None:
    """Fill ``shape.dense_file_bytes``: every tensor but the routed experts (``*_exps``)
    as :class:`freetoken.models.packed_linear.PackedWeightPolicy` places it on the device:
    block formats as their bytes in the file, routers float32, the rest at ``act``; and
    ``shape.dense_scratch_bytes``, its prefill scratch (the largest chunk of a packed linear:
    every packed matrix but an embedding that is not also the output head); and
    ``shape.embedding_file_bytes``, such an embedding's packed bytes; and
    ``shape.prompt_copy_bytes``, the activation-dtype copies of the packed matrices but the
    embedding and the head (``--gpu-dense both``). Tensors of layers past the model's last
    (GLM-4.5's next-token-prediction layers) are not counted."""
    from freetoken.models.packed_linear import chunk_rows

    elt = torch.empty((), dtype=act).element_size()
    embed_only = names.embed if ck.has(names.lm_head) else None
    heads = {names.embed, names.lm_head}  # the embedding, the head, or one table that is both
    scratch = copies = 0
    routers: set[str] = set()
    experts: set[str] = set()
    for i in shape.moe_layers:
        for role, into in (("router", routers), ("gate_exps", experts), ("up_exps", experts),
                           ("down_exps", experts)):  # fmt: skip
            try:
                into.add(names.layer(i, role))
            except (KeyError, AttributeError):  # a family without that role
                pass
    total = dequantized = 0
    for name in ck.names():
        if name in experts or "_exps" in name:
            continue
        m = _GGUF_LAYER.match(name)
        if m and int(m.group(1)) >= shape.num_layers:  # next-token-prediction layers: never loaded
            continue
        layout = ck.tensor_layout(name)
        if layout is None:
            continue
        ttype, nbytes = layout
        if ttype in _PACKED_DENSE_TYPES:
            total += nbytes
            if name == embed_only:
                shape.embedding_file_bytes = nbytes
            dims = ck.tensor_shape(name)
            if len(dims) == 2 and name != embed_only:
                scratch = max(scratch, chunk_rows(dims[0], dims[1]) * dims[1] * elt)
            if len(dims) == 2 and name not in heads:
                copies += ck.tensor_elements(name) * elt
        else:
            total += ck.tensor_elements(name) * (4 if name in routers else elt)
        dequantized += ck.tensor_elements(name) * (4 if name in routers else elt)
    shape.dense_file_bytes = total
    shape.dense_scratch_bytes = scratch
    shape.prompt_copy_bytes = copies
    shape.dense_bytes = dequantized  # counted from the file, not estimated from the config


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a checkpoint alone (no weights are loaded)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        ck = HFCheckpoint(path)
        cfg = family_for_hf(hf_architecture(ck.config), path).load().config_from_hf(ck.config, ck.generation_config)
        if has_hf_tokenizer(path):
            return load_hf_tokenizer(path, cfg.eos_token_ids)
        return IdsOnlyTokenizer(cfg.eos_token_ids, cfg.vocab_size, path)
    from freetoken.loading.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    mod = family_for_gguf(ck.architecture, path).load()
    cfg = mod.config_from_gguf(ck.metadata, has_output=ck.has(mod.GGUF_NAMES.lm_head))
    vocab = cfg.vocab_size if cfg.vocab_size > 0 else int(ck.get(mod.GGUF_NAMES.embed).shape[0])
    return load_gguf_tokenizer(ck, vocab)

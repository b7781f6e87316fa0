"""Writing GGUF files (the demo model, ``bench make-model``, tests) with gguf-py.

Also makes random but *valid* K-quant/Q8_0 blocks straight from bytes: quantized
values uniformly random, block scales set to small finite fp16 values. That is how
synthetic checkpoints of real shapes are produced quickly without quantizing floats.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from freetoken.handoff import Fmt
from freetoken.loading.tensors import BLOCK_SIZES
from freetoken.models.config import ModelConfig

ARCH = "qwen3moe"


def write_qwen3moe_metadata(w: Any, cfg: ModelConfig, name: str) -> None:
    """The ``qwen3moe`` hyper-parameters llama.cpp reads."""
    a = ARCH
    w.add_string("general.name", name)
    w.add_uint32(f"{a}.block_count", cfg.num_layers)
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_kv_heads)
    w.add_float32(f"{a}.rope.freq_base", float(cfg.rope_theta))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    w.add_uint32(f"{a}.expert_used_count", cfg.top_k)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_uint32(f"{a}.expert_count", cfg.num_experts)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)


def write_tokenizer(w: Any, tokenizer_json: str, chat_template: Optional[str], eos_token: Optional[str],
                    bos_token: Optional[str] = None, pre: str = "gpt2") -> None:
    """A byte-level BPE ``tokenizers`` tokenizer as GGUF ``tokenizer.ggml.*`` fields."""
    tj = json.loads(tokenizer_json)
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    for at in tj.get("added_tokens", []):
        vocab[at["content"]] = at["id"]
    special = {at["content"] for at in tj.get("added_tokens", []) if at.get("special")}
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in special else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    if eos_token is not None and eos_token in vocab:
        w.add_uint32("tokenizer.ggml.eos_token_id", vocab[eos_token])
    if bos_token is not None and bos_token in vocab:
        w.add_uint32("tokenizer.ggml.bos_token_id", vocab[bos_token])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    if chat_template:
        w.add_string("tokenizer.chat_template", chat_template)


def random_blocks(fmt: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 2e-4) -> np.ndarray:
    """``rows`` packed rows of ``cols`` values in ``fmt`` as uint8 ``[rows, row_bytes]``.

    The quantized bits are uniformly random; every fp16 scale is a small positive
    finite value around ``scale`` so dequantized weights are O(0.01)."""
    per, nb = BLOCK_SIZES[int(fmt)]
    if cols % per:
        raise ValueError(f"{Fmt(fmt).name} needs cols multiple of {per}, got {cols}")
    nblk = rows * (cols // per)
    n = nblk * nb
    raw = rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n].reshape(nblk, nb)

    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=nblk).astype(np.float16).view(np.uint8).reshape(nblk, 2)

    if fmt == Fmt.Q8_0:
        raw[:, 0:2] = f16(scale * 2, scale * 6)
    elif fmt in (Fmt.Q4_K, Fmt.Q5_K):
        raw[:, 0:2] = f16(scale * 0.5, scale * 1.5)  # d
        raw[:, 2:4] = f16(scale * 0.5, scale * 1.5)  # dmin
    elif fmt == Fmt.Q6_K:
        raw[:, 208:210] = f16(scale * 0.25, scale * 0.75)
    else:
        raise ValueError(f"no random blocks for format {fmt}")
    return raw.reshape(rows, (cols // per) * nb)

"""Writing GGUF files (the demo model, ``bench make-model``, tests) with gguf-py.

Also makes random but *valid* K-quant/Q8_0 blocks straight from bytes: quantized
values uniformly random, block scales set to small finite fp16 values. That is how
synthetic checkpoints of real shapes are produced quickly without quantizing floats;
:class:`RandomBlockPool` repeats one such pool at memory-copy speed for files of
tens of GB.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import numpy as np

from freetoken.handoff import Fmt
from freetoken.loading.tensors import BLOCK_SIZES
from freetoken.models.config import ModelConfig

ARCH = "qwen3moe"


def write_moe_base_metadata(w: Any, cfg: ModelConfig, name: str, *, arch: Optional[str] = None,
                            block_count: Optional[int] = None, feed_forward: Optional[int] = None,
                            head_count_kv: Optional[int] = None, key_length: Optional[int] = None,
                            value_length: Optional[int] = None) -> None:  # fmt: skip
    """The hyper-parameters every MoE architecture's llama.cpp metadata has: name, layers
    (``block_count``, default ``cfg.num_layers``), context, hidden size, dense MLP size
    (``feed_forward``, default ``cfg.intermediate_size``), heads, KV heads and head sizes
    (default ``cfg``'s), RoPE base, norm epsilon, expert count, experts per token and
    expert size. ``arch`` defaults to the writer's."""
    a = arch or w.arch
    w.add_string("general.name", name)
    w.add_uint32(f"{a}.block_count", cfg.num_layers if block_count is None else block_count)
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size if feed_forward is None else feed_forward)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_kv_heads if head_count_kv is None else head_count_kv)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim if key_length is None else key_length)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim if value_length is None else value_length)
    w.add_float32(f"{a}.rope.freq_base", float(cfg.rope_theta))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    w.add_uint32(f"{a}.expert_count", cfg.num_experts)
    w.add_uint32(f"{a}.expert_used_count", cfg.top_k)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)


def write_qwen3moe_metadata(w: Any, cfg: ModelConfig, name: str) -> None:
    """The ``qwen3moe`` hyper-parameters llama.cpp reads."""
    write_moe_base_metadata(w, cfg, name, arch=ARCH)


def mrope_sections(rotary_dim: int) -> list[int]:
    """Qwen3.5's multimodal RoPE sections (rotated pairs per time/height/width position, as
    GGUF's four-entry array): [11, 11, 10, 0] for its 64 rotated dimensions, split the same
    way for other sizes. Text positions are equal in all three, so the split does not change
    what a text model computes; llama.cpp only needs the sections to cover the pairs."""
    pairs = rotary_dim // 2
    t = -(-pairs // 3)
    return [t, t, pairs - 2 * t, 0]


def write_hybrid_metadata(w: Any, cfg: Any, name: str) -> None:
    """The ``qwen35moe``/``qwen3next`` hyper-parameters llama.cpp reads (``cfg``: a
    :class:`freetoken.models.qwen_hybrid.HybridConfig`; ``w.arch`` names the architecture)."""
    a = w.arch
    write_moe_base_metadata(w, cfg, name)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.rotary_dim)
    if a == "qwen35moe":  # llama.cpp requires the (text-only: unused) multimodal RoPE sections
        w.add_array(f"{a}.rope.dimension_sections", mrope_sections(cfg.rotary_dim))
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    w.add_bool(f"{a}.expert_weights_norm", bool(cfg.norm_topk_prob))
    w.add_uint32(f"{a}.ssm.conv_kernel", cfg.conv_kernel)
    w.add_uint32(f"{a}.ssm.state_size", cfg.linear_key_dim)
    w.add_uint32(f"{a}.ssm.group_count", cfg.linear_key_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", cfg.linear_value_heads)
    w.add_uint32(f"{a}.ssm.inner_size", cfg.linear_value_dim * cfg.linear_value_heads)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    interval = full[0] + 1 if full else cfg.num_layers
    w.add_uint32(f"{a}.full_attention_interval", interval)
    if [i for i in range(cfg.num_layers) if (i + 1) % interval == 0] != full:
        w.add_array(f"{a}.attention.recurrent_layers", [t != "full_attention" for t in cfg.layer_types])


def write_ids_only_vocab(w: Any, vocab_size: int) -> None:
    """A vocabulary without text: ``tokenizer.ggml.model = "none"`` and ``{arch}.vocab_size``.

    llama.cpp (src/llama-vocab.cpp) maps "none" to LLAMA_VOCAB_TYPE_NONE, reads no token
    arrays and no BOS/EOS ids, and makes ``vocab_size`` dummy tokens: that count must equal
    the rows of ``token_embd``, and llama-bench draws its random token ids from it. Without
    any ``tokenizer.ggml.model`` llama.cpp refuses the file. FreeToken reads "none" as an
    ids-only tokenizer (loading/tokenizer.py)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    w.add_string("tokenizer.ggml.model", "none")
    w.add_uint32(f"{w.arch}.vocab_size", vocab_size)


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


def random_blocks(fmt: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 2e-4,
                  centered: bool = False) -> np.ndarray:
    """``rows`` packed rows of ``cols`` values in ``fmt`` as uint8 ``[rows, row_bytes]``.

    The quantized bits are uniformly random; every fp16 scale (MXFP4: block exponent) is a
    small positive finite value around ``scale`` so dequantized weights are O(0.01).

    Q4_K/Q5_K values are d x sc x q - dmin x m with q >= 0, so independent random scales
    and mins give every weight a positive mean: a matrix of them maps any input mostly onto
    one fixed direction. ``centered`` makes each sub-block's min equal its scale and dmin
    7.5 d (Q5_K: 15.5 d), the mean of q: zero-mean weights, as trained ones are (Q6_K's
    signed scales, Q8_0 and MXFP4 are zero-mean as drawn)."""
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
    elif fmt in (Fmt.Q4_K, Fmt.Q5_K) and centered:
        d = rng.uniform(scale * 0.5, scale * 1.5, size=nblk)
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nblk, 2)
        raw[:, 2:4] = (d * (7.5 if fmt == Fmt.Q4_K else 15.5)).astype(np.float16).view(np.uint8).reshape(nblk, 2)
        # the 12 scale bytes: sub-block j < 4 takes scale bits 0-5 of byte j and min bits of
        # byte j + 4; j >= 4 the low / high nibble of byte j + 4 plus the top bits of byte
        # j - 4 / j: equal bytes 0-3 and 4-7 and equal nibbles in 8-11 give min == scale
        raw[:, 8:12] = raw[:, 4:8]
        low = raw[:, 12:16] & 0x0F
        raw[:, 12:16] = low | (low << 4)
    elif fmt in (Fmt.Q4_K, Fmt.Q5_K):
        raw[:, 0:2] = f16(scale * 0.5, scale * 1.5)  # d
        raw[:, 2:4] = f16(scale * 0.5, scale * 1.5)  # dmin
    elif fmt == Fmt.Q6_K:
        raw[:, 208:210] = f16(scale * 0.25, scale * 0.75)
    elif fmt == Fmt.MXFP4:  # E8M0 exponent byte: block scales 2^(e - 128) in [1, 4) x 2^floor(log2(scale))
        e0 = 128 + int(np.floor(np.log2(scale)))
        raw[:, 0] = rng.integers(e0, e0 + 3, size=nblk, dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for format {fmt}")
    return raw.reshape(rows, (cols // per) * nb)


class RandomBlockPool:
    """Random valid packed blocks for files of real size, at memory-copy speed.

    Drawing every block with :func:`random_blocks` runs at about 0.25 GB/s, minutes for a
    30B model. Here one pool of ``pool_blocks`` blocks per format is drawn once with
    :func:`random_blocks` (random bits, per-block fp16 scales spread over [0.5, 1.5] x
    ``scale``, so dequantized weights vary block to block), and each tensor is that pool
    repeated from a random starting block. The default pool length is prime, so rows,
    experts and tensors start at different pool positions; the same block sequence comes
    back only every ``pool_blocks`` blocks. The blocks are ``centered`` (zero-mean weights,
    see :func:`random_blocks`): with the positive mean of uncentered K-quant blocks every
    token's hidden state is dominated by one shared direction, and the routers send every
    token to the same few experts. Meant for speed measurements; tests of numerics use
    :func:`random_blocks`."""

    POOL_BLOCKS = 65521  # prime; ~9 MiB of Q4_K, ~13 MiB of Q6_K

    def __init__(self, rng: np.random.Generator, scale: float = 2e-4, pool_blocks: int = POOL_BLOCKS) -> None:
        if pool_blocks < 1:
            raise ValueError(f"pool_blocks must be positive, got {pool_blocks}")
        self._rng = rng
        self._scale = scale
        self._n = pool_blocks
        self._pools: dict[tuple[int, float], np.ndarray] = {}

    def pool(self, fmt: int, gain: float = 1.0) -> np.ndarray:
        """The pool of ``fmt`` (block scales ``gain`` x the pool's ``scale``) as uint8
        ``[pool_blocks, block_bytes]``."""
        key = (int(fmt), float(gain))
        p = self._pools.get(key)
        if p is None:
            per, nb = BLOCK_SIZES[key[0]]
            p = random_blocks(key[0], 1, self._n * per, self._rng, self._scale * gain, centered=True)
            p = p.reshape(self._n, nb)
            self._pools[key] = p
        return p

    def segments(self, fmt: int, rows: int, cols: int, gain: float = 1.0) -> list[np.ndarray]:
        """The bytes of ``rows`` packed rows as consecutive views into the pool (no copy):
        written one after the other they are the tensor :meth:`blocks` returns."""
        per, nb = BLOCK_SIZES[int(fmt)]
        if cols % per:
            raise ValueError(f"{Fmt(fmt).name} needs cols multiple of {per}, got {cols}")
        pool = self.pool(fmt, gain)
        nblk = rows * (cols // per)
        start = int(self._rng.integers(self._n))
        out: list[np.ndarray] = []
        while nblk > 0:
            k = min(self._n - start, nblk)
            out.append(pool[start:start + k])
            nblk -= k
            start = 0
        return out

    def blocks(self, fmt: int, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        """``rows`` packed rows of ``cols`` values in ``fmt`` as uint8 ``[rows, row_bytes]``."""
        segs = self.segments(fmt, rows, cols, gain)
        return np.concatenate(segs).reshape(rows, -1)


def write_moe_metadata(w: Any, cfg: ModelConfig, name: str, expert_weights_norm: Optional[bool] = None) -> None:
    """The hyper-parameters llama.cpp reads for its ``llama`` (Mixtral), ``olmoe`` and
    ``gpt-oss`` architectures (``w.arch``); GPT-OSS adds :func:`write_gpt_oss_metadata`."""
    a = w.arch
    write_moe_base_metadata(w, cfg, name, feed_forward=cfg.moe_intermediate_size)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
    if expert_weights_norm is not None:
        w.add_bool(f"{a}.expert_weights_norm", expert_weights_norm)


def write_gpt_oss_metadata(w: Any, sliding_window: int, yarn_factor: float, yarn_original_context: int) -> None:
    """GPT-OSS's sliding window (on the even layers) and YaRN RoPE scaling."""
    a = w.arch
    w.add_uint32(f"{a}.attention.sliding_window", sliding_window)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", float(yarn_factor))
    w.add_uint32(f"{a}.rope.scaling.original_context_length", yarn_original_context)


def write_glm4moe_metadata(w: Any, cfg: Any, name: str) -> None:
    """The ``glm4moe`` hyper-parameters llama.cpp reads (``cfg``: a
    :class:`freetoken.models.glm4_moe.Glm4MoeConfig`): as its converter writes them,
    ``block_count`` counts the next-token-prediction layers too (``nextn_predict_layers``),
    the gating function is sigmoid (2), the routed scaling factor is
    ``expert_weights_scale``; grouped routing (``expert_group_count``/``expert_group_used_count``)
    only where there are several groups (GLM-4.5's checkpoints have one)."""
    a = w.arch
    write_moe_base_metadata(w, cfg, name, block_count=cfg.num_layers + cfg.num_nextn_predict_layers)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.rotary_dim)
    write_shared_expert_routing_metadata(w, cfg, gating=2)
    w.add_bool(f"{a}.expert_weights_norm", bool(cfg.norm_topk_prob))
    w.add_uint32(f"{a}.nextn_predict_layers", cfg.num_nextn_predict_layers)


def write_shared_expert_routing_metadata(w: Any, cfg: Any, gating: int) -> None:
    """The keys of grouped routing with shared experts and dense leading layers (GLM-4.5,
    DeepSeek): shared experts, dense layers, the gating function (llama.cpp's
    ``expert_gating_func``: 1 softmax, 2 sigmoid), the routed scaling factor and, where there
    are several groups, ``expert_group_count``/``expert_group_used_count``."""
    a = w.arch
    w.add_uint32(f"{a}.expert_shared_count", cfg.n_shared_experts)
    w.add_uint32(f"{a}.leading_dense_block_count", cfg.first_k_dense_replace)
    w.add_uint32(f"{a}.expert_gating_func", gating)
    w.add_float32(f"{a}.expert_weights_scale", float(cfg.routed_scaling_factor))
    if cfg.n_group > 1:
        w.add_uint32(f"{a}.expert_group_count", cfg.n_group)
        w.add_uint32(f"{a}.expert_group_used_count", cfg.topk_group)


def write_deepseek2_metadata(w: Any, cfg: Any, name: str, mla_lengths: bool = True) -> None:
    """The ``deepseek2`` hyper-parameters llama.cpp reads (``cfg``: a
    :class:`freetoken.models.deepseek_v3.DeepseekConfig`), as its converter writes them: with
    ``mla_lengths`` (newer files, whose ``kv_b`` is split into ``attn_k_b``/``attn_v_b``) one
    KV head whose ``key_length``/``value_length`` are the latent's (``kv_lora_rank +
    qk_rope_head_dim`` and ``kv_lora_rank``) and the per-head sizes as ``key_length_mla``/
    ``value_length_mla``; without, ``key_length``/``value_length`` are the per-head sizes.
    ``expert_weights_norm`` only when set (llama.cpp's default is off); YaRN as
    ``rope.scaling.*`` with ``yarn_log_multiplier = 0.1 * mscale_all_dim``. llama.cpp runs
    the rotary tables unscaled (``mscale == mscale_all_dim``): a config whose YaRN attention
    factor is not 1 cannot be written."""
    a = w.arch
    qk, v, latent = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    write_moe_base_metadata(w, cfg, name, block_count=cfg.num_layers + cfg.num_nextn_predict_layers,
                            head_count_kv=1 if mla_lengths else cfg.num_heads,
                            key_length=latent if mla_lengths else qk,
                            value_length=cfg.kv_lora_rank if mla_lengths else v)  # fmt: skip
    if mla_lengths:
        w.add_uint32(f"{a}.attention.key_length_mla", qk)
        w.add_uint32(f"{a}.attention.value_length_mla", v)
    if cfg.q_lora_rank:
        w.add_uint32(f"{a}.attention.q_lora_rank", cfg.q_lora_rank)
    w.add_uint32(f"{a}.attention.kv_lora_rank", cfg.kv_lora_rank)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.qk_rope_head_dim)
    write_shared_expert_routing_metadata(w, cfg, gating=2 if cfg.scoring == "sigmoid" else 1)
    if cfg.norm_topk_prob:
        w.add_bool(f"{a}.expert_weights_norm", True)
    if cfg.num_nextn_predict_layers:
        w.add_uint32(f"{a}.nextn_predict_layers", cfg.num_nextn_predict_layers)
    r = cfg.rope_scaling
    if r.kind == "yarn":
        if r.attention_factor not in (None, 1.0):
            raise ValueError(f"YaRN attention factor {r.attention_factor} (mscale != mscale_all_dim) has no deepseek2 "
                             "GGUF key: llama.cpp runs the rotary tables unscaled")  # fmt: skip
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", float(r.factor))
        w.add_uint32(f"{a}.rope.scaling.original_context_length", r.original_max_positions)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", float(r.beta_fast))
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", float(r.beta_slow))
        if r.factor > 1:
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", (cfg.softmax_mscale - 1.0) / math.log(r.factor))

"""The built-in demo model: a small Qwen3-MoE created on first use, no download.

Its **weights are random** (seeded, so every machine builds the same model): it
produces fluent-looking nonsense and exists so that ``freetoken generate`` and
``freetoken serve`` run end to end on a fresh machine. Its tokenizer is real: a
byte-level BPE (GPT-2 style) trained deterministically on the docstrings of a fixed
list of Python standard-library modules, with ChatML special tokens and a ChatML
chat template. It is written both as an HF directory and as a GGUF file (Q8_0
matrices) into ``$FREETOKEN_CACHE`` (default ``~/.cache/freetoken``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Optional

import torch

from freetoken.models.config import ModelConfig

logger = logging.getLogger(__name__)

VERSION = 1
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "glob", "gzip",
    "hashlib", "heapq", "html", "http.client", "http.server", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "mimetypes", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil",
    "socket", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "typing", "unittest", "urllib.parse", "uuid", "warnings", "zipfile",
)


def demo_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(
        architecture="qwen3_moe", vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, intermediate_size=512, moe_intermediate_size=256, num_experts=16, top_k=4,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


@dataclasses.dataclass
class DemoModel:
    root: str
    hf_dir: str
    gguf_path: str


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("FREETOKEN_CACHE") or os.path.join("~", ".cache", "freetoken"))


def corpus() -> list[str]:
    """Docstrings of a fixed list of stdlib modules, in a fixed order."""
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - minimal Python builds
            continue
        if mod.__doc__:
            texts.append(mod.__doc__)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = getattr(mod, attr, None)
                if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                doc = obj.__doc__
                if doc and getattr(obj, "__module__", None) == mod.__name__:
                    texts.append(inspect.cleandoc(doc))
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def demo_weights(cfg: ModelConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """HF-named FP32 tensors, random normal (std 0.02 like HF init; norms 1)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    H, I, E, D = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.head_dim
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, H),
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": rnd(cfg.vocab_size, H),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
        w[p + "self_attn.q_proj.weight"] = rnd(cfg.num_heads * D, H)
        w[p + "self_attn.k_proj.weight"] = rnd(cfg.num_kv_heads * D, H)
        w[p + "self_attn.v_proj.weight"] = rnd(cfg.num_kv_heads * D, H)
        w[p + "self_attn.o_proj.weight"] = rnd(H, cfg.num_heads * D)
        w[p + "self_attn.q_norm.weight"] = torch.ones(D)
        w[p + "self_attn.k_norm.weight"] = torch.ones(D)
        w[p + "mlp.gate.weight"] = rnd(E, H)
        for e in range(E):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(I, H)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(I, H)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(H, I)
    return w


def hf_config_dict(cfg: ModelConfig, eos_id: int, bos_id: Optional[int]) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def write_gguf(path: str, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer_json: str,
               chat_template: Optional[str], eos_token: Optional[str], name: str) -> None:
    """The same weights as a GGUF file: matrices Q8_0 (gguf-py quantizer), norms F32."""
    import gguf
    from gguf.quants import quantize

    from freetoken.models.gguf_writer import ARCH, write_qwen3moe_metadata, write_tokenizer

    w = gguf.GGUFWriter(path, ARCH)
    write_qwen3moe_metadata(w, cfg, name)
    write_tokenizer(w, tokenizer_json, chat_template, eos_token)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(gname: str, t: torch.Tensor, quant: bool) -> None:
        a = t.float().numpy()
        if quant:
            w.add_tensor(gname, quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, a)

    add("token_embd.weight", weights["model.embed_tokens.weight"], True)
    add("output_norm.weight", weights["model.norm.weight"], False)
    add("output.weight", weights["lm_head.weight"], True)
    roles = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    for i in range(cfg.num_layers):
        for hf, gg in roles.items():
            t = weights[f"model.layers.{i}.{hf}.weight"]
            add(f"blk.{i}.{gg}.weight", t, quant=t.dim() == 2 and hf != "mlp.gate")
        for p in ("gate", "up", "down"):
            stack = torch.stack([weights[f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"] for e in range(cfg.num_experts)])
            add(f"blk.{i}.ffn_{p}_exps.weight", stack, True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(root: str) -> None:
    from safetensors.torch import save_file

    t0 = time.time()
    tok = train_tokenizer(corpus())
    vocab = tok.get_vocab_size()
    cfg = demo_config(vocab)
    eos = tok.token_to_id("<|im_end|>")
    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    weights = demo_weights(cfg)
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, eos, None), f, indent=2)
    with open(os.path.join(hf, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos, tok.token_to_id("<|endoftext|>")], "do_sample": True, "temperature": 0.7,
                   "top_p": 0.9}, f, indent=2)
    tok.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "bos_token": None, "add_bos_token": False, "model_max_length": cfg.max_position_embeddings}, f, indent=2)
    with open(os.path.join(hf, "README.md"), "w") as f:
        f.write("# FreeToken demo model\n\nA small Qwen3-MoE with RANDOM weights (seeded), built by FreeToken so that "
                "the engine runs without a download. It does not produce meaningful text. The tokenizer is a real "
                "byte-level BPE trained on Python standard-library docstrings.\n")
    write_gguf(os.path.join(root, "demo-qwen3moe-q8_0.gguf"), cfg, weights, tok.to_str(), CHAT_TEMPLATE,
               "<|im_end|>", "freetoken-demo")
    logger.info("built the demo model in %.1fs", time.time() - t0)


@functools.lru_cache(maxsize=1)
def _corpus_tag() -> str:
    h = hashlib.sha256()
    for t in corpus():
        h.update(t.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:10]


def ensure_demo_model(root: Optional[str] = None) -> DemoModel:
    """The demo model's paths, building it first if the cache lacks it."""
    base = root or os.path.join(cache_dir(), f"demo-qwen3moe-v{VERSION}-{_corpus_tag()}")
    out = DemoModel(base, os.path.join(base, "hf"), os.path.join(base, "demo-qwen3moe-q8_0.gguf"))
    if os.path.exists(os.path.join(base, "COMPLETE")):
        return out
    parent = os.path.dirname(base)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-build-", dir=parent)
    try:
        logger.info("building the built-in demo model (random weights) into %s", base)
        build(tmp)
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            f.write("ok\n")
        try:
            os.rename(tmp, base)
        except OSError:
            if not os.path.exists(os.path.join(base, "COMPLETE")):
                shutil.rmtree(base, ignore_errors=True)
                os.rename(tmp, base)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out

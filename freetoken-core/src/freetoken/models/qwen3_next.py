"""Qwen3-Next (HF ``Qwen3NextForCausalLM``, GGUF architecture ``qwen3next``): the hybrid
of :mod:`freetoken.models.qwen_hybrid` with the DeltaNet input projections fused per key
head in HF checkpoints (``in_proj_qkvz``, ``in_proj_ba``), ``norm_topk_prob`` from the
config, and dense-MLP layers where ``mlp_only_layers``/``decoder_sparse_step`` say."""

from __future__ import annotations

from typing import Any, Optional

from freetoken.models.qwen3_5_moe import gguf_hybrid_config, hybrid_config
from freetoken.models.qwen_hybrid import GGUF_NAMES, HF_NAMES, HybridConfig, QwenHybridModel

ARCHITECTURE = "qwen3_next"
HF_ARCHITECTURES = ("Qwen3NextForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3next",)

__all__ = ["Qwen3NextModel", "config_from_hf", "config_from_gguf", "HF_NAMES", "GGUF_NAMES"]


class Qwen3NextModel(QwenHybridModel):
    hf_fused_qkvz = True


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> HybridConfig:
    return hybrid_config(ARCHITECTURE, cfg, generation_config, "Qwen3-Next",
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                         mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                         decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1))  # fmt: skip


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> HybridConfig:
    a = meta.get("general.architecture", "qwen3next")
    return gguf_hybrid_config(ARCHITECTURE, meta, has_output,
                              norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)))  # fmt: skip

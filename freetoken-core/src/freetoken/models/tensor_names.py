"""Where the families' weights live in HF checkpoints and GGUF files.

A family names a layer's tensors by role (``in_norm``, ``post_norm``, ``q``/``k``/``v``/``o``,
``q_norm``/``k_norm``, ``router``, the dense MLP's ``mlp_gate``/``mlp_up``/``mlp_down``, the
expert stacks' ``*_exps``, ...). The roles most families store alike are here; a family
adds its own or overrides these in its module.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from freetoken.loading.tensors import TensorSource
    from freetoken.models.config import ModelConfig

logger = logging.getLogger(__name__)

#: the attention block's tensors as transformers' decoders name them (under ``model.layers.{i}.``)
HF_ATTENTION_ROLES = {
    "in_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}

#: llama.cpp's names of the same tensors (under ``blk.{i}.``); its converter stores the
#: norm after attention as ``ffn_norm`` for the llama-like families and as
#: ``post_attention_norm`` for others
GGUF_ATTENTION_ROLES = {
    "in_norm": "attn_norm.weight",
    "post_norm": "ffn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
}

#: the router and a dense SwiGLU MLP (``mlp.gate`` is the router in the Qwen and OLMoE
#: checkpoints), and transformers' fused expert stacks
HF_MLP_ROLES = {
    "router": "mlp.gate.weight",
    "mlp_gate": "mlp.gate_proj.weight",
    "mlp_up": "mlp.up_proj.weight",
    "mlp_down": "mlp.down_proj.weight",
    "gate_up_exps": "mlp.experts.gate_up_proj",
    "down_exps": "mlp.experts.down_proj",
}

GGUF_MLP_ROLES = {
    "router": "ffn_gate_inp.weight",
    "mlp_gate": "ffn_gate.weight",
    "mlp_up": "ffn_up.weight",
    "mlp_down": "ffn_down.weight",
    "gate_exps": "ffn_gate_exps.weight",
    "up_exps": "ffn_up_exps.weight",
    "down_exps": "ffn_down_exps.weight",
}


@dataclasses.dataclass(frozen=True)
class Names:
    """Where each weight lives in one checkpoint format; ``layer(i, role)`` names a layer's
    tensor by role (a role the format has no tensor for raises ``KeyError``)."""

    embed: str
    norm: str
    lm_head: str
    layer: Callable[[int, str], str]
    fmt: str  # "hf" | "gguf"


def hf_names(roles: dict[str, str]) -> Names:
    """:class:`Names` of a transformers decoder checkpoint whose layer tensors are
    ``model.layers.{i}.{roles[role]}``."""
    return Names(embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
                 layer=lambda i, r: f"model.layers.{i}.{roles[r]}", fmt="hf")  # fmt: skip


def gguf_names(roles: dict[str, str]) -> Names:
    """:class:`Names` of a llama.cpp GGUF file whose layer tensors are ``blk.{i}.{roles[role]}``."""
    return Names(embed="token_embd.weight", norm="output_norm.weight", lm_head="output.weight",
                 layer=lambda i, r: f"blk.{i}.{roles[r]}", fmt="gguf")  # fmt: skip


_LAYER_OF = {"hf": re.compile(r"^model\.layers\.(\d+)\."), "gguf": re.compile(r"^blk\.(\d+)\.")}


def skip_nextn_layers(source: TensorSource, names: Names, config: "ModelConfig") -> list[str]:
    """The tensors of layers past the decoder's last (the next-token-prediction layers),
    logged in one line; they are never read."""
    pattern = _LAYER_OF[names.fmt]
    skipped = sorted(n for n in source.names() if (m := pattern.match(n)) and int(m.group(1)) >= config.num_layers)
    if skipped:
        layers = sorted({int(pattern.match(n).group(1)) for n in skipped})  # type: ignore[union-attr]
        logger.info("skipping %d tensors of next-token-prediction layer(s) %s (not run): %s", len(skipped), layers,
                    ", ".join(skipped))  # fmt: skip
    return skipped

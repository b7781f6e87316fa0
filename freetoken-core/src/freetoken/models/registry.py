"""Which model family runs a checkpoint.

Adding a MoE family (Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V2/V3, GPT-OSS) means one
new module with ``config_from_hf``, ``config_from_gguf``, ``HF_NAMES``/``GGUF_NAMES``
and a model class, plus one :class:`ModelFamily` entry below.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from freetoken.loading.hf import CheckpointError


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    key: str
    module: str  # freetoken.models.<module>
    model_class: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]

    def load(self) -> Any:
        return importlib.import_module(self.module)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        key="qwen3_moe",
        module="freetoken.models.qwen3_moe",
        model_class="Qwen3MoeModel",
        hf_architectures=("Qwen3MoeForCausalLM",),
        gguf_architectures=("qwen3moe",),
    ),
    ModelFamily(
        key="mixtral",
        module="freetoken.models.mixtral",
        model_class="MixtralModel",
        hf_architectures=("MixtralForCausalLM",),
        gguf_architectures=("llama",),
    ),
    ModelFamily(
        key="olmoe",
        module="freetoken.models.olmoe",
        model_class="OlmoeModel",
        hf_architectures=("OlmoeForCausalLM",),
        gguf_architectures=("olmoe",),
    ),
    ModelFamily(
        key="gpt_oss",
        module="freetoken.models.gpt_oss",
        model_class="GptOssModel",
        hf_architectures=("GptOssForCausalLM",),
        gguf_architectures=("gpt-oss",),
    ),
    ModelFamily(
        key="qwen3_5_moe",
        module="freetoken.models.qwen3_5_moe",
        model_class="Qwen35MoeModel",
        hf_architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        gguf_architectures=("qwen35moe",),
    ),
    ModelFamily(
        key="qwen3_next",
        module="freetoken.models.qwen3_next",
        model_class="Qwen3NextModel",
        hf_architectures=("Qwen3NextForCausalLM",),
        gguf_architectures=("qwen3next",),
    ),
)


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint's architecture has no model family here."""


def supported_list() -> str:
    hf = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    gg = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    return f"HF architectures: {hf}; GGUF architectures: {gg}"


def family_for_hf(architecture: str, where: str = "") -> ModelFamily:
    for f in FAMILIES:
        if architecture in f.hf_architectures:
            return f
    raise UnsupportedArchitecture(
        f"{where + ': ' if where else ''}architecture {architecture!r} is not supported. Supported: {supported_list()}"
    )


def family_for_gguf(architecture: str, where: str = "") -> ModelFamily:
    for f in FAMILIES:
        if architecture in f.gguf_architectures:
            return f
    raise UnsupportedArchitecture(
        f"{where + ': ' if where else ''}GGUF architecture {architecture!r} is not supported. Supported: {supported_list()}"
    )

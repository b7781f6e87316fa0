"""Which model family runs a checkpoint.

:data:`FAMILIES` holds the eight families the engine runs, each with its module, model class,
HF ``architectures`` names and GGUF ``general.architecture`` values:

* ``qwen3_5_moe`` -- Qwen3.5/3.6-MoE (:mod:`freetoken.models.qwen3_5_moe`) and ``qwen3_next`` --
  Qwen3-Next (:mod:`freetoken.models.qwen3_next`), both the hybrid decoder of
  :mod:`freetoken.models.qwen_hybrid` (Gated DeltaNet and gated attention layers);
* ``qwen3_moe``, ``mixtral``, ``olmoe``, ``gpt_oss`` -- Qwen3-MoE, Mixtral, OLMoE, GPT-OSS
  (:mod:`freetoken.models.qwen3_moe`, :mod:`freetoken.models.mixtral`,
  :mod:`freetoken.models.olmoe`, :mod:`freetoken.models.gpt_oss`), and ``glm4_moe`` -- GLM-4.5
  (:mod:`freetoken.models.glm4_moe`), each a set of switches of :mod:`freetoken.models.moe_decoder`;
* ``deepseek_v3`` -- DeepSeek-V3/V3.1/R1, Kimi-K2 and DeepSeek-V2
  (:mod:`freetoken.models.deepseek_v3`), multi-head latent attention
  (:mod:`freetoken.models.mla`) over a cache of compressed latents.

:mod:`freetoken.models.loader` looks the checkpoint's architecture up here
(:func:`family_for_hf`, :func:`family_for_gguf`; anything else raises
:class:`UnsupportedArchitecture` naming the supported set) and imports the family's module.

Adding a family: one module in this package with ``config_from_hf(config, generation_config)``
and ``config_from_gguf(metadata, has_output)`` (a :class:`freetoken.models.config.ModelConfig`),
``HF_NAMES`` and ``GGUF_NAMES`` (where its tensors are in each format) and a model class that
the loader builds as ``cls(config, source, names, weight_policy, progress=...)``: ``layers``
whose MoE layers are :class:`freetoken.models.moe_layer.MoELayer` (the engine installs
their experts functions), ``forward(input_ids, positions, meta, kv_caches)`` returning the
final-normed hidden states, ``compute_logits(hidden)``, and ``attach_recurrent_state(pool)``
when the config declares recurrent layers. A pre-norm GQA decoder subclasses
:class:`freetoken.models.moe_decoder.MoeDecoderModel` and declares its :class:`~freetoken.models.moe_decoder.Arch`;
then one :class:`ModelFamily` entry below.
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
        key="glm4_moe",
        module="freetoken.models.glm4_moe",
        model_class="Glm4MoeModel",
        hf_architectures=("Glm4MoeForCausalLM",),
        gguf_architectures=("glm4moe",),
    ),
    ModelFamily(
        key="deepseek_v3",
        module="freetoken.models.deepseek_v3",
        model_class="DeepseekV3Model",
        hf_architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
        gguf_architectures=("deepseek2",),
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

"""The memory plan's dense bytes are counted from the checkpoint's own tensors (read here
independently: safetensors' and gguf-py's headers): every tensor but the routed experts,
at the activation dtype, routers float32; shared experts counted, next-token-prediction
layers past the last not."""

from __future__ import annotations

import os
import re
import sys

import torch
from safetensors import safe_open

from freetoken.loading.hf import HFCheckpoint, hf_architecture
from freetoken.models.loader import _hf_dense_bytes, gguf_model_shape
from freetoken.models.registry import family_for_hf

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_TESTS, "models_moe_families"))
sys.path.insert(0, os.path.join(_TESTS, "engine"))
import families  # noqa: E402
import test_engine_gguf as tg  # noqa: E402
from qwen35_helpers import FAMILIES as HYBRIDS, make_hf  # noqa: E402


def _count_safetensors(path: str, elt: int, num_layers: int) -> int:
    total = 0
    for f in sorted(os.listdir(path)):
        if not f.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                parts = name.split(".")
                if "experts" in parts and "shared_experts" not in parts:
                    continue
                m = re.search(r"layers\.(\d+)\.", name)
                if m and int(m.group(1)) >= num_layers:
                    continue
                n = st.get_slice(name).get_shape()
                size = 1
                for d in n:
                    size *= d
                router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight"))
                total += size * (4 if router else elt)
    return total


def test_hf_dense_bytes_count_every_dense_tensor(tmp_path) -> None:
    for family in ("mixtral", "olmoe", "gpt_oss", "glm4_moe"):
        path = str(tmp_path / family)
        families.save(families.make_model(family, seed=3), path)
        ck = HFCheckpoint(path)
        cfg = family_for_hf(hf_architecture(ck.config), path).load().config_from_hf(ck.config, ck.generation_config)
        for dtype, elt in ((torch.bfloat16, 2), (torch.float32, 4)):
            assert _hf_dense_bytes(ck, cfg, dtype) == _count_safetensors(path, elt, cfg.num_layers), family


def test_hybrid_dense_bytes_count_the_linear_attention_layers(tmp_path) -> None:
    """Qwen3.5-MoE / Qwen3-Next: linear-attention layers and shared experts, which the
    config's attention formula does not describe (it undercounts them)."""
    from freetoken.models.loader import model_shape

    for family in HYBRIDS:
        path = str(tmp_path / family)
        make_hf(family, path, seed=5)
        ck = HFCheckpoint(path)
        cfg = family_for_hf(hf_architecture(ck.config), path).load().config_from_hf(ck.config, ck.generation_config)
        counted = _hf_dense_bytes(ck, cfg, torch.bfloat16)
        assert counted == _count_safetensors(path, 2, cfg.num_layers), family
        assert counted > model_shape(cfg, torch.bfloat16).dense_bytes, family


def test_gguf_dense_bytes_count_every_dense_tensor(tmp_path) -> None:
    from gguf import GGUFReader

    path = str(tmp_path / "tiny.gguf")
    tg.write_tiny_gguf(path, seed=4)
    for dtype, elt in ((torch.bfloat16, 2), (torch.float32, 4)):
        want = sum(int(t.n_elements) * (4 if "ffn_gate_inp" in t.name else elt)
                   for t in GGUFReader(path).tensors if "_exps" not in t.name)
        assert gguf_model_shape(path, dtype).dense_bytes == want

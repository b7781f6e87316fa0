"""``bench make-model`` DeepSeek presets: DeepSeek-V3's shapes, llama.cpp's deepseek2 tensor
names and metadata keys, ``--layers``, and the engine runs the file."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken import SamplingParams
from freetoken.cli.bench.make_model import PRESETS, cut_layers, plan
from freetoken.handoff import Fmt
from helpers import engine_for
from make_model_files import check_layers_option, write_tiny_and_read


def test_deepseek_v3_preset_shape():
    c = PRESETS["deepseek-v3"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.vocab_size) == (7168, 61, 128, 129280)
    assert (c.num_experts, c.n_shared_experts, c.top_k, c.moe_intermediate_size) == (256, 1, 8, 2048)
    assert (c.first_k_dense_replace, c.intermediate_size, c.n_group, c.topk_group) == (3, 18432, 8, 4)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (1536, 512, 64,
                                                                                                     128, 128)
    assert c.routed_scaling_factor == 2.5 and c.scoring == "sigmoid" and c.norm_topk_prob
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    # the KV cache holds 512 + 64 values per token and layer (BF16: 61 x 576 x 2 bytes)
    assert c.kv_bytes_per_token(2) == 61 * 576 * 2
    # YaRN x40 with mscale_all_dim 1: softmax scale 192^-0.5 (0.1 ln 40 + 1)^2
    assert c.softmax_scale() == pytest.approx(192**-0.5 * (0.1 * 2.302585093 * 1.602059991 + 1) ** 2, rel=1e-6)
    tensors = {t.name: t for t in plan(c, "q4_k_m")}
    assert 395e9 < sum(t.nbytes for t in tensors.values()) < 415e9  # llama.cpp's Q4_K_M: about 404 GB
    assert tensors["blk.3.ffn_gate_exps.weight"].shape == (256, 2048, 7168)
    assert tensors["blk.3.ffn_gate_exps.weight"].fmt == Fmt.Q4_K
    assert tensors["blk.0.attn_k_b.weight"].shape == (128, 512, 128)
    assert tensors["blk.0.attn_v_b.weight"].shape == (128, 128, 512)
    assert tensors["blk.0.attn_q_b.weight"].shape == (128 * 192, 1536)
    assert tensors["blk.0.attn_kv_a_mqa.weight"].shape == (576, 7168)
    assert "blk.2.ffn_gate_inp.weight" not in tensors and "blk.3.exp_probs_b.bias" in tensors
    assert tensors["blk.2.ffn_gate.weight"].shape == (18432, 7168)
    # the config's attention size (the memory plan's estimate before loading) is the file's
    attn = [t for n, t in tensors.items() if n.startswith("blk.0.attn") and len(t.shape) > 1]
    assert c.attention_weights() == sum(int(np.prod(t.shape)) for t in attn) == 187_105_280
    two = cut_layers(c, 2)
    assert two.num_layers == 2 and two.first_k_dense_replace == 2 and two.mlp_only_layers == (0, 1)
    assert {t.name.split(".")[1] for t in plan(two, "q4_k_m") if t.name.startswith("blk.")} == {"0", "1"}


def test_deepseek_tiny_file_names_metadata_and_engine(tmp_path):
    from gguf.constants import MODEL_ARCH

    path, cfg, keys = write_tiny_and_read(tmp_path, "deepseek-v3-tiny", MODEL_ARCH.DEEPSEEK2, "deepseek2")
    a = "deepseek2"
    for key, want in ((f"{a}.block_count", 3), (f"{a}.leading_dense_block_count", 1), (f"{a}.expert_shared_count", 1),
                      (f"{a}.expert_gating_func", 2), (f"{a}.rope.dimension_count", 32),
                      (f"{a}.attention.head_count_kv", 1), (f"{a}.attention.key_length", 288),
                      (f"{a}.attention.value_length", 256), (f"{a}.attention.key_length_mla", 96),
                      (f"{a}.attention.value_length_mla", 64), (f"{a}.attention.q_lora_rank", 256),
                      (f"{a}.attention.kv_lora_rank", 256), (f"{a}.expert_group_count", 4),
                      (f"{a}.expert_group_used_count", 2)):  # fmt: skip
        assert int(keys[key].parts[-1][0]) == want, key
    eng = engine_for(path, max_model_len=1024)
    c = eng.model.config
    assert (c.num_layers, c.q_lora_rank, c.kv_lora_rank, c.first_k_dense_replace) == (3, 256, 256, 1)
    assert c.softmax_scale() == pytest.approx(cfg.softmax_scale(), rel=1e-6)
    assert eng.model.layers[0].mlp is not None and eng.model.layers[1].moe.shared is not None
    assert tuple(eng.kv.layers[0][0].shape[2:]) == (1, 288)
    r = eng.add_request(list(range(1, 100)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(r.output_ids) == 4 and all(0 <= t < cfg.vocab_size for t in r.output_ids)


def test_cli_layers(tmp_path, capsys):
    check_layers_option(tmp_path, capsys, "deepseek-v3-tiny", "deepseek-v3", "deepseek2", 61)

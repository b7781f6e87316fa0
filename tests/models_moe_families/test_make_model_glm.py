"""``bench make-model`` GLM-4.5 presets: GLM-4.5-Air's shapes, llama.cpp's glm4moe tensor
names and metadata keys, ``--layers``, and the engine runs the file."""

from __future__ import annotations

from freetoken import SamplingParams
from freetoken.cli.bench.make_model import PRESETS, cut_layers, plan
from freetoken.handoff import Fmt
from helpers import engine_for
from make_model_files import check_layers_option, write_tiny_and_read


def test_glm_45_air_preset_shape():
    c = PRESETS["glm-4.5-air"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (4096, 46, 96, 8,
                                                                                                    128, 64)
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.intermediate_size, c.vocab_size) == (128, 8, 1408,
                                                                                                    10944, 151552)
    assert (c.first_k_dense_replace, c.n_shared_experts, c.n_group, c.topk_group) == (1, 1, 1, 1)
    assert c.attention_bias and not c.use_qk_norm and c.norm_topk_prob and c.routed_scaling_factor == 1.0
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    tensors = {t.name: t for t in plan(c, "q4_k_m")}
    assert 70e9 < sum(t.nbytes for t in tensors.values()) < 80e9  # llama.cpp's Q4_K_M: about 73 GB
    # rows of 1408 and 10944 values are no multiple of 256: the down projections are Q8_0
    for n in ("blk.0.ffn_down.weight", "blk.5.ffn_down_exps.weight", "blk.5.ffn_down_shexp.weight"):
        assert tensors[n].fmt == Fmt.Q8_0
    assert tensors["blk.5.ffn_gate_exps.weight"].shape == (128, 1408, 4096)
    assert tensors["blk.5.ffn_gate_exps.weight"].fmt == Fmt.Q4_K
    assert "blk.0.ffn_gate_inp.weight" not in tensors and "blk.1.exp_probs_b.bias" in tensors
    two = cut_layers(c, 2)
    assert two.num_layers == 2 and two.mlp_only_layers == (0,)
    assert {t.name.split(".")[1] for t in plan(two, "q4_k_m") if t.name.startswith("blk.")} == {"0", "1"}


def test_glm_tiny_file_names_metadata_and_engine(tmp_path):
    from gguf.constants import MODEL_ARCH

    path, cfg, keys = write_tiny_and_read(tmp_path, "glm-4.5-air-tiny", MODEL_ARCH.GLM4_MOE, "glm4moe")
    a = "glm4moe"
    for key, want in ((f"{a}.block_count", 3), (f"{a}.leading_dense_block_count", 1), (f"{a}.expert_shared_count", 1),
                      (f"{a}.expert_gating_func", 2), (f"{a}.rope.dimension_count", 32),
                      (f"{a}.nextn_predict_layers", 0), (f"{a}.expert_feed_forward_length", 256)):  # fmt: skip
        assert int(keys[key].parts[-1][0]) == want, key
    eng = engine_for(path, max_model_len=1024)
    c = eng.model.config
    assert (c.num_layers, c.rotary_dim, c.first_k_dense_replace, c.attention_bias, c.use_qk_norm) == (3, 32, 1, True,
                                                                                                       False)
    assert eng.model.layers[0].mlp is not None and eng.model.layers[1].moe.shared is not None
    r = eng.add_request(list(range(1, 100)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(r.output_ids) == 4 and all(0 <= t < cfg.vocab_size for t in r.output_ids)


def test_cli_layers(tmp_path, capsys):
    check_layers_option(tmp_path, capsys, "glm-4.5-air-tiny", "glm-4.5-air", "glm4moe", 46)

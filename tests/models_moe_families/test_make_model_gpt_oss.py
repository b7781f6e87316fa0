"""``bench make-model`` GPT-OSS presets: llama.cpp's gpt-oss tensor names and types, and the
engine runs the file."""

from __future__ import annotations

import dataclasses

import pytest

from freetoken import SamplingParams
from freetoken.cli.bench.make_model import PRESETS, plan, write
from helpers import engine_for


def test_gpt_oss_20b_preset_shape():
    c = PRESETS["gpt-oss-20b"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2880, 24, 64, 8, 64)
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.vocab_size) == (32, 4, 2880, 201088)
    total = sum(t.nbytes for t in plan(c, "mxfp4"))
    assert 11.5e9 < total < 13.5e9  # the published MXFP4 GGUF is about 12.1 GB
    with pytest.raises(ValueError, match="mxfp4 or q8_0"):
        plan(c, "q4_k_m")


def test_gpt_oss_tiny_file_names_and_engine(tmp_path):
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    path = str(tmp_path / "gpt-oss-tiny.gguf")
    cfg = dataclasses.replace(PRESETS["gpt-oss-tiny"])
    write(path, cfg, "mxfp4", seed=3, progress=False)
    reader = gguf.GGUFReader(path)
    known = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[MODEL_ARCH.GPT_OSS] for i in range(cfg.num_layers)}
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {n.rsplit(".", 1)[0] for n in types} <= known
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    eng = engine_for(path, max_model_len=1024)
    assert [L.window for L in eng.model.layers] == [128, None]
    r = eng.add_request(list(range(1, 200)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(r.output_ids) == 4 and all(0 <= t < cfg.vocab_size for t in r.output_ids)


def test_gpt_oss_presets_default_to_mxfp4(tmp_path, capsys):
    """Without --quant a GPT-OSS preset is written as its published files are (MXFP4 experts),
    the others as Q4_K_M; an explicit K-quant for GPT-OSS is refused naming the formats."""
    import gguf

    from freetoken.cli.main import main

    path = tmp_path / "gpt-oss-tiny.gguf"
    assert main(["bench", "make-model", "--preset", "gpt-oss-tiny", "--out", str(path)]) == 0
    assert "mxfp4" in capsys.readouterr().out
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert main(["bench", "make-model", "--preset", "gpt-oss-tiny", "--quant", "q4_k_m", "--out", str(path)]) == 2
    assert "mxfp4 or q8_0, as llama.cpp writes them" in capsys.readouterr().err


def test_gpt_oss_120b_preset_shape_and_cut():
    from freetoken.cli.bench.make_model import cut_layers

    c = PRESETS["gpt-oss-120b"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2880, 36, 64, 8, 64)
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.vocab_size) == (128, 4, 2880, 201088)
    total = sum(t.nbytes for t in plan(c, "mxfp4"))
    assert 62e9 < total < 65e9  # the published MXFP4 GGUF is about 63.4 GB
    cut = plan(cut_layers(c, 6), "mxfp4")
    layers = {int(t.name.split(".")[1]) for t in cut if t.name.startswith("blk.")}
    assert layers == set(range(6)) and sum(t.nbytes for t in cut) < total / 5

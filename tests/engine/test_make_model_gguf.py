"""``freetoken bench make-model`` files: the metadata, tensor set and Q4_K_M mix that
llama.cpp's qwen3moe loader needs (read back with gguf-py), valid blocks, and FreeToken
loading the same file and generating from token ids."""

from __future__ import annotations

import dataclasses
import os
import types

import numpy as np
import pytest

from freetoken import SamplingParams
from freetoken.handoff import Fmt
from freetoken.loading.tensors import BLOCK_SIZES
from helpers import engine_for

# The keys llama.cpp reads for qwen3moe without a default (src/llama-model.cpp load_hparams,
# src/models/qwen3moe.cpp) plus the ones whose defaults would be wrong for Qwen3 (head size
# 128 != hidden / heads, rope base 1e6, expert sizes).
ARCH_KEYS = (
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
    "attention.value_length", "rope.freq_base", "expert_count", "expert_used_count", "expert_feed_forward_length",
)


def _field(reader, key: str):
    f = reader.fields.get(key)
    assert f is not None, f"{key} missing"
    return f.contents()


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from freetoken.cli.main import main

    path = str(tmp_path_factory.mktemp("make_model") / "tiny.gguf")
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--seed", "3", "--out", path]) == 0
    return path


def test_llamacpp_metadata(tiny_file):
    import gguf

    from freetoken.cli.bench.make_model import PRESETS

    cfg = PRESETS["qwen3-moe-tiny"]
    r = gguf.GGUFReader(tiny_file)
    assert _field(r, "general.architecture") == "qwen3moe"
    # llama.cpp refuses a file without tokenizer.ggml.model; "none" = no text, vocab_size dummy tokens
    assert _field(r, "tokenizer.ggml.model") == "none"
    assert _field(r, "qwen3moe.vocab_size") == cfg.vocab_size
    for k in ARCH_KEYS:
        _field(r, f"qwen3moe.{k}")
    assert _field(r, "qwen3moe.block_count") == cfg.num_layers
    assert _field(r, "qwen3moe.attention.key_length") == cfg.head_dim
    assert _field(r, "qwen3moe.expert_count") == cfg.num_experts
    assert _field(r, "qwen3moe.expert_feed_forward_length") == cfg.moe_intermediate_size
    assert _field(r, "general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M

    # every tensor llama.cpp's qwen3moe loader creates, in ggml's dimension order (ne0 first)
    H, D, E, I, V = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    want = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        want.update({
            b + "attn_norm.weight": (H,), b + "attn_q.weight": (H, cfg.num_heads * D),
            b + "attn_k.weight": (H, cfg.num_kv_heads * D), b + "attn_v.weight": (H, cfg.num_kv_heads * D),
            b + "attn_output.weight": (cfg.num_heads * D, H), b + "attn_q_norm.weight": (D,),
            b + "attn_k_norm.weight": (D,), b + "ffn_norm.weight": (H,), b + "ffn_gate_inp.weight": (H, E),
            b + "ffn_gate_exps.weight": (H, I, E), b + "ffn_up_exps.weight": (H, I, E),
            b + "ffn_down_exps.weight": (I, H, E),
        })
    got = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert got == want
    # the data section ends where the file does: nothing truncated
    last = max(r.tensors, key=lambda t: t.data_offset)
    assert last.data_offset + last.n_bytes == os.path.getsize(tiny_file)

    # Q4_K_M (llama.cpp llama_tensor_get_type, 4 layers: use_more_bits holds for layers 2 and 3)
    types_ = {t.name: t.tensor_type.name for t in r.tensors}
    assert types_["output.weight"] == "Q6_K" and types_["token_embd.weight"] == "Q4_K"
    for i in range(cfg.num_layers):
        more = "Q6_K" if i in (2, 3) else "Q4_K"
        assert types_[f"blk.{i}.attn_v.weight"] == more, i
        assert types_[f"blk.{i}.ffn_down_exps.weight"] == more, i
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types_[f"blk.{i}.{n}.weight"] == "Q4_K", (i, n)
        for n in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp"):
            assert types_[f"blk.{i}.{n}.weight"] == "F32", (i, n)


def test_blocks_dequantize_to_varied_finite_weights(tiny_file):
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(tiny_file)
    by = {t.name: t for t in r.tensors}
    for name in ("blk.0.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight", "output.weight", "blk.1.attn_q.weight"):
        t = by[name]
        w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        rows = w.reshape(-1, w.shape[-1])
        assert np.isfinite(rows).all(), name
        assert 1e-4 < float(np.abs(rows).max()) < 1.0, name  # O(0.01) weights
        assert float(rows.std()) > 1e-4, name
        # rows are not copies of each other (the block pool repeats only every POOL_BLOCKS blocks)
        assert len({rows[i].tobytes() for i in range(min(64, len(rows)))}) == min(64, len(rows)), name
    # experts of one tensor differ, and so do two tensors of one format
    g = dequantize(np.asarray(by["blk.0.ffn_gate_exps.weight"].data), by["blk.0.ffn_gate_exps.weight"].tensor_type)
    assert not np.array_equal(g[0], g[1])
    u = dequantize(np.asarray(by["blk.0.ffn_up_exps.weight"].data), by["blk.0.ffn_up_exps.weight"].tensor_type)
    assert not np.array_equal(g, u)


def test_freetoken_generates_from_token_ids(tiny_file):
    from freetoken.engine.llm import LLM
    from freetoken.loading.tokenizer import NoTokenizerError

    eng = engine_for(tiny_file)
    assert eng.tokenizer.has_text is False
    assert eng.tokenizer.vocab_size == 32768
    with pytest.raises(NoTokenizerError, match="token ids only"):
        eng.tokenizer.encode("hello")
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = eng, eng.tokenizer
    out = llm.generate([[1, 2, 3, 4, 5], [7, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for o in out:
        assert len(o.token_ids) == 6 and o.text == ""
        assert all(0 <= t < 32768 for t in o.token_ids)
    # the logits carry the weights: two different prompts do not give the same distribution
    a, b = eng.prompt_logits([1, 2, 3]), eng.prompt_logits([30000, 2, 3])
    assert np.isfinite(a.float().numpy()).all()
    assert float((a[-1] - b[-1]).abs().max()) > 0


def test_full_size_plan_follows_q4_k_m():
    """The 48-layer Qwen3-30B-A3B plan without writing it: llama.cpp's Q4_K_M puts Q6_K in
    attn_v and ffn_down_exps of 24 layers (0-5, 42-47, and every third from 8 to 41)."""
    from freetoken.cli.bench.make_model import PRESETS, plan

    cfg = PRESETS["qwen3-30b-a3b"]
    ts = {t.name: t for t in plan(cfg, "q4_k_m")}
    more = [i for i in range(48) if ts[f"blk.{i}.ffn_down_exps.weight"].fmt == Fmt.Q6_K]
    assert more == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert more == [i for i in range(48) if ts[f"blk.{i}.attn_v.weight"].fmt == Fmt.Q6_K]
    assert ts["output.weight"].fmt == Fmt.Q6_K and ts["token_embd.weight"].fmt == Fmt.Q4_K
    # bytes per value: Q4_K 144 per 256, Q6_K 210 per 256, F32 4
    q4, q6 = 144 / 256, 210 / 256
    want = 151936 * 2048 * (q4 + q6) + 2048 * 4
    for i in range(48):
        m = q6 if i in more else q4
        want += 2 * 128 * 768 * 2048 * q4 + 128 * 2048 * 768 * m  # experts
        want += (4096 * 2048 + 512 * 2048 + 2048 * 4096) * q4 + 512 * 2048 * m  # attention
        want += (128 * 2048 + 2 * 2048 + 2 * 128) * 4  # router, norms
    assert sum(t.nbytes for t in ts.values()) == want == 18_550_716_416


def test_qwen3_235b_a22b_preset_is_the_published_q4_k_m_size():
    """94 layers of 128 experts of 1536 (top-8), 64 q / 4 kv heads: the published Q4_K_M
    file is about 142 GB; --layers keeps the per-layer shape."""
    from freetoken.cli.bench.make_model import PRESETS, cut_layers, plan

    cfg = PRESETS["qwen3-235b-a22b"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == \
        (94, 4096, 128, 8, 1536)
    total = sum(t.nbytes for t in plan(cfg, "q4_k_m"))
    assert 138e9 < total < 146e9
    cut = {t.name: t for t in plan(cut_layers(cfg, 8), "q4_k_m")}
    assert cut["blk.7.ffn_gate_exps.weight"].nbytes == 128 * 1536 * 4096 * 144 // 256
    assert "blk.8.ffn_gate_exps.weight" not in cut


def test_layers_option_cuts_the_file(tmp_path):
    import gguf

    from freetoken.cli.main import main

    p = str(tmp_path / "two.gguf")
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--layers", "2", "--out", p]) == 0
    r = gguf.GGUFReader(p)
    assert _field(r, "qwen3moe.block_count") == 2
    assert {t.name.split(".")[1] for t in r.tensors if t.name.startswith("blk.")} == {"0", "1"}
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--layers", "0", "--out", p]) == 2


def test_block_pool_tiles_valid_blocks():
    from freetoken.models.gguf_writer import RandomBlockPool

    pool = RandomBlockPool(np.random.default_rng(5), pool_blocks=7)
    per, nb = BLOCK_SIZES[int(Fmt.Q4_K)]
    a = pool.blocks(Fmt.Q4_K, 5, 3 * per)  # 15 blocks over a pool of 7: wraps twice
    assert a.shape == (5, 3 * nb)
    blocks = a.reshape(15, nb)
    p = pool.pool(Fmt.Q4_K)
    start = next(s for s in range(7) if np.array_equal(blocks[0], p[s]))
    for j in range(15):
        assert np.array_equal(blocks[j], p[(start + j) % 7]), j
    d = p[:, 0:2].copy().view(np.float16).astype(np.float32).ravel()
    assert np.isfinite(d).all() and (d > 0).all() and len(set(d.tolist())) > 1
    with pytest.raises(ValueError, match="multiple of 256"):
        pool.blocks(Fmt.Q4_K, 1, 100)


@pytest.mark.parametrize("stored_tokens", [False, True])
def test_none_tokenizer_is_ids_only(stored_tokens):
    """``tokenizer.ggml.model = "none"`` is ids only even when token strings are stored."""
    from freetoken.loading.tokenizer import IdsOnlyTokenizer, load_gguf_tokenizer

    fields = {"tokenizer.ggml.tokens": ["a", "b", "c"]} if stored_tokens else {}
    ck = types.SimpleNamespace(metadata={"tokenizer.ggml.model": "none"}, path="x.gguf", field=fields.get)
    tok = load_gguf_tokenizer(ck, 3)
    assert isinstance(tok, IdsOnlyTokenizer) and tok.vocab_size == 3 and tok.eos_token_ids == []


def test_make_model_preset_shapes_fit_block_sizes():
    """Every packed row of every preset is a whole number of K-quant blocks."""
    from freetoken.cli.bench.make_model import PRESETS, plan

    for name, cfg in PRESETS.items():
        quant = "q8_0" if cfg.architecture == "gpt_oss" else "q4_k_m"  # GPT-OSS: hidden 2880, 32-value blocks
        for t in plan(dataclasses.replace(cfg, num_layers=1), quant):
            if t.fmt not in (Fmt.F32, Fmt.F16):
                assert t.shape[-1] % BLOCK_SIZES[int(t.fmt)][0] == 0, (name, t.name)


def test_parallel_writer_lays_out_the_planned_tensors(tmp_path):
    """The threaded pwrite path puts every tensor's bytes where gguf-py's tensor infos say,
    the same bytes ``Planned.make`` gives for the seed, whatever the thread count."""
    import gguf

    from freetoken.cli.bench.make_model import PRESETS, plan, write
    from freetoken.models.gguf_writer import RandomBlockPool

    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_layers=2)
    paths = [str(tmp_path / f"t{n}.gguf") for n in (1, 3)]
    for p, n in zip(paths, (1, 3)):
        write(p, cfg, "q4_k_m", seed=11, progress=False, threads=n)
    a, b = (open(p, "rb").read() for p in paths)
    assert a == b
    rng = np.random.default_rng(11)
    pool = RandomBlockPool(rng)
    ref = {t.name: t.make(rng, pool) for t in plan(cfg, "q4_k_m")}
    r = gguf.GGUFReader(paths[1])
    assert [t.name for t in r.tensors] == list(ref)
    for t in r.tensors:
        got = np.asarray(t.data).reshape(-1).view(np.uint8)
        assert np.array_equal(got, ref[t.name].reshape(-1).view(np.uint8)), t.name


# ------------------------------------------------------------------ Qwen3.5-MoE presets

# The text model of Qwen/Qwen3.5-35B-A3B's published config.json (model_type qwen3_5_moe, the
# language model under text_config; Qwen3.6-35B-A3B has the same shapes).
QWEN35_35B_A3B_TEXT_CONFIG = {
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attn_output_gate": True, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}  # fmt: skip

# The keys llama.cpp reads for qwen35moe (src/models/qwen35moe.cpp load_arch_hparams plus the
# common ones of src/llama-model.cpp) that have no default or a default wrong for Qwen3.5.
QWEN35_KEYS = (
    "block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "rope.dimension_sections", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.inner_size",
    "ssm.state_size", "ssm.time_step_rank", "ssm.group_count", "full_attention_interval",
)  # fmt: skip


def qwen35_loader_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's qwen35moe loader creates, in ggml's dimension order (ne0
    first), from the hyper-parameters as that loader derives them."""
    H, D, E, I, V = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    S = cfg.shared_expert_intermediate_size
    head_k = head_v = cfg.linear_key_dim  # ssm.state_size serves both
    key_dim, value_dim = head_k * cfg.linear_key_heads, head_v * cfg.linear_value_heads
    want = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": (H,), b + "post_attention_norm.weight": (H,)})
        if (i + 1) % 4 == 0:
            want.update({
                b + "attn_q.weight": (H, D * cfg.num_heads * 2), b + "attn_k.weight": (H, D * cfg.num_kv_heads),
                b + "attn_v.weight": (H, D * cfg.num_kv_heads), b + "attn_output.weight": (D * cfg.num_heads, H),
                b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,),
            })
        else:
            want.update({
                b + "attn_qkv.weight": (H, 2 * key_dim + value_dim), b + "attn_gate.weight": (H, value_dim),
                b + "ssm_conv1d.weight": (cfg.conv_kernel, 2 * key_dim + value_dim),
                b + "ssm_dt.bias": (cfg.linear_value_heads,), b + "ssm_a": (cfg.linear_value_heads,),
                b + "ssm_beta.weight": (H, cfg.linear_value_heads), b + "ssm_alpha.weight": (H, cfg.linear_value_heads),
                b + "ssm_norm.weight": (head_v,), b + "ssm_out.weight": (value_dim, H),
            })
        want.update({
            b + "ffn_gate_inp.weight": (H, E), b + "ffn_gate_exps.weight": (H, I, E),
            b + "ffn_up_exps.weight": (H, I, E), b + "ffn_down_exps.weight": (I, H, E), b + "ffn_gate_inp_shexp.weight": (H,),
            b + "ffn_gate_shexp.weight": (H, S), b + "ffn_up_shexp.weight": (H, S), b + "ffn_down_shexp.weight": (S, H),
        })
    return want


def qwen35_q4_k_m(name: str, n_layers: int) -> str:
    """llama.cpp's Q4_K_M type for a qwen35moe tensor (src/llama-quant.cpp): attn_v and attn_qkv
    are its attn_v-like tensors (one per layer, counted in file order), ffn_down* its
    ffn_down; 1-D tensors, norms, ffn_gate_inp and ssm_conv1d are not quantized."""
    if name == "output.weight":
        return "Q6_K"
    if name == "token_embd.weight":
        return "Q4_K"
    if name == "output_norm.weight":
        return "F32"
    layer = int(name.split(".")[1])
    base = name.split(".")[2]
    if base in ("ssm_conv1d", "ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_dt", "ssm_a") or base.endswith("norm"):
        return "F32"
    more = layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
    if base in ("attn_v", "attn_qkv", "ffn_down_exps", "ffn_down_shexp") and more:
        return "Q6_K"
    return "Q4_K"


@pytest.fixture(scope="module")
def qwen35_tiny_file(tmp_path_factory):
    from freetoken.cli.main import main

    path = str(tmp_path_factory.mktemp("make_model_q35") / "q35tiny.gguf")
    assert main(["bench", "make-model", "--preset", "qwen3.5-moe-tiny", "--seed", "5", "--out", path]) == 0
    return path


def test_qwen35_preset_is_the_published_config():
    """The preset equals what FreeToken reads from the published config.json."""
    from freetoken.cli.bench.make_model import PRESETS
    from freetoken.models import qwen3_5_moe

    ref = qwen3_5_moe.config_from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                      "model_type": "qwen3_5_moe", "text_config": QWEN35_35B_A3B_TEXT_CONFIG})
    cfg = PRESETS["qwen3.5-35b-a3b"]
    skip = {"value_heads_tiled", "eos_token_ids", "bos_token_id"}  # GGUF layout; no tokenizer in the file
    for f in dataclasses.fields(ref):
        if f.name not in skip:
            assert getattr(cfg, f.name) == getattr(ref, f.name), f.name
    assert cfg.kv_layers == tuple(range(3, 40, 4)) and cfg.rotary_dim == 64


def test_qwen35_metadata_round_trips_through_gguf(tmp_path):
    """The full 40-layer preset's metadata (no tensors) read back by FreeToken's GGUF config
    reader gives the preset, and carries every key llama.cpp's qwen35moe loader needs."""
    import gguf

    from freetoken.cli.bench.make_model import PRESETS
    from freetoken.loading.gguf import GGUFCheckpoint
    from freetoken.models.gguf_writer import write_hybrid_metadata, write_ids_only_vocab
    from freetoken.models import qwen3_5_moe

    cfg = PRESETS["qwen3.5-35b-a3b"]
    p = str(tmp_path / "meta.gguf")
    w = gguf.GGUFWriter(p, "qwen35moe")
    write_hybrid_metadata(w, cfg, "meta only")
    write_ids_only_vocab(w, cfg.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    meta = GGUFCheckpoint(p).metadata
    for k in QWEN35_KEYS:
        assert f"qwen35moe.{k}" in meta, k
    assert list(meta["qwen35moe.rope.dimension_sections"]) == [11, 11, 10, 0]  # the config's mrope_section
    assert meta["qwen35moe.full_attention_interval"] == 4
    assert "qwen35moe.attention.recurrent_layers" not in meta  # the interval says it all
    back = qwen3_5_moe.config_from_gguf(meta, has_output=True)
    for f in dataclasses.fields(back):
        if f.name in ("eos_token_ids", "bos_token_id"):
            continue
        want = getattr(cfg, f.name)
        want = pytest.approx(want, rel=1e-7) if isinstance(want, float) else want  # stored as float32
        assert getattr(back, f.name) == want, f.name


@pytest.mark.parametrize("layers", [4, 40])
def test_qwen35_plan_is_llamacpp_tensor_set_and_mix(layers):
    """The real preset's plan (first ``layers`` layers, as ``--layers`` cuts it): llama.cpp's
    qwen35moe tensor set and shapes, its Q4_K_M types, and the byte count."""
    from freetoken.cli.bench.make_model import PRESETS, cut_layers, plan
    from freetoken.loading.tensors import row_bytes

    cfg = cut_layers(PRESETS["qwen3.5-35b-a3b"], layers)
    assert cfg.layer_types == tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                    for i in range(layers))  # fmt: skip
    ts = plan(cfg, "q4_k_m")
    got = {t.name: tuple(reversed(t.shape)) for t in ts}
    assert got == qwen35_loader_tensors(cfg)
    for t in ts:
        assert Fmt(t.fmt).name == qwen35_q4_k_m(t.name, layers), t.name
    total = 0
    for name, ne in qwen35_loader_tensors(cfg).items():
        fmt = getattr(Fmt, qwen35_q4_k_m(name, layers))
        total += int(np.prod(ne[1:], dtype=np.int64)) * (4 * ne[0] if fmt == Fmt.F32 else row_bytes(fmt, ne[0]))
    assert sum(t.nbytes for t in ts) == total
    if layers == 40:
        assert 19.5 < total / 2**30 < 20.0  # ~19.7 GiB: Q4_K_M of the 35B text model without its MTP layer


def test_qwen35_tiny_file_layout(qwen35_tiny_file):
    import gguf
    from gguf.quants import dequantize

    from freetoken.cli.bench.make_model import PRESETS

    cfg = PRESETS["qwen3.5-moe-tiny"]
    r = gguf.GGUFReader(qwen35_tiny_file)
    assert _field(r, "general.architecture") == "qwen35moe"
    assert _field(r, "tokenizer.ggml.model") == "none"
    assert _field(r, "qwen35moe.vocab_size") == cfg.vocab_size
    assert _field(r, "general.file_type") == 15
    for k in QWEN35_KEYS:
        _field(r, f"qwen35moe.{k}")
    got = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert got == qwen35_loader_tensors(cfg)
    for t in r.tensors:
        assert t.tensor_type.name == qwen35_q4_k_m(t.name, cfg.num_layers), t.name
    last = max(r.tensors, key=lambda t: t.data_offset)
    assert last.data_offset + last.n_bytes == os.path.getsize(qwen35_tiny_file)
    by = {t.name: t for t in r.tensors}
    a = np.asarray(by["blk.0.ssm_a"].data, dtype=np.float64)
    assert ((a > -16) & (a < -1)).all() and len(set(a.tolist())) == a.size  # decay rates -exp(A_log)
    assert (np.asarray(by["blk.1.ssm_dt.bias"].data) > 0).all()
    for name in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ffn_down_shexp.weight",
                 "blk.1.ssm_beta.weight", "blk.3.ffn_down_exps.weight"):  # fmt: skip
        t = by[name]
        w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        rows = w.reshape(-1, w.shape[-1])
        assert np.isfinite(rows).all() and 1e-4 < float(np.abs(rows).max()) < 1.0, name
        assert len({rows[i].tobytes() for i in range(min(32, len(rows)))}) == min(32, len(rows)), name


def test_qwen35_tiny_file_runs_in_freetoken(qwen35_tiny_file):
    """FreeToken loads the file as qwen3_5_moe (both layer types, shared experts) and
    generates from token ids; different prompts give different logits."""
    from freetoken.engine.llm import LLM

    eng = engine_for(qwen35_tiny_file)
    assert eng.model_config.architecture == "qwen3_5_moe"
    assert eng.model_config.kv_layers == (3,) and eng.model_config.recurrent.layers == (0, 1, 2)
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = eng, eng.tokenizer
    out = llm.generate([[1, 2, 3, 4, 5], [7, 9]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for o in out:
        assert len(o.token_ids) == 5 and all(0 <= t < 32768 for t in o.token_ids)
    a, b = eng.prompt_logits([1, 2, 3]), eng.prompt_logits([30000, 2, 3])
    assert np.isfinite(a.float().numpy()).all()
    assert float((a[-1] - b[-1]).abs().max()) > 0


def test_router_skew_scales_router_rows_only(tmp_path):
    """--router-skew S: each router row is the unskewed file's row times exp(-S r / E) for a
    rank r, the ranks a permutation of the experts that differs between layers and is not
    the identity (the hot experts are not the lowest ids); every other tensor is
    byte-identical (same seed, same draws), and random hidden states then route mostly to
    the quarter of the experts with the lowest ranks."""
    import gguf

    from freetoken.cli.main import main

    base, skewed = str(tmp_path / "base.gguf"), str(tmp_path / "skewed.gguf")
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--seed", "4", "--out", base]) == 0
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--seed", "4", "--router-skew", "3",
                 "--out", skewed]) == 0
    a = {t.name: t for t in gguf.GGUFReader(base).tensors}
    b = {t.name: t for t in gguf.GGUFReader(skewed).tensors}
    assert a.keys() == b.keys()
    routers = [n for n in a if n.endswith("ffn_gate_inp.weight")]
    assert len(routers) > 1
    ranks = []
    for name in a:
        x, y = np.asarray(a[name].data), np.asarray(b[name].data)
        if name not in routers:
            assert np.array_equal(x, y), name
            continue
        e = x.shape[0]
        scales = np.exp(-3.0 * np.arange(e, dtype=np.float32) / e)
        ratio = np.median(y / x, axis=1)  # each row's factor
        rank = np.abs(ratio[:, None] - scales[None, :]).argmin(axis=1)
        assert sorted(rank.tolist()) == list(range(e))  # a permutation of the ranks
        np.testing.assert_array_equal(y, (x * scales[rank][:, None]).astype(np.float32))
        ranks.append(tuple(rank.tolist()))
        h = np.random.default_rng(0).standard_normal((4000, x.shape[1]), dtype=np.float32)
        top = {"base": np.argsort(-(h @ x.T), axis=1)[:, :2], "skewed": np.argsort(-(h @ y.T), axis=1)[:, :2]}
        hot = {k: float((rank[v] < e // 4).mean()) for k, v in top.items()}
        assert hot["skewed"] > 2 * hot["base"], hot  # the lowest-ranked quarter takes most routes
    assert len(set(ranks)) == len(ranks) and tuple(range(len(ranks[0]))) not in ranks
    assert main(["bench", "make-model", "--preset", "qwen3-moe-tiny", "--router-skew", "-1",
                 "--out", str(tmp_path / "bad.gguf")]) == 2


@pytest.mark.parametrize("fmt", [Fmt.Q4_K, Fmt.Q5_K])
def test_centered_kquant_blocks_are_zero_mean(fmt):
    """gguf-py's dequantization of centered Q4_K/Q5_K blocks: zero-mean weights; the
    uncentered ones (independent random scales and mins) have a mean near their spread."""
    import gguf

    from freetoken.models.gguf_writer import random_blocks

    gq = gguf.GGMLQuantizationType[Fmt(fmt).name]
    for centered, bound in ((True, 0.02), (False, None)):
        w = gguf.quants.dequantize(random_blocks(fmt, 64, 2048, np.random.default_rng(1), centered=centered), gq)
        ratio = float(np.mean(w) / np.std(w))
        assert np.isfinite(w).all() and np.std(w) > 0
        if bound is None:
            assert ratio > 0.5
        else:
            assert abs(ratio) < bound


def test_synthetic_model_routes_tokens_apart(tmp_path):
    """Each layer's router sends random tokens to many different experts (a random-weight
    file whose hidden states collapse onto one direction routed every token of its deeper
    layers to the same few experts): the prompt's routes of a 6-layer file cover at least
    three quarters of the experts in every layer, and no expert takes over a quarter."""
    from freetoken.cli.bench.make_model import PRESETS, write
    from freetoken.models.moe_layer import MoELayer

    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_layers=6)
    path = str(tmp_path / "six.gguf")
    write(path, cfg, "q4_k_m", seed=5, progress=False, threads=1)
    routes: dict[int, list[np.ndarray]] = {}
    route = MoELayer.route

    def recording(self, x):
        ids, w = route(self, x)
        routes.setdefault(self.layer, []).append(ids.cpu().numpy().copy())
        return ids, w

    MoELayer.route = recording
    try:
        eng = engine_for(path, max_model_len=256)
        rng = np.random.default_rng(2)
        eng.add_request(rng.integers(0, cfg.vocab_size, size=96).tolist(), SamplingParams(max_tokens=1))
        while eng.has_work():
            eng.step()
        eng.close()
    finally:
        MoELayer.route = route
    assert sorted(routes) == list(range(cfg.num_layers))
    for layer, calls in routes.items():
        ids = np.concatenate([c.reshape(-1) for c in calls])
        counts = np.bincount(ids, minlength=cfg.num_experts)
        assert (counts > 0).sum() >= 0.75 * cfg.num_experts, (layer, counts.tolist())
        assert counts.max() <= 0.25 * ids.size, (layer, counts.tolist())

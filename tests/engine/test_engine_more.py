"""Sharded checkpoints, the qwen2 pre-tokenizer from GGUF, chunked-prefill
scheduling and `freetoken generate --chat`."""

from __future__ import annotations

import io
import json
import os
import random

import torch

from freetoken import SamplingParams
from helpers import engine_for, hf_logits, make_hf


def test_sharded_safetensors(tmp_path):
    seed = random.randrange(1 << 30)
    model = make_hf(str(tmp_path / "one"), seed)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="200KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    eng = engine_for(str(tmp_path / "sharded"))
    ids = [random.Random(seed).randrange(160) for _ in range(12)]
    torch.testing.assert_close(eng.prompt_logits(ids), hf_logits(model, ids), atol=2e-4, rtol=1e-4)


def test_gguf_qwen2_pretokenizer_matches_hf(tmp_path):
    """A GGUF vocabulary with tokenizer.ggml.pre = qwen2 splits text like the HF
    tokenizer.json with Qwen2's split regex."""
    import gguf
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from freetoken.loading.gguf import GGUFCheckpoint
    from freetoken.models.gguf_writer import write_tokenizer
    from freetoken.loading.split_rules import SPLIT_RULES
    from freetoken.loading.tokenizer import load_gguf_tokenizer
    from freetoken.models.demo import corpus, train_tokenizer

    tok = train_tokenizer(corpus()[:400], vocab_size=1500)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_RULES["qwen2"][0]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf = Tokenizer.from_str(tok.to_str())
    p = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(p, "qwen3moe")
    write_tokenizer(w, tok.to_str(), None, "<|im_end|>", pre="qwen2")
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gg = load_gguf_tokenizer(GGUFCheckpoint(p), 1500)
    for text in ["Hello world, it's 12345 items!\n\n  x = f(y)\t# done", "don't STOP  here...   ok\r\n", "日本語 und Ümlaute"]:
        assert gg.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert gg.decode(gg.encode(text)) == text
    assert gg.eos_token_ids == [hf.token_to_id("<|im_end|>")] or hf.token_to_id("<|im_end|>") in gg.eos_token_ids


def test_long_prompt_does_not_stall_decodes(tmp_path):
    """With prefill_chunk=8, a 100-token prompt is spread over 13 steps and the
    running request decodes one token in every one of them."""
    make_hf(str(tmp_path / "m"), 1)
    eng = engine_for(str(tmp_path / "m"), prefill_chunk=8)
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    eng.step()
    assert len(a.output_ids) == 1
    b = eng.add_request(list(range(100)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    steps = 0
    while not b.output_ids:
        before = len(a.output_ids)
        eng.step()
        steps += 1
        assert len(a.output_ids) == before + 1  # the decode advanced this step
    assert steps == 13  # ceil(100 / 8)


def test_generate_chat_from_stdin(tmp_path, monkeypatch, capsys):
    from freetoken.cli.main import main

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n\nsecond turn\n"))
    rc = main(["generate", "--chat", "--system", "Be brief.", "--max-tokens", "4", "--temperature", "0", "--json",
               "--ignore-eos"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2  # the blank line is skipped
    assert all(len(x["token_ids"]) == 4 for x in lines)
    assert lines[1]["prompt_tokens"] > lines[0]["prompt_tokens"] + 4  # history carried over


def test_read_back_later_off_a_gpu_is_tolist():
    """Off a CUDA device the split read-back is the tensor's tolist (nothing to overlap)."""
    from freetoken.engine.engine import _read_back_later

    t = torch.tensor([5, 2, 151935])
    read = _read_back_later(t)
    t[0] = 7  # read when the function is called, as tolist would be
    assert read() == [7, 2, 151935]

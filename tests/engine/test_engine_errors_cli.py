"""Bad input gets clear errors; `freetoken generate --json` fields; logprobs vs HF."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from freetoken import SamplingParams
from freetoken.loading.hf import CheckpointError
from helpers import engine_for, hf_logits, make_hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    model = make_hf(path, random.randrange(1 << 30))
    return model, path


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_lists_supported(hf_dir, tmp_path):
    from freetoken.models.registry import UnsupportedArchitecture

    d = _copy(hf_dir[1], str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["DbrxForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(UnsupportedArchitecture) as e:
        engine_for(d)
    msg = str(e.value)
    assert "DbrxForCausalLM" in msg
    # the supported set, HF and GGUF names of every family
    for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM", "qwen3moe",
                 "qwen35moe", "gpt-oss", "deepseek2"):
        assert name in msg, name


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    from freetoken.models.registry import UnsupportedArchitecture

    p = str(tmp_path / "dbrx.gguf")
    w = gguf.GGUFWriter(p, "dbrx")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match=r"'dbrx'.*Supported.*qwen3moe.*deepseek2.*qwen35moe"):
        engine_for(p)


def test_truncated_safetensors_names_the_file(hf_dir, tmp_path):
    d = _copy(hf_dir[1], str(tmp_path / "m"))
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        engine_for(d)


def test_not_a_model(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"hello world")
    with pytest.raises(CheckpointError, match=r"x\.bin.*not an HF model directory and not a GGUF"):
        engine_for(str(p))
    with pytest.raises(CheckpointError, match="config.json"):
        engine_for(str(tmp_path))


def test_too_big_fails_before_allocating_with_numbers(hf_dir, monkeypatch):
    from freetoken.loading.memory import InsufficientMemory

    monkeypatch.setenv("FREETOKEN_MEMORY_LIMIT", str(100_000))
    with pytest.raises(InsufficientMemory, match=r"needs .* GiB .* only 0\.00 GiB is available"):
        engine_for(hf_dir[1])


def test_logprobs_match_hf(hf_dir):
    model, path = hf_dir
    eng = engine_for(path)
    rng = random.Random(1)
    prompt = [rng.randrange(160) for _ in range(9)]
    r = eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3))
    while eng.has_work():
        eng.step()
    ref = torch.log_softmax(hf_logits(model, prompt + r.output_ids)[len(prompt) - 1 : -1].double(), -1)
    assert len(r.logprobs) == 5
    for i, lp in enumerate(r.logprobs):
        assert lp.token_id == r.output_ids[i]
        assert abs(lp.logprob - float(ref[i, lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()


def test_generate_cli_json(tmp_path, monkeypatch, capsys):
    from freetoken.cli.main import main

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    rc = main(["generate", "--prompt", "Return the", "--max-tokens", "6", "--temperature", "0", "--json", "--ignore-eos"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) >= {"token_ids", "text", "prompt_tokens", "completion_tokens", "finish_reason"}
    assert out["completion_tokens"] == len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    assert out["prompt_tokens"] > 0 and isinstance(out["text"], str)
    # token ids in, and the same greedy continuation as the text prompt
    from freetoken.models.demo import ensure_demo_model
    from freetoken.models.loader import load_tokenizer

    tok = load_tokenizer(ensure_demo_model().hf_dir)
    ids = ",".join(map(str, tok.encode("Return the")))
    assert main(["generate", "--prompt-ids", ids, "--max-tokens", "6", "--temperature", "0", "--json", "--ignore-eos"]) == 0
    out2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out2["token_ids"] == out["token_ids"] and out2["text"] == out["text"]


def test_generate_cli_text_into_tokenizerless_gguf(tmp_path, capsys):
    from freetoken.cli.main import main
    from test_engine_gguf import write_tiny_gguf

    p = str(tmp_path / "t.gguf")
    write_tiny_gguf(p, 3)
    assert main(["generate", "--model", p, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "--prompt-ids" in err
    assert main(["generate", "--model", p, "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json", "--temperature", "0", "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 3 and out["text"] == ""


def test_kv_budget_beyond_ram_fails_with_numbers(hf_dir):
    from freetoken.loading.memory import InsufficientMemory

    with pytest.raises(InsufficientMemory, match=r"KV cache [0-9.]+ GiB"):
        engine_for(hf_dir[1], kv_cache_tokens=10**10)


def test_truncated_gguf_names_the_file(tmp_path):
    from test_engine_gguf import write_tiny_gguf

    full = tmp_path / "full.gguf"
    write_tiny_gguf(str(full), 2)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        engine_for(str(cut))

"""The split rules of GGUF vocabularies against llama.cpp's vocabulary tests
(models/ggml-vocab-<name>.gguf.inp/.out from the llama.cpp source): every test text gives
llama.cpp's token ids, for the pre-tokenizers ``qwen35`` (Qwen3.5/3.6), ``qwen2`` (Qwen2/3),
``llama-bpe`` (Llama 3's rule, which GLM-4.5's ``glm4`` is too) and ``deepseek-llm``
(DeepSeek-LLM and DeepSeek-V2: six rules in a row). Each vocabulary is the part of
ggml-vocab-<name>.gguf its texts need (data/vocab-<name>-subset.json, cut by
data/make_vocab_subset.py), at its real ids."""

from __future__ import annotations

import json
import os

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")
VOCABS = ["qwen35", "qwen2", "llama-bpe", "deepseek-llm"]


def _texts(name: str) -> tuple[list[str], list[list[int]]]:
    base = os.path.join(DATA, f"ggml-vocab-{name}.gguf")
    texts = open(base + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    ids = [[int(x) for x in line.split()] for line in open(base + ".out", encoding="utf-8").read().split("\n")]
    assert len(texts) == len(ids) > 40
    return texts, ids


def _vocab_gguf(path: str, name: str, pre: str) -> object:
    import gguf

    from freetoken.loading.gguf import GGUFCheckpoint

    sub = json.load(open(os.path.join(DATA, f"vocab-{name}-subset.json"), encoding="utf-8"))
    assert sub["pre"] == name or name == "llama-bpe" and sub["pre"] in ("llama-bpe", "llama3")
    tokens = [f"<unused-{i}>" for i in range(sub["vocab_size"])]  # ids no test text reaches
    for i, t in sub["tokens"].items():
        tokens[int(i)] = t
    w = gguf.GGUFWriter(path, "qwen35moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(sub["merges"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFCheckpoint(path)


def _tokenizer(path: str, name: str, pre: str) -> object:
    from freetoken.loading.tokenizer import load_gguf_tokenizer

    ck = _vocab_gguf(path, name, pre)
    return load_gguf_tokenizer(ck, len(ck.field("tokenizer.ggml.tokens")))


@pytest.mark.parametrize("name", VOCABS)
def test_matches_llama_cpp(name: str, tmp_path) -> None:
    tok = _tokenizer(str(tmp_path / f"{name}.gguf"), name, name)
    texts, expected = _texts(name)
    bad = [(t, tok.encode(t), e) for t, e in zip(texts, expected) if tok.encode(t) != e]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} texts differ from llama.cpp, first: {bad[0]}"
    # decoding gives the text back (byte-level BPE is lossless)
    assert all(tok.decode(e) == t for t, e in zip(texts, expected))


@pytest.mark.parametrize("name", VOCABS)
def test_gpt2_split_rule_differs_on_these_texts(name: str, tmp_path) -> None:
    """The same vocabulary split with GPT-2's rule (the fallback for unknown names)
    tokenizes some of the texts differently: the test above checks each split rule."""
    tok = _tokenizer(str(tmp_path / "gpt2.gguf"), name, "gpt2")
    texts, expected = _texts(name)
    assert sum(tok.encode(t) != e for t, e in zip(texts, expected)) >= 1

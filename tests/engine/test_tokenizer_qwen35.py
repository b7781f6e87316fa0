"""The ``qwen35`` pre-tokenizer of GGUF vocabularies against llama.cpp's vocabulary test
(models/ggml-vocab-qwen35.gguf.inp/.out from the llama.cpp source): every test text gives
llama.cpp's token ids. The vocabulary is the part of ggml-vocab-qwen35.gguf those texts
need (data/vocab-qwen35-subset.json, cut by data/make_vocab_subset.py), at its real ids."""

from __future__ import annotations

import json
import os

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")


def _texts() -> tuple[list[str], list[list[int]]]:
    base = os.path.join(DATA, "ggml-vocab-qwen35.gguf")
    texts = open(base + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    ids = [[int(x) for x in line.split()] for line in open(base + ".out", encoding="utf-8").read().split("\n")]
    assert len(texts) == len(ids) > 40
    return texts, ids


def _vocab_gguf(path: str, pre: str) -> object:
    import gguf

    from freetoken.loading.gguf import GGUFCheckpoint

    sub = json.load(open(os.path.join(DATA, "vocab-qwen35-subset.json"), encoding="utf-8"))
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


@pytest.fixture(scope="module")
def qwen35_tokenizer(tmp_path_factory):
    from freetoken.loading.tokenizer import load_gguf_tokenizer

    ck = _vocab_gguf(str(tmp_path_factory.mktemp("vocab") / "qwen35.gguf"), "qwen35")
    return load_gguf_tokenizer(ck, len(ck.field("tokenizer.ggml.tokens")))


def test_qwen35_matches_llama_cpp(qwen35_tokenizer):
    texts, expected = _texts()
    bad = [(t, qwen35_tokenizer.encode(t), e) for t, e in zip(texts, expected) if qwen35_tokenizer.encode(t) != e]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ from llama.cpp, first: {bad[0]}"
    # decoding gives the text back (byte-level BPE is lossless)
    assert all(qwen35_tokenizer.decode(e) == t for t, e in zip(texts, expected))


def test_gpt2_split_rule_differs_on_these_texts(tmp_path):
    """The same vocabulary split with GPT-2's rule (the old fallback for unknown names)
    tokenizes some of the texts differently: the test above checks the split rule."""
    from freetoken.loading.tokenizer import load_gguf_tokenizer

    ck = _vocab_gguf(str(tmp_path / "gpt2.gguf"), "gpt2")
    tok = load_gguf_tokenizer(ck, len(ck.field("tokenizer.ggml.tokens")))
    texts, expected = _texts()
    assert sum(tok.encode(t) != e for t, e in zip(texts, expected)) >= 2

"""A vocabulary that shows where a pre-tokenizer splits text, for comparing FreeToken's GGUF
tokenizers with llama.cpp's on pre-tokenizers it ships no vocabulary test for.

Every character of the test texts is one BPE unit (its UTF-8 bytes, as byte-level symbols,
merged in order), and every ordered pair of units has a merge of its own, ranked in a
seeded random order. BPE inside one pre-token then joins neighbouring characters pairwise,
and which pairs it joins depends on where the pre-token starts and ends, so the token ids
of a text record the split points: two splitters give the same ids only where they split
alike (up to pairs the ranking happens not to join). llama.cpp's answers
(``llama-tokenize``) for each pre-tokenizer name are stored in data/split-oracle.json by
data/make_split_oracle.py; tests/engine/test_tokenizer_split_oracle.py compares.
"""

from __future__ import annotations

import os
import random
from typing import Any

from freetoken.loading.byte_level import byte_symbols

DATA = os.path.join(os.path.dirname(__file__), "data")
#: the pre-tokenizer names compared (GGUF ``tokenizer.ggml.pre``)
PRE_NAMES = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-v3", "glm4", "kimi-k2", "gpt-4o")
#: names whose reference is tiktoken with the model's own pattern (llama.cpp's hand-written
#: splitters for them part ways with the pattern on some texts)
TIKTOKEN_NAMES = ("kimi-k2", "gpt-4o")
SEED = 7

#: texts beyond llama.cpp's vocabulary test texts: the boundaries the rules differ on (digits
#: in threes, CJK and kana runs, letter case, contractions, marks, punctuation before letters)
EXTRA_TEXTS = (
    "Kimi K2 是月之暗面的模型, DeepSeek-V3 来自深度求索。",
    "ひらがなとカタカナと漢字が混ざった文章です。",
    "HTTPServer getHTTPResponseCode XMLHttpRequest iPhone McDonald's",
    "I'm sure they've said we'd go, but it's THEIR'S and YOU'LL see.",
    "12345678 3.14159 1,000,000 2024-12-05 v1.2.3 0x1F600",
    "naïve café résumé Ångström ñandú — «quoted» “smart”",
    "한국어 텍스트와 English 混合 123abc",
    "path/to/file.py:42 #include <stdio.h> $HOME ~user @mention",
    "  leading spaces\t\ttabs\n\nnewlines\r\nCRLF   trailing   ",
    "e\u0301 combining a\u0308 marks \u0915\u093f Hindi \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
)


def llama_cpp_texts() -> list[str]:
    """llama.cpp's vocabulary test texts (models/ggml-vocab-*.gguf.inp, the same for every
    vocabulary), then :data:`EXTRA_TEXTS`."""
    with open(os.path.join(DATA, "ggml-vocab-qwen2.gguf.inp"), encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    return [t for t in texts if t] + list(EXTRA_TEXTS)


def oracle_vocab(texts: list[str]) -> tuple[list[str], list[str]]:
    """The tokens and merges (module docstring) for the characters of ``texts``."""
    sym = byte_symbols()  # byte -> its character
    tokens = list(sym)
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []

    def add(a: str, b: str) -> None:
        if a + b not in index:
            index[a + b] = len(tokens)
            tokens.append(a + b)
            merges.append(f"{a} {b}")

    units = sorted({"".join(sym[b] for b in ch.encode()) for t in texts for ch in t})
    for u in units:  # a multi-byte character's bytes, joined left to right
        for k in range(2, len(u) + 1):
            add(u[: k - 1], u[k - 1])
    pairs = [(a, b) for a in units for b in units]
    random.Random(SEED).shuffle(pairs)
    for a, b in pairs:
        add(a, b)
    return tokens, merges


def write_vocab_gguf(path: str, tokens: list[str], merges: list[str], pre: str) -> None:
    """A GGUF holding the vocabulary under pre-tokenizer ``pre``, with the hyper-parameters of
    the tiny Qwen3-MoE preset so that llama.cpp loads it (vocabulary only), no BOS."""
    import gguf

    from freetoken.cli.bench.make_model import PRESETS
    from freetoken.models.gguf_writer import ARCH, write_qwen3moe_metadata

    w = gguf.GGUFWriter(path, ARCH)
    write_qwen3moe_metadata(w, PRESETS["qwen3-moe-tiny"], "split oracle vocabulary")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def freetoken_ids(path: str, texts: list[str]) -> list[list[int]]:
    from freetoken.loading.gguf import GGUFCheckpoint
    from freetoken.loading.tokenizer import load_gguf_tokenizer

    ck: Any = GGUFCheckpoint(path)
    tok = load_gguf_tokenizer(ck, len(ck.field("tokenizer.ggml.tokens")))
    return [tok.encode(t) for t in texts]

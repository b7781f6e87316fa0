"""FreeToken's GGUF pre-tokenizers split text where llama.cpp's do, for every name it reads,
including those llama.cpp ships no vocabulary test for (``deepseek-v3``, ``glm4``,
``kimi-k2``, ``gpt-4o``): the texts' token ids under a vocabulary that records split points
(split_oracle.py) equal llama.cpp's, stored by data/make_split_oracle.py from
``llama-tokenize``. ``kimi-k2`` and ``gpt-4o`` follow the models' own tokenizers instead
(tiktoken with the pattern of Kimi-K2's tokenization_kimi.py, and GPT-4o's o200k pattern,
which GPT-OSS uses; stored by the same script): llama.cpp's hand-written or rewritten
splitters for them part combining marks from their letters, and for ``kimi-k2`` also keep
lower-to-upper case changes inside one piece ("ResponseCode"), which the patterns do not."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from split_oracle import DATA, PRE_NAMES, TIKTOKEN_NAMES, freetoken_ids, oracle_vocab, write_vocab_gguf


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    with open(os.path.join(DATA, "split-oracle.json"), encoding="utf-8") as f:
        data = json.load(f)
    tokens, merges = oracle_vocab(data["texts"])
    assert len(tokens) == data["tokens"]  # the vocabulary the stored ids were made with
    data["vocab"] = (tokens, merges)
    return data


def _ours(oracle: dict[str, Any], pre: str, tmp_path: Any) -> list[list[int]]:
    path = str(tmp_path / f"{pre}.gguf")
    write_vocab_gguf(path, *oracle["vocab"], pre)
    return freetoken_ids(path, oracle["texts"])


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_splits_as_the_reference_does(oracle: dict[str, Any], pre: str, tmp_path: Any) -> None:
    want = oracle["tiktoken"].get(pre, oracle["ids"][pre])
    got = _ours(oracle, pre, tmp_path)
    bad = [oracle["texts"][i][:60] for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{pre}: {len(bad)} of {len(want)} texts split differently, e.g. {bad[:3]}"


@pytest.mark.parametrize("pre", [p for p in PRE_NAMES if p != "gpt-2"])
def test_the_texts_tell_the_rule_from_gpt2s(oracle: dict[str, Any], pre: str, tmp_path: Any) -> None:
    """GPT-2's rule (the fallback for unknown names) gives other ids on some texts: the
    comparison above sees each rule."""
    want = oracle["tiktoken"].get(pre, oracle["ids"][pre])
    gpt2 = _ours(oracle, "gpt-2", tmp_path)
    assert sum(g != w for g, w in zip(gpt2, want)) >= 1


@pytest.mark.parametrize("pre", TIKTOKEN_NAMES)
def test_llama_cpps_splitter_differs_where_said(oracle: dict[str, Any], pre: str) -> None:
    """Where llama.cpp and the models' patterns part ways (the module docstring), on these texts."""
    import re
    import unicodedata

    def case_change_or_mark(t: str) -> bool:
        return bool(re.search(r"[a-z][A-Z]", t)) or any(unicodedata.category(c).startswith("M") for c in t)

    differ = [t for t, a, b in zip(oracle["texts"], oracle["ids"][pre], oracle["tiktoken"][pre]) if a != b]
    assert differ and all(case_change_or_mark(t) for t in differ), differ

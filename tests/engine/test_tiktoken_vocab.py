"""A checkpoint directory with a tiktoken vocabulary (``tiktoken.model``, Kimi-K2's kind)
instead of a tokenizer.json: FreeToken's tokenizer gives tiktoken's ids (stored in
data/split-oracle.json by data/make_split_oracle.py from tiktoken itself, with Kimi-K2's
pattern, over a vocabulary whose ids record every split and join), its special tokens at
their ids, text back on decoding, and clear errors for what it cannot read."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from split_oracle import DATA, oracle_vocab

from freetoken.loading.byte_level import byte_decoder
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tokenizer import has_hf_tokenizer, load_hf_tokenizer

KIMI_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}


def _oracle() -> dict[str, Any]:
    with open(os.path.join(DATA, "split-oracle.json"), encoding="utf-8") as f:
        return json.load(f)


def _checkpoint(path: Any, texts: list[str], auto_map: Any = KIMI_MAP) -> int:
    """A directory with the oracle vocabulary as tiktoken.model (a token's rank is its id)
    and three special tokens after it; the number of ranked tokens."""
    tokens, _ = oracle_vocab(texts)
    dec = byte_decoder()
    with open(path / "tiktoken.model", "w", encoding="ascii") as f:
        for i, t in enumerate(tokens):
            f.write(f"{base64.b64encode(bytes(dec[c] for c in t)).decode()} {i}\n")
    n = len(tokens)
    config = {"auto_map": auto_map, "bos_token": "[BOS]", "eos_token": "[EOS]",
              "chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}",
              "added_tokens_decoder": {str(n + k): {"content": c, "special": True}
                                       for k, c in enumerate(["[BOS]", "[EOS]", "<|im_end|>"])}}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return n


def test_tiktokens_ids_specials_and_text_back(tmp_path) -> None:
    oracle = _oracle()
    n = _checkpoint(tmp_path, oracle["texts"])
    assert has_hf_tokenizer(str(tmp_path))
    tok = load_hf_tokenizer(str(tmp_path))
    got = [tok.encode(t) for t in oracle["texts"]]
    want = oracle["tiktoken"]["kimi-k2"]
    bad = [oracle["texts"][i][:50] for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(want)} texts differ from tiktoken, e.g. {bad[:3]}"
    assert all(tok.decode(ids) == t for ids, t in zip(got, oracle["texts"]))
    ids = tok.encode("[BOS]" + oracle["texts"][0] + "<|im_end|>")
    assert ids[0] == n and ids[-1] == n + 2 and ids[1:-1] == got[0]
    assert n + 1 in tok.eos_token_ids and tok.vocab_size == n + 3
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_end|>")


def test_an_unknown_tiktoken_module_is_named(tmp_path) -> None:
    _checkpoint(tmp_path, ["ab"], auto_map={"AutoTokenizer": ["tokenization_other.Tok", None]})
    with pytest.raises(CheckpointError, match=r"tiktoken.model .*tokenization_other.*kimi"):
        load_hf_tokenizer(str(tmp_path))


def test_a_bad_line_names_the_file_and_line(tmp_path) -> None:
    _checkpoint(tmp_path, ["ab"])
    with open(tmp_path / "tiktoken.model", "a", encoding="ascii") as f:
        f.write("not-base64! 12\n")
    with pytest.raises(CheckpointError, match=r"tiktoken.model:\d+: not a 'base64-token rank' line"):
        load_hf_tokenizer(str(tmp_path))


def test_no_tokenizer_at_all_says_what_is_read(tmp_path) -> None:
    assert not has_hf_tokenizer(str(tmp_path))
    with pytest.raises(CheckpointError, match="no tokenizer.json or tiktoken.model"):
        load_hf_tokenizer(str(tmp_path))


def _rank_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm, written out: the whole piece if it is a token, else join the
    adjacent pair whose joined bytes rank lowest until none is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while True:
        joins = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not joins:
            return [ranks[p] for p in parts]
        _, i = min(joins)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def test_long_tokens_of_a_trained_vocabulary_join_as_tiktoken_joins(tmp_path) -> None:
    """Ranks of a vocabulary trained on text (tokens of many bytes, built from each other):
    FreeToken's BPE over the merges it derives gives the ids of tiktoken's rank algorithm
    (written out above) on every piece of new text."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random()
    words = ["".join(rng.choice("abcdeéfghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 12)))
             for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(200)]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=3000, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    dec = byte_decoder()
    by_id = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    ranks = {bytes(dec[c] for c in t): i for i, (t, _) in enumerate(by_id)}  # ranks in the trainer's id order
    assert sum(len(t) >= 4 for t in ranks) > 200
    with open(tmp_path / "tiktoken.model", "w", encoding="ascii") as f:
        for t, r in ranks.items():
            f.write(f"{base64.b64encode(t).decode()} {r}\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": KIMI_MAP}), encoding="utf-8")
    tok = load_hf_tokenizer(str(tmp_path))
    split = tok._tok.pre_tokenizer
    for _ in range(50):
        text = " ".join(rng.choice(words) + rng.choice(["", "x", "éé", "qz"]) for _ in range(12))
        want = [i for piece, _ in split.pre_tokenize_str(text) for i in _rank_bpe(bytes(dec[c] for c in piece), ranks)]
        assert tok.encode(text) == want, text

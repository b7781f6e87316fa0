"""The byte-level BPE vocabulary of ``freetoken bench make-model --vocab bpe``: a valid BPE
model of the model's size (checked by HF ``tokenizers`` itself), written as GGUF tokenizer
fields that FreeToken reads back into the same tokenizer (without an unknown-pre-tokenizer
warning), and that both sides encode text with identically."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from freetoken.cli.bench.synthetic_vocab import EOS_TOKEN, MAX_TOKEN_CHARS, synthetic_bpe_tokenizer_json


def _random_text(rng: random.Random, n: int) -> str:
    words = ["".join(chr(rng.randrange(33, 127)) for _ in range(rng.randrange(1, 9))) for _ in range(n)]
    return " ".join(words) + " naïve — 日本"


@pytest.mark.parametrize("size", [300, 5000])
def test_a_valid_bpe_of_the_size(size: int) -> None:
    seed = random.randrange(1 << 30)
    text = synthetic_bpe_tokenizer_json(size, seed)
    assert synthetic_bpe_tokenizer_json(size, seed) == text  # the seed decides it
    tj = json.loads(text)
    tok = HFTokenizer.from_str(text)
    assert tok.get_vocab_size(with_added_tokens=True) == size
    vocab = tj["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(size - 1))
    assert tok.token_to_id(EOS_TOKEN) == size - 1
    for a, b in tj["model"]["merges"]:
        assert a in vocab and b in vocab and a + b in vocab
        assert len(a + b) <= MAX_TOKEN_CHARS
        assert all(c == "\u0120" or "!" <= c <= "~" for c in a + b), (a, b)
    rng = random.Random(seed)
    for _ in range(5):
        s = _random_text(rng, 40)
        assert tok.decode(tok.encode(s).ids) == s
    # the merges apply: a merged token of letters (one pre-tokenizer word) takes fewer ids than letters
    words = [t for t in vocab if len(t) >= 2 and t.isascii() and t.isalpha()]
    assert words
    for w in words[:20]:
        assert len(tok.encode(w).ids) < len(w), w


def test_too_small_a_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        synthetic_bpe_tokenizer_json(200)


def test_make_model_writes_it_and_freetoken_reads_it_back(tmp_path, caplog) -> None:
    from freetoken.cli.bench.make_model import PRESETS
    from freetoken.models.loader import load_tokenizer

    path = tmp_path / "tiny-bpe.gguf"
    proc = subprocess.run([sys.executable, "-m", "freetoken.cli.main", "bench", "make-model", "--preset",
                           "qwen3-moe-tiny", "--vocab", "bpe", "--seed", "3", "--out", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    V = PRESETS["qwen3-moe-tiny"].vocab_size
    r = gguf.GGUFReader(str(path))
    field = r.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt2"
    field = r.fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"  # llama.cpp's name of GPT-2's rule
    assert len(r.fields["tokenizer.ggml.tokens"].data) == V
    assert int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == V - 1
    (emb,) = [t for t in r.tensors if t.name == "token_embd.weight"]
    assert int(emb.shape[-1]) == V  # one embedding row per token

    ref = HFTokenizer.from_str(synthetic_bpe_tokenizer_json(V, 3))
    with caplog.at_level(logging.WARNING):
        ours = load_tokenizer(str(path))
    assert not [r for r in caplog.records if "pre-tokenizer" in r.getMessage()]
    rng = random.Random()
    for _ in range(5):
        s = _random_text(rng, 30)
        assert ours.encode(s) == ref.encode(s).ids
        assert ours.decode(ref.encode(s).ids) == s
    assert V - 1 in ours.eos_token_ids

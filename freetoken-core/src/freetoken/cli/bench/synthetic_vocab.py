"""A byte-level BPE vocabulary of any size for the files of ``freetoken bench make-model
--vocab bpe``.

The ids-only vocabulary (``tokenizer.ggml.model = "none"``) is enough for engines that take
token ids, but servers detokenize what they stream: llama.cpp's ``llama-server`` refuses a
file without token texts. This vocabulary has the 256 byte tokens of the byte-level
alphabet, then tokens made by merging two earlier ones of printable text (a pseudo-random
pair per merge, drawn from ``seed``, at most :data:`MAX_TOKEN_CHARS` characters), in merge order, and one
special end-of-text token as the last id: a valid BPE model (every merge joins two tokens
of the vocabulary into a third) that both FreeToken and llama.cpp load, tokenize and
detokenize with, of exactly the model's ``vocab_size``.
"""

from __future__ import annotations

import json
import random
from typing import Any

EOS_TOKEN = "<|endoftext|>"
MAX_TOKEN_CHARS = 12


def synthetic_bpe_tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    """The ``tokenizers`` JSON of a byte-level BPE tokenizer with ``vocab_size`` tokens."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"a byte-level vocabulary needs at least {len(alphabet) + 1} tokens, got {vocab_size}")
    tokens = list(alphabet)
    vocab = {t: i for i, t in enumerate(tokens)}
    # merges join only tokens of printable ASCII and the space's symbol, so that every merged
    # token is whole UTF-8 text (a server streams it at once, as with a trained vocabulary)
    text = [t for t in tokens if t == "\u0120" or "!" <= t <= "~"]
    merges: list[list[str]] = []
    rng = random.Random(seed)
    while len(tokens) < vocab_size - 1:
        a, b = text[rng.randrange(len(text))], text[rng.randrange(len(text))]
        new = a + b
        if len(new) > MAX_TOKEN_CHARS or new in vocab:
            continue
        vocab[new] = len(tokens)
        tokens.append(new)
        text.append(new)
        merges.append([a, b])
    eos_id = len(tokens)
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eos_id, "content": EOS_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(tokenizer)


def write_synthetic_bpe(w: Any, vocab_size: int, seed: int = 0) -> None:
    """The vocabulary as GGUF ``tokenizer.ggml.*`` fields (model ``gpt2``, pre-tokenizer
    ``gpt-2``: GPT-2's split rule under the name llama.cpp knows it by; the end-of-text token
    as EOS) on the gguf-py writer ``w``."""
    from freetoken.models.gguf_writer import write_tokenizer

    write_tokenizer(w, synthetic_bpe_tokenizer_json(vocab_size, seed), None, EOS_TOKEN, pre="gpt-2")

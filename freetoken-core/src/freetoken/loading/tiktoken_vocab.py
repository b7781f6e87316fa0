"""tiktoken vocabularies (``tiktoken.model``: one base64 token and its rank per line), as
Kimi-K2's checkpoints ship them instead of a ``tokenizer.json``, read into a ``tokenizers``
byte-level BPE.

tiktoken encodes a piece by repeatedly joining the adjacent pair whose joined bytes have the
lowest rank, after taking the whole piece as one token when it is in the vocabulary. A BPE
whose merges are ranked like the tokens they make, and which looks whole words up first
(``ignore_merges``), joins the same pairs: each token's merge is the last join tiktoken makes
when it encodes that token's bytes with the lower-ranked tokens alone (tokens it cannot
reach that way get no merge and are found whole only). The split rule is not in the file
(tiktoken takes it as code); it is chosen from ``tokenizer_config.json``'s tokenizer class.
"""

from __future__ import annotations

import base64
import os
from typing import Any, Optional

from freetoken.loading.byte_level import to_symbols
from freetoken.loading.hf import CheckpointError
from freetoken.loading.split_rules import split_pre_tokenizer

VOCAB_FILE = "tiktoken.model"
#: the split rule of each known tiktoken tokenizer module (``auto_map`` of tokenizer_config.json)
SPLIT_RULE_OF_MODULE = {"tokenization_kimi": "kimi-k2"}


def read_ranks(path: str) -> dict[bytes, int]:
    """The ``token bytes -> rank`` table of a tiktoken BPE file."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (ValueError, IndexError) as exc:
                raise CheckpointError(f"{path}:{n}: not a 'base64-token rank' line ({exc})") from exc
    return ranks


def _last_join(token: bytes, ranks: dict[bytes, int], below: int) -> Optional[tuple[bytes, bytes]]:
    """The pair tiktoken joins last when it encodes ``token`` with the tokens ranked below
    ``below``; None when that does not end in two parts."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = below, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], below)
            if r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges in rank order that join what tiktoken joins (module docstring)."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        pair = _last_join(token, ranks, rank)
        if pair is not None and ranks.get(pair[0], rank) < rank and ranks.get(pair[1], rank) < rank:
            out.append(pair)
    return out


def split_rule_name(path: str, tokenizer_config: dict[str, Any]) -> str:
    """The split rule of the checkpoint's tiktoken tokenizer, from its tokenizer class."""
    auto = (tokenizer_config.get("auto_map") or {}).get("AutoTokenizer") or []
    modules = [str(a).split(".", 1)[0] for a in (auto if isinstance(auto, list) else [auto]) if a]
    for m in modules:
        if m in SPLIT_RULE_OF_MODULE:
            return SPLIT_RULE_OF_MODULE[m]
    raise CheckpointError(
        f"{path}: a {VOCAB_FILE} vocabulary whose split pattern FreeToken does not know (tokenizer module "
        f"{modules or 'unnamed'}; known: {', '.join(SPLIT_RULE_OF_MODULE)}); pass token ids, or give the "
        f"checkpoint a tokenizer.json")


def build_tiktoken_tokenizer(path: str, tokenizer_config: dict[str, Any]) -> Any:
    """The ``tokenizers`` tokenizer of the checkpoint directory's ``tiktoken.model``, with the
    special tokens of ``added_tokens_decoder`` at their ids."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTok

    rule = split_rule_name(path, tokenizer_config)
    ranks = read_ranks(os.path.join(path, VOCAB_FILE))
    vocab = {to_symbols(t): r for t, r in ranks.items()}
    merges = [(to_symbols(a), to_symbols(b)) for a, b in merges_from_ranks(ranks)]
    tok = HFTok(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.pre_tokenizer = split_pre_tokenizer(rule)
    tok.decoder = decoders.ByteLevel()
    added = tokenizer_config.get("added_tokens_decoder") or {}
    specials = sorted((int(i), d) for i, d in added.items() if isinstance(d, dict) and d.get("content"))
    for i, d in specials:
        if tok.get_vocab_size(with_added_tokens=True) != i:
            raise CheckpointError(f"{path}: added token {d['content']!r} at id {i}, but the vocabulary so far ends "
                                  f"at {tok.get_vocab_size(with_added_tokens=True) - 1}")
        tok.add_special_tokens([AddedToken(d["content"], special=bool(d.get("special", True)), normalized=False)])
    return tok


def has_tiktoken_vocab(path: str) -> bool:
    return os.path.exists(os.path.join(path, VOCAB_FILE))

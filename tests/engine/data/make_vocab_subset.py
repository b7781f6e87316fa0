"""Cut a llama.cpp vocabulary test file (models/ggml-vocab-<name>.gguf, shipped with its
.inp/.out in the llama.cpp source, e.g. the llama-cpp-python 0.3.36 sdist) down to what
its test texts need: the byte tokens, every merge BPE applies to their words (split with
the file's own pre-tokenizer rule, and with GPT-2's rule, the fallback the tests compare
with), and the tokens those merges and the expected ids name. BPE over that subset
tokenizes the test words exactly as over the whole vocabulary (the merges it applies are
the lowest-ranked applicable ones in both), under either rule.

    python tests/engine/data/make_vocab_subset.py models/ggml-vocab-qwen35.gguf tests/engine/data/vocab-qwen35-subset.json
"""

from __future__ import annotations

import json
import sys

from gguf import GGUFReader


def field(r: GGUFReader, key: str) -> list:
    return r.fields[key].contents()


def main(src: str, dst: str) -> None:
    from tokenizers import pre_tokenizers

    sys.path.insert(0, "freetoken-core/src")
    from freetoken.loading.split_rules import split_pre_tokenizer

    r = GGUFReader(src)
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = field(r, "tokenizer.ggml.merges")
    pre = field(r, "tokenizer.ggml.pre")
    rank = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    splits = [split_pre_tokenizer(pre), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    texts = open(src + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    expected = [[int(x) for x in line.split()] for line in open(src + ".out", encoding="utf-8").read().split("\n")]
    used: set[int] = set()
    words = [w for split in splits for text in texts for w, _ in split.pre_tokenize_str(text)]
    for word in words:
        parts = list(word)
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i + 1]), 1 << 60))
            key = (parts[best], parts[best + 1])
            if key not in rank:
                break
            used.add(rank[key])
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
    keep_merges = [merges[i] for i in sorted(used)]
    ids = {i for ids in expected for i in ids}
    ids |= {tokens.index(t) for m in keep_merges for t in (m.split(" ", 1) + [m.replace(" ", "")])}
    byte_chars = {c for t in tokens[:1024] if len(t) == 1 for c in t}
    ids |= {i for i, t in enumerate(tokens) if len(t) == 1 and t in byte_chars}
    out = {"source": src.rsplit("/", 1)[-1], "pre": pre, "vocab_size": len(tokens),
           "tokens": {str(i): tokens[i] for i in sorted(ids)}, "merges": keep_merges}
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

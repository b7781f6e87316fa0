"""Store llama.cpp's token ids of the split-oracle texts for each pre-tokenizer name
(tests/engine/split_oracle.py says what they show), and for the names of TIKTOKEN_NAMES also
tiktoken's (the engine of those models' own tokenizers, given their patterns, which
FreeToken's rules copy): data/split-oracle.json.

    pip install tiktoken
    python tests/engine/data/make_split_oracle.py /path/to/llama-tokenize

llama-tokenize is built from the llama.cpp source (``cmake --build BUILD --target llama-tokenize``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from split_oracle import DATA, PRE_NAMES, SEED, TIKTOKEN_NAMES, llama_cpp_texts, oracle_vocab  # noqa: E402
from split_oracle import write_vocab_gguf  # noqa: E402

from freetoken.loading.byte_level import byte_decoder  # noqa: E402
from freetoken.loading.split_rules import SPLIT_RULES  # noqa: E402


def tiktoken_ids(texts: list[str], tokens: list[str], pattern: str) -> list[list[int]]:
    """The texts' ids by tiktoken with ``pattern``: a token's rank is its id (byte tokens
    first, then the merged ones in merge order, as BPE over the merges ranks them)."""
    import tiktoken

    sym = byte_decoder()
    ranks = {bytes(sym[c] for c in t): i for i, t in enumerate(tokens)}
    enc = tiktoken.Encoding("split-oracle", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [enc.encode(t) for t in texts]


def main(llama_tokenize: str) -> None:
    texts = llama_cpp_texts()
    tokens, merges = oracle_vocab(texts)
    out = {"seed": SEED, "tokens": len(tokens), "texts": texts, "ids": {}, "tiktoken": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_NAMES:
            path = os.path.join(tmp, f"{pre}.gguf")
            write_vocab_gguf(path, tokens, merges, pre)
            ids = []
            for i, text in enumerate(texts):
                src = os.path.join(tmp, f"text{i}.txt")
                with open(src, "w", encoding="utf-8", newline="") as f:
                    f.write(text)
                run = subprocess.run([llama_tokenize, "-m", path, "-f", src, "--ids", "--no-escape", "--log-disable"],
                                     capture_output=True, text=True, check=True)
                line = [ln for ln in run.stdout.splitlines() if ln.startswith("[")][-1]
                ids.append(json.loads(line))
            out["ids"][pre] = ids
            print(pre, sum(len(x) for x in ids), "ids")
    for pre in TIKTOKEN_NAMES:
        out["tiktoken"][pre] = tiktoken_ids(texts, tokens, SPLIT_RULES[pre][0])
    with open(os.path.join(DATA, "split-oracle.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1])

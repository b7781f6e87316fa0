"""FreeToken on GGUF files written by llama.cpp's own converter, against transformers.

For each family, a tiny transformers checkpoint (families.py: every feature the family has
switched on) is saved with a byte-level BPE tokenizer of its vocabulary's size, converted by
llama.cpp's ``convert_hf_to_gguf.py`` (from the llama.cpp source, with its own gguf-py; the
converter's tokenizer fingerprint check is told the family's pre-tokenizer name, since the
tiny tokenizer is no published one) to F32, then loaded by FreeToken's cpu backend. Printed
per family: the largest difference of the prompt's logits from transformers', relative to
the logits' scale (FreeToken's own writer's files reach ~1e-6 in the tests). Not a CI test
(CI has no llama.cpp source); run it by hand:

    python tests/models_moe_families/llamacpp_convert_parity.py .bench/llama.cpp
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "engine")]

#: family -> (the pre-tokenizer name its GGUF files carry, extra config)
FAMILIES = {
    # YaRN with mscale = mscale_all_dim, as DeepSeek-V3/R1 and Kimi-K2 publish it: with
    # mscale != mscale_all_dim transformers scales the rotary tables, llama.cpp does not
    # (its deepseek2 files have no key for it), and FreeToken reads GGUF as llama.cpp does
    "deepseek_v3": ("deepseek-v3", {"rope": "published"}),
    "deepseek_v2": ("deepseek-llm", {}),
    "glm4_moe": ("glm4", {}),
    "olmoe": ("gpt-2", {}),
    # YaRN's correction range rounded outwards (truncate): llama.cpp always rounds it, so a
    # GGUF file means that whatever the checkpoint said (GPT-OSS's own config says not to)
    "gpt_oss": ("gpt-4o", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                               "original_max_position_embeddings": 64}}),
}
#: config.json keys the published checkpoints carry and transformers' config classes drop
#: (llama.cpp's converter reads them: without scoring_func it writes no gating function,
#: and llama.cpp then takes softmax)
PUBLISHED_KEYS = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
#: special tokens a family's tokenizer has and the converter looks up
SPECIAL_TOKENS = {"glm4_moe": ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]}
VOCAB = 300

_RUNNER = """
import sys
sys.path[:0] = [{src!r}, {gguf_py!r}]
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", "f32"]
import convert_hf_to_gguf as c
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
c.main()
"""


def convert(src: str, model_dir: str, out: str, pre: str) -> None:
    code = _RUNNER.format(src=os.path.abspath(src), gguf_py=os.path.join(os.path.abspath(src), "gguf-py"),
                          model=model_dir, out=out, pre=pre)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the converter failed for {model_dir}:\n{run.stderr[-3000:]}")


def main(src: str, only: "list[str] | None" = None) -> int:
    import torch
    from families import DEEPSEEK_YARN, hf_logits, make_model, save
    from helpers import engine_for

    from freetoken.cli.bench.synthetic_vocab import EOS_TOKEN, synthetic_bpe_tokenizer_json

    worst = 0.0
    for family, (pre, over) in FAMILIES.items():
        if only and family not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            if over.get("rope") == "published":
                over = dict(over, rope=dict(DEEPSEEK_YARN))
            model = make_model(family, seed=11, vocab_size=VOCAB, **over)
            hf_dir = os.path.join(tmp, "hf")
            save(model, hf_dir)
            cfg_path = os.path.join(hf_dir, "config.json")
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            cfg.update(PUBLISHED_KEYS.get(family, {}))
            with open(cfg_path, "w", encoding="utf-8") as f:
                json.dump(cfg, f)
            specials = SPECIAL_TOKENS.get(family, [])
            tj = json.loads(synthetic_bpe_tokenizer_json(VOCAB - len(specials)))
            for tok in specials:
                tj["added_tokens"].append({"id": len(tj["model"]["vocab"]) + len(tj["added_tokens"]), "content": tok,
                                           "single_word": False, "lstrip": False, "rstrip": False,
                                           "normalized": False, "special": True})
            with open(os.path.join(hf_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(tj, f)
            with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}, f)
            path = os.path.join(tmp, "model.gguf")
            convert(src, hf_dir, path, pre)
            eng = engine_for(path, prefill_chunk=16)
            ids = torch.randint(0, VOCAB - 1, (40,), generator=torch.Generator().manual_seed(3)).tolist()
            ours, ref = eng.prompt_logits(ids).float(), hf_logits(model, ids)
            err = float((ours - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            print(json.dumps({"family": family, "pre": pre, "gguf_architecture": eng.model_config.architecture,
                              "max_abs_diff_over_logit_scale": err}))
            eng.close()
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

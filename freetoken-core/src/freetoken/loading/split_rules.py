"""The split rules that run before byte-level BPE in GGUF vocabularies, by llama.cpp's
pre-tokenizer name (``tokenizer.ggml.pre``): regexes applied in order, each splitting the
pieces the ones before left, then the byte-level mapping (:func:`split_pre_tokenizer`).
tests/engine/test_tokenizer_split_oracle.py checks every name against llama.cpp's
``llama-tokenize`` (and ``kimi-k2``/``gpt-4o`` against tiktoken with the models' patterns).
"""

from __future__ import annotations

from typing import Any

# llama.cpp pre-tokenizer names -> split regex (byte-level BPE)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5/3.6: letters with their combining marks (\p{M}) stay in one piece
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# (Non-ASCII characters written as escapes: several of these are not in NFC form, and an
# editor's normalisation would change the ranges.)
# DeepSeek-V3/R1 ("deepseek-v3"): digits in threes, then runs of CJK ideographs and kana, then
# the word/punctuation/space rule, each splitting the pieces the one before left
_DEEPSEEK3_RULES = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]"
    "+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# DeepSeek-LLM and DeepSeek-V2 ("deepseek-llm"): line breaks, words of the listed scripts' letters,
# ASCII and full-width punctuation runs, trailing spaces, CJK runs, digit runs
_DEEPSEEK_LLM_RULES = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-"
    "\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-"
    "\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-"
    "\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-"
    "\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
    "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
# Kimi-K2 ("kimi-k2"): Han runs apart, letter runs split at lower-to-upper case changes (an
# upper-case run may open a lower-case one), contractions kept with their word, digits in
# threes; letters and marks here exclude Han ("&&": class intersection)
_KIMI_K2_REGEX = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's o200k rule ("gpt-4o": GPT-OSS and Llama 4 files): as Kimi-K2's without the Han
# exclusion, and "/" may follow a punctuation run with the line breaks
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: llama.cpp's pre-tokenizer names -> the split rules (regexes, applied in order, each to the
#: pieces the ones before left) that run before byte-level BPE. GLM-4/4.5 ("glm4", older files
#: "chatglm-bpe") is llama.cpp's CHATGLM4 rule, Llama 3's regex.
SPLIT_RULES: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2_REGEX,), "qwen35": (_QWEN35_REGEX,), "llama-bpe": (_LLAMA3_REGEX,), "llama3": (_LLAMA3_REGEX,),
    "glm4": (_LLAMA3_REGEX,), "chatglm-bpe": (_LLAMA3_REGEX,), "deepseek-v3": _DEEPSEEK3_RULES,
    "deepseek-llm": _DEEPSEEK_LLM_RULES, "kimi-k2": (_KIMI_K2_REGEX,), "gpt-4o": (_GPT4O_REGEX,),
    "llama4": (_GPT4O_REGEX,),
}
#: pre-tokenizers whose BPE takes a word found whole in the vocabulary as that one token
#: before any merge (llama.cpp's ``ignore_merges``; HF tokenizers' BPE option of that name)
IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "glm4")


def split_pre_tokenizer(pre: str) -> Any:
    """The ``tokenizers`` pre-tokenizer of llama.cpp's pre-tokenizer name ``pre`` (a key of
    :data:`SPLIT_RULES`): its split rules in order, then the byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rule), behavior="isolated", invert=False) for rule in SPLIT_RULES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )

"""Tokenizers: HF ``tokenizer.json`` directories, GGUF-embedded BPE vocabularies,
and chat templates rendered with jinja2 (sandboxed, as transformers does)."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any, Iterable, Optional

from freetoken.loading.hf import CheckpointError, read_json

logger = logging.getLogger(__name__)

#: Roles a chat message may have.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

#: End-of-turn tokens we also stop on when the vocabulary marks them as control tokens.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>")

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
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "glm4")
#: pre-tokenizers whose vocabularies llama.cpp gives no BOS (GLM's chat template writes its
#: own ``[gMASK]<sop>`` prefix)
_NO_BOS_PRE = ("glm4", "chatglm-bpe")


#: ``tokenizer.ggml.model`` values llama.cpp reads as a vocabulary without text.
_NO_TEXT_MODELS = ("none", "no_vocab")


class NoTokenizerError(ValueError):
    """Text was given to a model that has no tokenizer (token ids only)."""


class Tokenizer:
    """Text <-> token ids, the chat template and the end-of-sequence ids."""

    def __init__(
        self,
        tok: Any,
        eos_token_ids: Iterable[int],
        chat_template: Optional[str] = None,
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        add_bos: bool = False,
        source: str = "",
    ) -> None:
        self._tok = tok
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.source = source
        self._template: Any = None
        self._renders_tools: Optional[bool] = None

    has_text = True

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template reads the ``tools`` variable (tool definitions reach the model)."""
        if not self.chat_template:
            return False
        if self._renders_tools is None:
            import jinja2.meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:
                ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(self.chat_template)
                self._renders_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
            except Exception:  # a template that does not parse fails later, when rendered
                self._renders_tools = False
        return self._renders_tools

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> str:
        """Render ``messages`` with the chat template. ``tools``: OpenAI-style tool definitions
        (``{"type": "function", "function": {...}}``), passed to the template as transformers does."""
        msgs = _alias_reasoning(validate_messages(messages))
        if not self.chat_template:
            raise ValueError(f"{self.source or 'this model'} has no chat template; send a plain prompt instead")
        import jinja2

        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools or None,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc


class IdsOnlyTokenizer(Tokenizer):
    """A model file without a tokenizer: token ids in and out, no text."""

    has_text = False

    def __init__(self, eos_token_ids: Iterable[int], vocab_size: int, source: str) -> None:
        super().__init__(None, eos_token_ids, source=source)
        self._vocab = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def _refuse(self) -> NoTokenizerError:
        return NoTokenizerError(
            f"{self.source} has no tokenizer, so it accepts token ids only; pass prompt token ids "
            "(e.g. `freetoken generate --prompt-ids 1,2,3`, or a list of ints to LLM.generate)"
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise self._refuse()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def token_to_id(self, token: str) -> Optional[int]:
        return None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> str:
        raise self._refuse()


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages; text parts lists are flattened into one string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "text":
                    parts.append(str(p.get("text", "")))
                else:
                    raise ValueError(f"messages[{i}]: only text content parts are supported")
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        mm = dict(m)
        mm["content"] = content
        out.append(mm)
    return out


#: the names a message's reasoning comes under; templates read the first (Qwen) or "thinking" (GPT-OSS)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning, under whichever of :data:`REASONING_KEYS` it came, is given to the
    template as both ``reasoning_content`` and ``thinking`` (what transformers' rendering does)."""
    out = []
    for m in messages:
        r = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ------------------------------------------------------------------- HF


def _token_str(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def has_hf_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory has a tokenizer FreeToken reads: ``tokenizer.json``,
    or a tiktoken vocabulary (:mod:`freetoken.loading.tiktoken_vocab`)."""
    from freetoken.loading.tiktoken_vocab import has_tiktoken_vocab

    return os.path.exists(os.path.join(path, "tokenizer.json")) or has_tiktoken_vocab(path)


def load_hf_tokenizer(path: str, eos_from_config: Iterable[int] = ()) -> Tokenizer:
    from tokenizers import Tokenizer as HFTok

    from freetoken.loading.tiktoken_vocab import build_tiktoken_tokenizer, has_tiktoken_vocab

    tc = read_json(os.path.join(path, "tokenizer_config.json"), required=False) or {}
    tj = os.path.join(path, "tokenizer.json")
    if os.path.exists(tj):
        try:
            tok = HFTok.from_file(tj)
        except Exception as exc:
            raise CheckpointError(f"{tj}: cannot load tokenizer: {exc}") from exc
    elif has_tiktoken_vocab(path):
        tok = build_tiktoken_tokenizer(path, tc)
    else:
        raise CheckpointError(f"{path}: no tokenizer.json or tiktoken.model (FreeToken reads fast-tokenizer files "
                              "and tiktoken vocabularies)")
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jt = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jt):
        with open(jt, encoding="utf-8") as f:
            template = f.read()
    eos_token = _token_str(tc.get("eos_token"))
    bos_token = _token_str(tc.get("bos_token"))
    eos = list(eos_from_config)
    if eos_token is not None and tok.token_to_id(eos_token) is not None:
        eos.append(tok.token_to_id(eos_token))
    return Tokenizer(tok, eos, template, bos_token, eos_token, add_bos=bool(tc.get("add_bos_token", False)), source=path)


# ------------------------------------------------------------------ GGUF


def split_pre_tokenizer(pre: str) -> Any:
    """The ``tokenizers`` pre-tokenizer of llama.cpp's pre-tokenizer name ``pre`` (a key of
    :data:`SPLIT_RULES`): its split rules in order, then the byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rule), behavior="isolated", invert=False) for rule in SPLIT_RULES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def load_gguf_tokenizer(ckpt: Any, vocab_size: int) -> Tokenizer:
    """Build a ``tokenizers`` tokenizer from the GGUF vocabulary (BPE ``gpt2`` model)."""
    meta = ckpt.metadata
    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if meta.get(k) is not None]
    model = meta.get("tokenizer.ggml.model")
    if model in _NO_TEXT_MODELS:
        # llama.cpp's vocabulary without text (LLAMA_VOCAB_TYPE_NONE): ids only, even if
        # token strings were stored; its size is {arch}.vocab_size, read with the config.
        logger.info("%s: tokenizer model %r, token ids only", ckpt.path, model)
        return IdsOnlyTokenizer(eos_ids, vocab_size, ckpt.path)
    tokens = ckpt.field("tokenizer.ggml.tokens") if model else None
    if not model or not tokens:
        logger.info("%s has no tokenizer: token ids only", ckpt.path)
        return IdsOnlyTokenizer(eos_ids, vocab_size, ckpt.path)
    if model != "gpt2":
        raise CheckpointError(
            f"{ckpt.path}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only); "
            "pass token ids instead, or use the HF checkpoint"
        )
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    merges_raw = ckpt.field("tokenizer.ggml.merges") or []
    types = ckpt.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    tok = HFTok(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                           ignore_merges=pre in _IGNORE_MERGES_PRE))
    if pre in SPLIT_RULES:
        tok.pre_tokenizer = split_pre_tokenizer(pre)
    else:
        if pre not in ("gpt2", "gpt-2", "default"):  # "gpt-2": llama.cpp's name for the same rule
            logger.warning("%s: pre-tokenizer %r unknown; using GPT-2's split rule", ckpt.path, pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if int(ty) in (3, 4)]
    if special:
        tok.add_special_tokens(special)
    for t in _END_TOKENS:
        i = vocab.get(t)
        if i is not None and int(types[i]) == 3:
            eos_ids.append(i)

    def tok_text(key: str) -> Optional[str]:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return Tokenizer(
        tok,
        eos_ids,
        meta.get("tokenizer.chat_template"),
        bos_token=tok_text("tokenizer.ggml.bos_token_id"),
        eos_token=tok_text("tokenizer.ggml.eos_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)) and pre not in _NO_BOS_PRE,
        source=ckpt.path,
    )

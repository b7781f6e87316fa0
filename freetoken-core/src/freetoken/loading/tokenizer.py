"""Tokenizers: HF ``tokenizer.json`` directories, GGUF-embedded BPE vocabularies,
and chat templates rendered with jinja2 (sandboxed, as transformers does)."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any, Callable, Iterable, Optional

from freetoken.loading.hf import CheckpointError, read_json
from freetoken.loading.split_rules import IGNORE_MERGES_PRE, SPLIT_RULES, split_pre_tokenizer

logger = logging.getLogger(__name__)

#: Roles a chat message may have.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

#: End-of-turn tokens we also stop on when the vocabulary marks them as control tokens.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>")

#: the names a chat template is given by :meth:`Tokenizer.apply_chat_template` itself (and the
#: helpers it defines)
TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception",
                  "strftime_now")

#: GPT-OSS's harmony format: the ends of a turn (an answer, a tool call). A harmony vocabulary
#: has them, and there ``<|end|>`` only closes one message of a turn (the reasoning, before
#: the answer), so it is no end of generation.
HARMONY_ENDS = ("<|return|>", "<|call|>")
#: harmony's message markup: the role, the channel, the content type and the body follow
#: them. Decoded text keeps these control tokens (the server reads the channels from them).
HARMONY_MARKUP = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")


def _is_harmony(token_to_id: Callable[[str], Optional[int]]) -> bool:
    """Whether a vocabulary (its ``token_to_id``) has harmony's turn ends and markup."""
    return all(token_to_id(t) is not None for t in HARMONY_ENDS + HARMONY_MARKUP)


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
        #: id -> text of the control tokens decoded text keeps (harmony's markup, where the
        #: vocabulary is a harmony one)
        self.markup: dict[int, str] = {}
        if tok is not None and _is_harmony(tok.token_to_id):
            self.markup = {tok.token_to_id(t): t for t in HARMONY_MARKUP}

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
        """Text of ``ids``; special tokens skipped (``skip_special_tokens``) but for
        :attr:`markup`'s, which stay as their text."""
        ids = list(ids)
        if not skip_special_tokens or not self.markup or not any(i in self.markup for i in ids):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:
            if i in self.markup:
                parts.append(self._tok.decode(run, skip_special_tokens=True) if run else "")
                parts.append(self.markup[i])
                run = []
            else:
                run.append(i)
        parts.append(self._tok.decode(run, skip_special_tokens=True) if run else "")
        return "".join(parts)

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
                            tools: Optional[list[dict[str, Any]]] = None,
                            variables: Optional[dict[str, Any]] = None) -> str:
        """Render ``messages`` with the chat template. ``tools``: OpenAI-style tool definitions
        (``{"type": "function", "function": {...}}``), passed to the template as transformers does.
        ``variables``: more names for the template (e.g. ``enable_thinking``); they cannot
        replace the ones above (:data:`TEMPLATE_NAMES`)."""
        msgs = _alias_reasoning(validate_messages(messages))
        if not self.chat_template:
            raise ValueError(f"{self.source or 'this model'} has no chat template; send a plain prompt instead")
        import jinja2

        if self._template is None:
            self._template = _compile_template(self.chat_template)
        taken = sorted(set(variables or {}) & set(TEMPLATE_NAMES))
        if taken:
            raise ValueError(f"template variables {taken} are set by the server and cannot be given")
        try:
            return self._template.render(
                **(variables or {}),
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
                            tools: Optional[list[dict[str, Any]]] = None,
                            variables: Optional[dict[str, Any]] = None) -> str:
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
    if _is_harmony(tok.token_to_id):
        eos += [tok.token_to_id(t) for t in HARMONY_ENDS]  # a turn's ends, whatever the configs list
    return Tokenizer(tok, eos, template, bos_token, eos_token, add_bos=bool(tc.get("add_bos_token", False)), source=path)


# ------------------------------------------------------------------ GGUF


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
                           ignore_merges=pre in IGNORE_MERGES_PRE))
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
    harmony = all(t in vocab for t in HARMONY_ENDS)
    for t in _END_TOKENS + (HARMONY_ENDS if harmony else ()):
        i = vocab.get(t)
        if i is not None and int(types[i]) == 3 and not (harmony and t == "<|end|>"):
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

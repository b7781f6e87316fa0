"""JSON-schema constrained decoding through llguidance: ``response_format`` ``json_schema``
and the arguments of forced tool calls.

A schema (or a Lark grammar embedding schemas, for tool calls) is compiled by llguidance
into a grammar; each choice gets a :class:`SchemaConstraint` (a
:class:`freetoken.engine.constraints.TokenConstraint`) holding an ``LLMatcher`` over it.

* The vocabulary is given to llguidance once per tokenizer (:func:`grammar_vocab`): every
  token id's bytes (byte-level BPE tokens are mapped back through the GPT-2 byte
  alphabet; special tokens are marked special and never match grammar text) and the EOS id.
  Building it walks the whole vocabulary (about 1.3 s for 150k tokens), so callers do it
  off the event loop before the request joins the batch (:func:`compile_schema` and
  :func:`compile_grammar` are blocking).
* :meth:`SchemaConstraint.allowed_mask` asks llguidance for the bitmask of the state,
  computed in native code without the GIL, once per state; :meth:`SchemaConstraint.allows`
  reads the same mask (the matcher's own one-token check also accepts some tokens the mask
  leaves out, so it is not used).
* Unsupported schema keywords are reported by llguidance at compile time; they become
  :class:`SchemaError` (a 400 naming the keyword), never an unconstrained output.

Output is compact JSON (no whitespace between tokens of the grammar). Unlike the
``json_object`` automaton, the matcher does not keep the output closable within
``max_tokens``: with too small a budget the request ends with ``finish_reason`` "length"
and the text is a prefix of a valid document.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np
import torch

from freetoken.engine.token_texts import PerTokenizer

#: options applied to every schema: compact output, unknown keywords are errors
_OVERRIDES = {"whitespace_flexible": False, "lenient": False}


class SchemaError(ValueError):
    """A schema or grammar llguidance cannot enforce (the message names the feature)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """Every token id's bytes and the ids of the special tokens (whose bytes are
    ``b"\\xff" + name``, llguidance's convention, so no grammar text matches them)."""
    hf = tokenizer._tok
    n = int(tokenizer.vocab_size)
    special = {int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special}
    decoder = json.loads(hf.to_str()).get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    u2b = _byte_decoder()
    out: list[bytes] = []
    for i in range(n):
        piece = hf.id_to_token(i)
        if piece is None:
            out.append(b"")
        elif i in special:
            out.append(b"\xff" + piece.encode())
        elif byte_level and all(c in u2b for c in piece):
            out.append(bytes(u2b[c] for c in piece))
        else:
            out.append(hf.decode([i], skip_special_tokens=False).encode())
    return out, sorted(special)


class GrammarVocab:
    """The tokenizer's vocabulary as llguidance sees it (one per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        import llguidance

        tokens, special = token_bytes(tokenizer)
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else len(tokens) - 1
        self.size = len(tokens)
        self.eos_ids = list(tokenizer.eos_token_ids)

        class _Vocab:
            eos_token_id = eos
            bos_token_id = None

            def __init__(self) -> None:
                self.tokens = tokens
                self.special_token_ids = special

            def __call__(self, text: Any) -> list[int]:
                s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                return list(tokenizer.encode(s, add_special_tokens=False))

        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))


_VOCABS: PerTokenizer[GrammarVocab] = PerTokenizer(GrammarVocab)


def grammar_vocab(tokenizer: Any) -> GrammarVocab:
    """The :class:`GrammarVocab` of ``tokenizer`` (built on first use: blocking)."""
    return _VOCABS.get(tokenizer)


def check_supported(tokenizer: Any) -> Optional[str]:
    """Why schema-constrained decoding cannot run with this tokenizer (None if it can)."""
    if not getattr(tokenizer, "has_text", True) or not hasattr(tokenizer, "_tok"):
        return "needs a text tokenizer"
    return None


def schema_grammar(schema: Any) -> str:
    """The llguidance grammar of a JSON schema (compact output; raises SchemaError)."""
    import llguidance

    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_OVERRIDES)  # type: ignore[arg-type]
    except Exception as exc:  # malformed schemas are reported by raising
        raise SchemaError(str(exc)) from None
    return _validated(grammar)


def _validated(grammar: str) -> str:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(messages[0] if messages else "invalid grammar")
    return grammar


def lark_grammar(lark: str) -> str:
    """A Lark grammar (with ``%json {...}`` rules) checked by llguidance (raises SchemaError)."""
    return _validated(lark)


def schema_for_lark(schema: Any) -> str:
    """A schema as embedded in a Lark ``%json`` rule, with the compact-output options."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    return json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **_OVERRIDES}})


class SchemaConstraint:
    """The engine-side constraint of one choice: an llguidance matcher (a TokenConstraint)."""

    def __init__(self, vocab: GrammarVocab, grammar: str) -> None:
        import llguidance

        self.vocab = vocab
        self.matcher = llguidance.LLMatcher(vocab.llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise SchemaError(self.matcher.get_error())
        self._mask: Optional[torch.Tensor] = None  # of the current state

    def _state_mask(self) -> torch.Tensor:
        if self._mask is None:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            self._mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab.size].astype(np.bool_))
        return self._mask

    def allows(self, token_id: int, remaining: int) -> bool:
        return 0 <= token_id < self.vocab.size and bool(self._state_mask()[token_id])

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        mask = self._state_mask()
        if vocab_size > self.vocab.size:  # padded embedding rows: never valid
            mask = torch.cat([mask, torch.zeros(vocab_size - self.vocab.size, dtype=torch.bool)])
        return mask[:vocab_size]

    def advance(self, token_id: int) -> None:
        self._mask = None
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} cannot follow the grammar state: {self.matcher.get_error()}")

    def is_complete(self) -> bool:
        return self.matcher.is_stopped()


def compile_schema(tokenizer: Any, schema: Any) -> str:
    """Compile ``schema`` for ``tokenizer`` (blocking: builds the vocabulary on first use)."""
    grammar = schema_grammar(schema)
    grammar_vocab(tokenizer)
    return grammar


def schema_constraint(tokenizer: Any, grammar: str) -> SchemaConstraint:
    """A fresh constraint for one choice over a compiled grammar."""
    return SchemaConstraint(grammar_vocab(tokenizer), grammar)

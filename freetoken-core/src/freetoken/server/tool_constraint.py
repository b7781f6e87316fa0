"""``tool_choice: "required"`` or a named function: decoding constrained to one call.

The output is forced to be exactly one call in the model's markup
(:meth:`freetoken.server.tool_calls.ToolCallFormat.constrained_call`), e.g. for the
Hermes format::

    <tool_call>\\n{"name": "NAME", "arguments": {JSON object}}\\n</tool_call>

:class:`ToolCallConstraint` is a :class:`freetoken.engine.constraints.TokenConstraint`
over a character automaton with three phases:

* the text before the arguments, where NAME is any of the allowed functions (one for
  a named choice, every offered tool for ``required``); a token may run on from it
  into the arguments object (e.g. ``" {"``);
* the arguments, a JSON object checked by the JSON-mode automaton
  (:mod:`freetoken.server.json_grammar`) with JSON mode's per-state masks
  (:class:`freetoken.server.json_mode.JsonVocab`), so the cost per token is that of
  ``response_format: json_object``; a token there must end inside the object or
  exactly at its closing brace;
* the text after the object, then the request stops.

Functions without a ``parameters`` schema: the markup, the function name, and that the
arguments are one JSON object (with JSON mode's restrictions: no whitespace before ``{``,
no two whitespace characters in a row, depth 24); while the arguments are written, a
token is allowed only if the shortest closing text of the object plus the text after it
still fits in ``max_tokens``, as in JSON mode.

When any allowed function has a ``parameters`` schema, the whole call is instead one
llguidance grammar (:func:`call_grammar`: a Lark rule per function, its arguments a
``%json`` rule of its schema, :mod:`freetoken.server.schema_constraint`), so the arguments
follow the schema (property names, required properties, types, enums, ...), and the call
is kept closable within ``max_tokens`` as a json_schema answer is.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any, Optional, Union

import torch

from freetoken.engine.token_texts import PerTokenizer
from freetoken.server import json_grammar as g
from freetoken.server.json_mode import JsonVocab, vocab_for
from freetoken.server.schema_constraint import SchemaConstraint, lark_grammar, schema_constraint, schema_for_lark
from freetoken.server.tool_calls import ToolCallFormat

#: phases of the automaton: ("pre", text so far), ("json", JSON state), ("post", characters written)
State = tuple[str, Union[str, g.State, int]]

MASK_CACHE_STATES = 128


class CallGrammar:
    """The call texts allowed for a set of function names (immutable; shared by requests)."""

    def __init__(self, fmt: ToolCallFormat, names: list[str]) -> None:
        parts = [fmt.constrained_call(n) for n in names]
        self.prefixes = frozenset(p for p, _ in parts)
        suffixes = {s for _, s in parts}
        if len(suffixes) != 1:
            raise ValueError("a call format must close every call with the same text")
        self.suffix = suffixes.pop()
        self.start: State = ("pre", "")
        self._masks: collections.OrderedDict[State, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()

    def step(self, state: State, ch: str) -> Optional[State]:
        phase, data = state
        if phase == "pre":
            text = str(data) + ch
            if text in self.prefixes:
                return ("json", g.START)
            return ("pre", text) if any(p.startswith(text) for p in self.prefixes) else None
        if phase == "json":
            nxt = g.step(data, ch)  # type: ignore[arg-type]
            if nxt is None:
                return None
            return ("post", 0) if g.is_done(nxt) else ("json", nxt)
        if phase == "post":
            pos = int(data)  # type: ignore[arg-type]
            if pos < len(self.suffix) and self.suffix[pos] == ch:
                return ("post", pos + 1)
        return None

    def feed(self, state: State, text: str) -> Optional[State]:
        for ch in text:
            nxt = self.step(state, ch)
            if nxt is None:
                return None
            state = nxt
        return state

    def is_done(self, state: State) -> bool:
        return state[0] == "post" and state[1] == len(self.suffix)

    def literal_mask(self, vocab: JsonVocab, state: State) -> torch.Tensor:
        """Valid tokens from a state outside the arguments (walked over the vocabulary trie, cached)."""
        with self._lock:
            mask = self._masks.get(state)
            if mask is not None:
                self._masks.move_to_end(state)
                return mask
        hits = vocab.texts.trie("all").walk(state, self.step)
        mask = torch.zeros(vocab.size, dtype=torch.bool)
        if hits:
            mask[torch.tensor([t for t, _ in hits], dtype=torch.int64)] = True
        with self._lock:
            self._masks[state] = mask
            while len(self._masks) > MASK_CACHE_STATES:
                self._masks.popitem(last=False)
        return mask


class _Grammars:
    """Call grammars per (format, names), per tokenizer (their masks depend on the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self._items: dict[tuple[str, tuple[str, ...]], CallGrammar] = {}
        self._lock = threading.Lock()

    def get(self, fmt: ToolCallFormat, names: list[str]) -> CallGrammar:
        key = (fmt.name, tuple(sorted(set(names))))
        with self._lock:
            grammar = self._items.get(key)
            if grammar is None:
                if len(self._items) > 64:
                    self._items.clear()
                grammar = self._items[key] = CallGrammar(fmt, list(key[1]))
            return grammar


_GRAMMARS: PerTokenizer[_Grammars] = PerTokenizer(_Grammars)


class ToolCallConstraint:
    """The engine-side constraint of one choice that must be a call (a TokenConstraint)."""

    def __init__(self, vocab: JsonVocab, grammar: CallGrammar) -> None:
        self.vocab = vocab
        self.grammar = grammar
        self.state: State = grammar.start

    def _json_room(self, remaining: int, state: g.State) -> int:
        """The longest JSON closing text allowed after the next token (see JsonObjectConstraint)."""
        after = len(self.grammar.suffix)
        return max(remaining - 1 - after, self.vocab.close_len(state) - 1)

    def allows(self, token_id: int, remaining: int) -> bool:
        text = self.vocab.text(token_id)
        if text is None:
            return False
        phase, data = self.state
        if phase == "json":
            new = g.feed(data, text)  # type: ignore[arg-type]
            return new is not None and self.vocab.close_len(new) <= self._json_room(remaining, data)  # type: ignore[arg-type]
        return self.grammar.feed(self.state, text) is not None

    def fallback_token(self, remaining: int) -> Optional[int]:
        return None  # the mask is exact

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        phase, data = self.state
        if phase == "json":
            entry = self.vocab.masks(data)  # type: ignore[arg-type]
            room = self._json_room(remaining, data)  # type: ignore[arg-type]
            mask = entry.mask if entry.max_close <= room else entry.mask & (entry.close <= room)
        else:
            mask = self.grammar.literal_mask(self.vocab, self.state)
        if vocab_size > self.vocab.size:  # padded embedding rows: never valid
            mask = torch.cat([mask, torch.zeros(vocab_size - self.vocab.size, dtype=torch.bool)])
        return mask[:vocab_size]

    def advance(self, token_id: int) -> None:
        text = self.vocab.text(token_id)
        new = self.grammar.feed(self.state, text) if text is not None else None
        if new is None:
            raise ValueError(f"token {token_id} ({text!r}) cannot follow the tool call state {self.state}")
        self.state = new

    def is_complete(self) -> bool:
        return self.grammar.is_done(self.state)


def call_grammar(fmt: ToolCallFormat, schemas: dict[str, Optional[dict[str, Any]]]) -> str:
    """The llguidance grammar of one call to any function of ``schemas`` (name -> parameters
    schema; None: any object). Raises SchemaError naming what the schemas use that
    llguidance does not support."""
    rules = []
    for i, (name, schema) in enumerate(sorted(schemas.items())):
        before, after = fmt.constrained_call(name)
        rules.append(f"call_{i}: {json.dumps(before)} args_{i} {json.dumps(after)}\n"
                     f"args_{i}: %json {schema_for_lark(schema if schema is not None else {'type': 'object'})}\n")
    start = "start: " + " | ".join(f"call_{i}" for i in range(len(rules))) + "\n"
    return lark_grammar(start + "".join(rules))


def tool_call_constraint(tokenizer: Any, fmt: ToolCallFormat, names: list[str],
                         grammar: Optional[str] = None) -> Union[ToolCallConstraint, SchemaConstraint]:
    """A fresh constraint for one choice: one call to any of ``names``; with ``grammar``
    (from :func:`call_grammar`), the call follows that grammar instead."""
    if grammar is not None:
        return schema_constraint(tokenizer, grammar)
    return ToolCallConstraint(vocab_for(tokenizer), _GRAMMARS.get(tokenizer).get(fmt, names))

"""``response_format: {"type": "json_object"}``: a token constraint inside the engine's
sampler, so the answer is always a JSON object and costs no extra engine work.

Each choice gets a :class:`JsonObjectConstraint` (a
:class:`freetoken.engine.constraints.TokenConstraint`) holding the state of the JSON
automaton (:mod:`freetoken.server.json_grammar`) for its output so far. At every step
the sampler masks the tokens the automaton rejects, after the penalties and before
temperature / top-k / top-p / min-p: greedy takes the best valid token, sampling
draws from the model's distribution renormalised over the valid tokens. There is one
engine request per choice and no re-prefill.

Finding the valid tokens fast (:class:`JsonVocab`, one per tokenizer, shared by all
requests):

* every token's text is decoded once per tokenizer
  (:func:`freetoken.engine.token_texts.token_texts`);
* greedy requests first test the top candidates one by one (usually the model's
  own first choice is valid) and need no mask at all;
* the full mask for an automaton state is found by walking a trie of the token texts
  against the automaton, and cached per state (LRU). Inside a string, which is where
  most tokens are generated, every token without ``"``, ``\\`` or a control
  character is valid and leaves the state unchanged, so only the small trie of the
  other tokens is walked.

Staying closable within ``max_tokens``: each mask entry also records, per token, the
length of the shortest closing text after it (:func:`json_grammar.closing`). A token
is valid only if that closing text still fits the tokens left after it (each closing
character has a single-character token, checked by :func:`check_supported`), so the
object always closes in budget and ``finish_reason`` is "stop"; when the budget gets
tight only tokens that shorten the closing text remain, down to the closing text
itself. The request stops as soon as the object is complete. Stop strings still end
a request early (the text before them is then not necessarily complete JSON).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, AsyncIterator, Optional

import torch

from freetoken.engine.outputs import StreamDelta
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.token_texts import PerTokenizer, TokenTexts, token_texts
from freetoken.server import json_grammar as g

logger = logging.getLogger(__name__)

#: automaton states whose masks are kept per tokenizer (least recently used go first)
MASK_CACHE_STATES = 256


def _plain(text: str) -> bool:
    """Text that any string accepts and leaves in the same state."""
    return '"' not in text and "\\" not in text and all(ord(c) >= 0x20 for c in text)


class _StateMasks:
    """Valid tokens from one automaton state: ``mask[t]`` and, where valid,
    ``close[t]`` = the length of the shortest closing text after ``t``."""

    __slots__ = ("mask", "close", "max_close")

    def __init__(self, mask: torch.Tensor, close: torch.Tensor) -> None:
        self.mask = mask
        self.close = close
        self.max_close = int(close[mask].max()) if bool(mask.any()) else 0


class JsonVocab:
    """The tokenizer's vocabulary as the JSON automaton sees it (one per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.texts: TokenTexts = token_texts(tokenizer)
        self.size = len(self.texts.text)
        self._all = self.texts.trie("all")
        self._special = self.texts.trie("json-not-plain", lambda t: not _plain(t))
        plain = [t is not None and _plain(t) for t in self.texts.text]
        self._plain_mask = torch.tensor(plain, dtype=torch.bool)
        self._masks: collections.OrderedDict[g.State, _StateMasks] = collections.OrderedDict()
        self._close: dict[g.State, int] = {}
        self._char: dict[str, Optional[int]] = {}
        self._lock = threading.Lock()
        self.warm = False  # masks of the commonest states computed (check_supported)

    def text(self, token_id: int) -> Optional[str]:
        return self.texts.text[token_id] if 0 <= token_id < self.size else None

    def char_token(self, ch: str) -> Optional[int]:
        """The single token whose text is exactly ``ch``."""
        if ch not in self._char:
            ids = list(self._tok.encode(ch, add_special_tokens=False))
            self._char[ch] = ids[0] if len(ids) == 1 and self.text(ids[0]) == ch else None
        return self._char[ch]

    def close_len(self, state: g.State) -> int:
        """Length of the shortest text that completes the document from ``state``."""
        n = self._close.get(state)
        if n is None:
            if len(self._close) > 1 << 16:
                self._close.clear()
            n = self._close[state] = len(g.closing(state))
        return n

    def cached(self, state: g.State) -> Optional[_StateMasks]:
        return self._masks.get(state)

    def masks(self, state: g.State) -> _StateMasks:
        """The valid tokens from ``state`` (computed once per state, then cached)."""
        with self._lock:
            entry = self._masks.get(state)
            if entry is not None:
                self._masks.move_to_end(state)
                return entry
            if state[0] == g.STR:  # plain tokens stay in this very state; walk only the others
                mask = self._plain_mask.clone()
                close = torch.full((self.size,), self.close_len(state), dtype=torch.int32)
                hits = self._special.walk(state, g.step)
            else:
                mask = torch.zeros(self.size, dtype=torch.bool)
                close = torch.zeros(self.size, dtype=torch.int32)
                hits = self._all.walk(state, g.step)
            if hits:
                ids = torch.tensor([t for t, _ in hits], dtype=torch.int64)
                mask[ids] = True
                close[ids] = torch.tensor([self.close_len(s) for _, s in hits], dtype=torch.int32)
            entry = self._masks[state] = _StateMasks(mask, close)
            while len(self._masks) > MASK_CACHE_STATES:
                self._masks.popitem(last=False)
            return entry


_VOCABS: PerTokenizer[JsonVocab] = PerTokenizer(JsonVocab)


def vocab_for(tokenizer: Any) -> JsonVocab:
    return _VOCABS.get(tokenizer)


#: masks computed ahead for the states along this text (the commonest ones)
_WARM_TEXT = '{"a": "b", "c": [1, -2.5e3, true, false, null, {"d": {}}], "e": 0}'


def check_supported(tokenizer: Any) -> Optional[str]:
    """Why json_object mode cannot run with this tokenizer (None if it can). The first
    call per tokenizer builds its :class:`JsonVocab` and the commonest masks (blocking)."""
    if not getattr(tokenizer, "has_text", True):
        return "response_format json_object needs a text tokenizer"
    vocab = vocab_for(tokenizer)
    missing = [c for c in '{}[]":,0123456789-.eEtrufalsn' if vocab.char_token(c) is None]
    if missing:
        return f"response_format json_object needs single-character tokens for {''.join(missing)!r}"
    if not vocab.warm:
        vocab.warm = True
        state: Optional[g.State] = g.START
        for ch in _WARM_TEXT:
            assert state is not None
            vocab.masks(state)
            state = g.step(state, ch)
    return None


class JsonObjectConstraint:
    """The engine-side constraint of one json_object choice (a TokenConstraint)."""

    def __init__(self, vocab: JsonVocab) -> None:
        self.vocab = vocab
        self.state: g.State = g.START
        self._close = vocab.close_len(self.state)

    def _room(self, remaining: int) -> int:
        """The longest closing text allowed after the next token: what the tokens left
        after it can write; if the budget was too small from the start, any progress."""
        return max(remaining - 1, self._close - 1)

    def allows(self, token_id: int, remaining: int) -> bool:
        room = self._room(remaining)
        entry = self.vocab.cached(self.state)
        if entry is not None:
            return 0 <= token_id < self.vocab.size and bool(entry.mask[token_id]) and int(entry.close[token_id]) <= room
        text = self.vocab.text(token_id)
        new = g.feed(self.state, text) if text is not None else None
        return new is not None and self.vocab.close_len(new) <= room

    def fallback_token(self, remaining: int) -> Optional[int]:
        return None  # the mask is exact

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        entry = self.vocab.masks(self.state)
        room = self._room(remaining)
        mask = entry.mask if entry.max_close <= room else entry.mask & (entry.close <= room)
        if vocab_size > self.vocab.size:  # padded embedding rows: never valid
            mask = torch.cat([mask, torch.zeros(vocab_size - self.vocab.size, dtype=torch.bool)])
        return mask[:vocab_size]

    def advance(self, token_id: int) -> None:
        text = self.vocab.text(token_id)
        new = g.feed(self.state, text) if text is not None else None
        if new is None:
            raise ValueError(f"token {token_id} ({text!r}) cannot follow the JSON state {self.state}")
        self.state = new
        self._close = self.vocab.close_len(new)

    def is_complete(self) -> bool:
        return g.is_done(self.state)


def json_object_stream(engine: Any, prompt_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[StreamDelta]:
    """``engine.stream`` with the json_object constraint: one engine request."""
    constraint = JsonObjectConstraint(vocab_for(engine.tokenizer))
    return engine.stream(prompt_ids, params, request_id=request_id, constraint=constraint)

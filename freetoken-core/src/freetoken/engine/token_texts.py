"""The vocabulary as text, for constraints that work on characters.

:class:`TokenTexts` decodes every token id of a tokenizer once (cached per
tokenizer by :func:`token_texts`) and builds character tries over them. A
character-level automaton then finds every token it accepts from a state by
walking a trie (:meth:`TokenTrie.walk`): a branch is cut at the first character the
automaton rejects, so the cost is the number of trie nodes still alive, not the
size of the vocabulary times the token length.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, Generic, Iterable, Optional, TypeVar

logger = logging.getLogger(__name__)

S = TypeVar("S")


class _Node:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.ids: list[int] = []  # tokens whose text ends here


class TokenTrie:
    """A character trie over some tokens' texts."""

    def __init__(self, items: Iterable[tuple[int, str]]) -> None:
        self.root = _Node()
        self.size = 0
        for tid, text in items:
            node = self.root
            for ch in text:
                nxt = node.children.get(ch)
                if nxt is None:
                    nxt = node.children[ch] = _Node()
                node = nxt
            node.ids.append(tid)
            self.size += 1

    def walk(self, state: S, step: Callable[[S, str], Optional[S]]) -> list[tuple[int, S]]:
        """Every token whose whole text ``step`` accepts from ``state``, with the state after it.
        ``step(state, ch)`` returns the next state or None (rejected)."""
        out: list[tuple[int, S]] = []
        todo: list[tuple[_Node, S]] = [(self.root, state)]
        while todo:
            node, st = todo.pop()
            for tid in node.ids:
                out.append((tid, st))
            for ch, child in node.children.items():
                nxt = step(st, ch)
                if nxt is not None:
                    todo.append((child, nxt))
        return out


class TokenTexts:
    """``text[i]``: the text of token ``i`` decoded on its own, or None for tokens that
    have no text of their own (special tokens, empty, or a partial UTF-8 sequence)."""

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None) -> None:
        t0 = time.perf_counter()
        n = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
        self.vocab_size = n
        self.text: list[Optional[str]] = []
        for i in range(n):
            try:
                t = tokenizer.decode([i], skip_special_tokens=True)
            except Exception:  # ids past the tokenizer's own table (padded embedding rows)
                t = ""
            self.text.append(t if t and "\ufffd" not in t else None)
        self._tries: dict[str, TokenTrie] = {}
        self._lock = threading.Lock()
        logger.info("decoded %d token texts in %.2f s", n, time.perf_counter() - t0)

    def trie(self, name: str, keep: Optional[Callable[[str], bool]] = None) -> TokenTrie:
        """The trie of the tokens with text (those for which ``keep(text)`` holds), cached by ``name``."""
        with self._lock:
            tr = self._tries.get(name)
            if tr is None:
                tr = TokenTrie((i, t) for i, t in enumerate(self.text) if t is not None and (keep is None or keep(t)))
                self._tries[name] = tr
            return tr


_V = TypeVar("_V")


class PerTokenizer(Generic[_V]):
    """One ``factory(tokenizer)`` result per live tokenizer, built once, thread-safe.

    Entries go away with their tokenizer (weak keys). Used for the token texts here
    and for derived per-vocabulary tables elsewhere (e.g. JSON mode's masks).
    """

    def __init__(self, factory: Callable[[Any], _V]) -> None:
        self._factory = factory
        self._items: "weakref.WeakKeyDictionary[Any, _V]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, tokenizer: Any) -> _V:
        with self._lock:
            item = self._items.get(tokenizer)
            if item is None:
                item = self._items[tokenizer] = self._factory(tokenizer)
            return item


_TEXTS: PerTokenizer[TokenTexts] = PerTokenizer(TokenTexts)


def token_texts(tokenizer: Any) -> TokenTexts:
    """The :class:`TokenTexts` of ``tokenizer`` (built on first use, then cached)."""
    return _TEXTS.get(tokenizer)

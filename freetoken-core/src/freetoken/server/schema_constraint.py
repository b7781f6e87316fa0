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
* :class:`SchemaConstraint` computes each state's bitmask in a background thread as soon as
  the state is reached (native code without the GIL), so the mask overlaps the batch's next
  forward pass; :meth:`SchemaConstraint.allows` reads the same mask (the matcher's own
  one-token check also accepts some tokens the mask leaves out, so it is not used).
* The output is kept closable within ``max_tokens`` through the shortest closing of each
  state (:mod:`freetoken.server.grammar_closing`; the policy is on :class:`SchemaConstraint`).
* Unsupported schema keywords are reported by llguidance at compile time; they become
  :class:`SchemaError` (a 400 naming the keyword), never an unconstrained output.

Output is compact JSON (no whitespace between tokens of the grammar).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Optional, TypeVar

import numpy as np
import torch

from freetoken.loading.byte_level import byte_decoder
from freetoken.server.grammar_closing import (
    CLOSING_ORDER,
    MAX_CLOSING,
    ClosingWalk,
    candidate_tokens,
    closing_tokens,
    still_closes,
    still_closes_after,
)

#: options applied to every schema: compact output, unknown keywords are errors
_OVERRIDES = {"whitespace_flexible": False, "lenient": False}


class SchemaError(ValueError):
    """A schema or grammar llguidance cannot enforce (the message names the feature)."""


def token_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """Every token id's bytes and the ids of the special tokens (whose bytes are
    ``b"\\xff" + name``, llguidance's convention, so no grammar text matches them)."""
    hf = tokenizer._tok
    n = int(tokenizer.vocab_size)
    special = {int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special}
    decoder = json.loads(hf.to_str()).get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    u2b = byte_decoder()
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
    """A vocabulary as llguidance sees it (one per tokenizer): every token id's bytes,
    the special tokens and the EOS id, and the single-byte tokens the closing walk uses."""

    def __init__(self, tokens: list[bytes], special: list[int], eos_ids: list[int]) -> None:
        import llguidance

        eos = eos_ids[0] if eos_ids else len(tokens) - 1
        self.size = len(tokens)
        self.eos_ids = list(eos_ids)
        self.eos = eos
        self.closing_candidates = candidate_tokens(tokens, set(special))
        self._candidates_by_order = {CLOSING_ORDER: self.closing_candidates}
        self._token_list, self._special = tokens, set(special)
        encode = self._encode

        class _Vocab:
            eos_token_id = eos
            bos_token_id = None

            def __init__(self) -> None:
                self.tokens = tokens
                self.special_token_ids = special

            def __call__(self, text: Any) -> list[int]:
                return encode(text)

        self._tokenizer: Any = None
        skip = set(special)
        self._ids = {b: i for i, b in reversed(list(enumerate(tokens))) if b and i not in skip}
        self._longest = max((len(b) for b in self._ids), default=1)
        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))

    def _encode(self, text: Any) -> list[int]:
        """Text -> token ids: the tokenizer's own encoding, or (a vocabulary given as bytes
        only) the longest matching token at each position."""
        if self._tokenizer is not None:
            s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            return list(self._tokenizer.encode(s, add_special_tokens=False))
        data = text if isinstance(text, bytes) else str(text).encode()
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tok = self._ids.get(data[i : i + n])
                if tok is not None:
                    out.append(tok)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} has no token in this vocabulary")
        return out

    def candidates(self, order: Optional[bytes]) -> list[int]:
        """The closing walk's single-byte tokens in ``order`` (None: the default order)."""
        order = CLOSING_ORDER if order is None else order
        if order not in self._candidates_by_order:
            self._candidates_by_order[order] = candidate_tokens(self._token_list, self._special, order)
        return self._candidates_by_order[order]

    @classmethod
    def of_tokenizer(cls, tokenizer: Any) -> "GrammarVocab":
        tokens, special = token_bytes(tokenizer)
        vocab = cls(tokens, special, list(tokenizer.eos_token_ids))
        vocab._tokenizer = tokenizer
        return vocab


_V = TypeVar("_V")


class PerTokenizer(Generic[_V]):
    """One ``factory(tokenizer)`` result per live tokenizer, built once, thread-safe;
    entries go away with their tokenizer (weak keys)."""

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


_VOCABS: PerTokenizer[GrammarVocab] = PerTokenizer(GrammarVocab.of_tokenizer)


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


#: the budget policy (see SchemaConstraint): the output is closed by force once no more
#: than FORCE_SLACK tokens are left beyond its closing, and each token is checked against
#: the budget once no more than CHECK_SLACK are
FORCE_SLACK = 2
CHECK_SLACK = 48

#: threads that compute the masks of the next states, shared by every constrained request
MASK_THREADS = 4
_MASK_POOL = ThreadPoolExecutor(max_workers=MASK_THREADS, thread_name_prefix="grammar-mask")


@dataclasses.dataclass
class _StateInfo:
    """What the sampler needs of one grammar state, computed off the engine step."""

    mask: torch.Tensor  # bool [vocab]: the tokens the grammar allows next
    closing: Optional[list[int]]  # the shortest closing from here (grammar_closing), None: unknown
    compute_s: float  # seconds spent computing it


@dataclasses.dataclass
class MaskTiming:
    """Where a constraint's mask time went (seconds, summed over its states)."""

    computed: float = 0.0  # computing masks and closings (in the background)
    waited: float = 0.0  # the engine's thread blocked until one was ready
    states: int = 0


class SchemaConstraint:
    """The engine-side constraint of one choice: an llguidance matcher (a TokenConstraint).

    **Off the engine step.** The state's mask (and its closing) is computed by a
    background thread (:data:`MASK_THREADS` shared by all requests): the first when the
    constraint is made, while the prompt is prefilled, then each right after
    :meth:`advance` commits a token, so it overlaps the next forward pass of the whole
    batch (llguidance computes masks in native code without the GIL). The sampler's
    first query waits only for what is left of it (:attr:`timing`).

    **Closable within max_tokens.** With ``remaining`` tokens left (this one included)
    and a closing of ``L`` tokens from the current state
    (:func:`freetoken.server.grammar_closing.closing_tokens`):

    * ``remaining <= L + FORCE_SLACK``: only the closing's first token is allowed, so
      the output ends as its shortest completion;
    * ``remaining <= L + CHECK_SLACK``: a token of the mask is allowed only if the closing
      after it still fits in ``remaining - 1`` (the sampler checks its pick with
      :meth:`allows`, :meth:`fallback_token` is the closing's first token);
    * further from the budget, every token of the grammar's mask is allowed.

    So the output is complete JSON whenever ``max_tokens`` covers the closing of the
    empty output (and no single token grows the closing by more than ``CHECK_SLACK``
    tokens while it is farther than that from the budget). When it cannot be kept
    (``L > remaining`` at the start, or no closing found within
    :data:`~freetoken.server.grammar_closing.MAX_CLOSING` bytes) the grammar alone
    applies and the choice may end with "length" and a prefix of a document.
    """

    def __init__(self, vocab: GrammarVocab, grammar: str, closing: Optional[ClosingWalk] = None) -> None:
        import llguidance

        self.vocab = vocab
        walk = closing or ClosingWalk()
        self._candidates = vocab.candidates(walk.order)
        self._skip_loops = walk.skip_loops
        self.matcher = llguidance.LLMatcher(vocab.llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise SchemaError(self.matcher.get_error())
        self.timing = MaskTiming()
        # the matcher is busy while a state is computed (llguidance refuses a second
        # borrower), so completion is kept here
        self._stopped = self.matcher.is_stopped()
        self._remaining: Optional[int] = None  # the budget at the state being computed, when known
        self._last_closing: Optional[list[int]] = None
        self._info: Optional[_StateInfo] = None  # of the current state, once waited for
        self._pending: Optional[Future[_StateInfo]] = _MASK_POOL.submit(self._compute)

    def _compute(self) -> _StateInfo:
        t0 = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab.size].astype(np.bool_))
        return _StateInfo(mask, self._closing(mask), time.perf_counter() - t0)

    def _closing(self, mask: torch.Tensor) -> Optional[list[int]]:
        """The closing of the current state: none needed while the budget is farther than
        any closing; else the last state's closing (or its tail, when the token taken was
        its first) when it still finishes the document; else a fresh walk."""
        if self._remaining is not None and self._remaining > MAX_CLOSING + CHECK_SLACK:
            return None
        eos = self.vocab.eos
        last = self._last_closing
        if last:
            for option in (last[1:], last):
                if option and bool(mask[option[0]]) and still_closes(self.matcher, option, eos):
                    return option
        return closing_tokens(self.matcher, self._candidates, eos, skip_loops=self._skip_loops)

    def _state(self) -> _StateInfo:
        if self._info is None:
            if self._pending is None:  # after a failed computation
                self._pending = _MASK_POOL.submit(self._compute)
            t0 = time.perf_counter()
            try:
                info = self._pending.result()
            finally:
                self._pending = None
            self.timing.waited += time.perf_counter() - t0
            self.timing.computed += info.compute_s
            self.timing.states += 1
            self._info = info
        return self._info

    def _zone(self, info: _StateInfo, remaining: int) -> str:
        """"free", "check" or "force" (see the class docstring)."""
        if info.closing is None or len(info.closing) > remaining:
            return "free"  # cannot be kept closable: the grammar alone
        slack = remaining - len(info.closing)
        return "force" if slack <= FORCE_SLACK else "check" if slack <= CHECK_SLACK else "free"

    def _fits(self, token_id: int, remaining: int, closing: list[int]) -> bool:
        """Whether the output still closes within ``remaining - 1`` tokens after ``token_id``:
        at once when the state's closing still finishes the document after it (most
        tokens inside strings and numbers), else by a walk from the state after it."""
        if token_id == closing[0] or (len(closing) <= remaining - 1 and still_closes_after(
                self.matcher, token_id, closing, self.vocab.eos)):
            return True
        m = self.matcher.deep_copy()
        if not m.consume_token(token_id):
            return False
        after = closing_tokens(m, self._candidates, self.vocab.eos, skip_loops=self._skip_loops)
        return after is not None and len(after) <= remaining - 1

    def allows(self, token_id: int, remaining: int) -> bool:
        self._remaining = remaining
        info = self._state()
        if not (0 <= token_id < self.vocab.size and bool(info.mask[token_id])):
            return False
        zone = self._zone(info, remaining)
        if zone == "force":
            return token_id == info.closing[0]  # type: ignore[index]
        if zone == "check" and not self._stopped:
            return token_id in self.vocab.eos_ids or self._fits(token_id, remaining, info.closing)  # type: ignore[arg-type]
        return True

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        self._remaining = remaining
        info = self._state()
        mask = info.mask
        if self._zone(info, remaining) == "force":
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)
            mask[info.closing[0]] = True  # type: ignore[index]
        if vocab_size > self.vocab.size:  # padded embedding rows: never valid
            mask = torch.cat([mask, torch.zeros(vocab_size - self.vocab.size, dtype=torch.bool)])
        return mask[:vocab_size]

    def fallback_token(self, remaining: int) -> Optional[int]:
        info = self._state()
        return info.closing[0] if info.closing else None

    def advance(self, token_id: int) -> None:
        self._last_closing = self._state().closing  # (the background computation is done with the matcher)
        self._info = None
        if self._remaining is not None:
            self._remaining -= 1
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} cannot follow the grammar state: {self.matcher.get_error()}")
        self._stopped = self.matcher.is_stopped()
        if not self._stopped:
            self._pending = _MASK_POOL.submit(self._compute)

    def is_complete(self) -> bool:
        return self._stopped

    def restricts(self) -> bool:
        return True


def compile_schema(tokenizer: Any, schema: Any) -> str:
    """Compile ``schema`` for ``tokenizer`` (blocking: builds the vocabulary on first use)."""
    grammar = schema_grammar(schema)
    grammar_vocab(tokenizer)
    return grammar


def schema_constraint(tokenizer: Any, grammar: str, closing: Optional[ClosingWalk] = None) -> SchemaConstraint:
    """A fresh constraint for one choice over a compiled grammar."""
    return SchemaConstraint(grammar_vocab(tokenizer), grammar, closing)

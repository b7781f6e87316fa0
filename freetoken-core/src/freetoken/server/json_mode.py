"""``response_format: {"type": "json_object"}``: constrained decoding on top of the
engine's streaming interface, so the answer is always a JSON object.

The engine has no per-token mask hook, so the constraint is applied by rejection:

1. Stream from the engine as usual and check every token against the JSON
   automaton (:mod:`freetoken.server.json_grammar`) and against the budget (the
   document must still be closable within ``max_tokens``). Valid tokens are kept.
2. At the first invalid token, abort that engine request. Ask the engine for the
   full next-token distribution at that position (a one-token request with
   ``top_logprobs`` = the vocabulary), apply the request's own penalties,
   temperature, top-k, top-p and min-p (the engine's functions), drop the tokens
   the automaton rejects, and draw from what remains (greedy: the best valid
   token). Then continue with step 1 from the longer prefix.

An engine draw that is accepted has probability p(t); a rejected one is redrawn from
p restricted to the valid set, so each token is distributed exactly as p masked to
valid tokens and renormalised (for greedy: the most likely valid token), which is
what a logits mask inside the engine would give. The price is one re-prefill of
the prefix per rejection. When the remaining budget equals the shortest closing
text (e.g. ``"}``), that text is emitted as single-character tokens, so the object
closes before ``max_tokens`` and ``finish_reason`` is "stop". The request's
repetition penalty is applied to log-probabilities rather than raw logits in the
redraw (a small difference from the engine). Stop strings end the request as usual
(the text before them is not necessarily complete JSON).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, AsyncIterator, Optional

import torch

from freetoken.engine.outputs import StreamDelta, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.server import json_grammar as g


class JsonVocab:
    """Token texts as the automaton sees them (cached per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._text: dict[int, Optional[str]] = {}
        self._char: dict[str, Optional[int]] = {}

    def text(self, token_id: int) -> Optional[str]:
        """The token's text, or None for special tokens and partial UTF-8 pieces."""
        if token_id not in self._text:
            t = self._tok.decode([token_id], skip_special_tokens=True)
            self._text[token_id] = t if t and "\ufffd" not in t else None
        return self._text[token_id]

    def char_token(self, ch: str) -> Optional[int]:
        """The single token whose text is exactly ``ch``."""
        if ch not in self._char:
            ids = list(self._tok.encode(ch, add_special_tokens=False))
            self._char[ch] = ids[0] if len(ids) == 1 and self.text(ids[0]) == ch else None
        return self._char[ch]


_VOCABS: dict[int, tuple[Any, JsonVocab]] = {}


def vocab_for(tokenizer: Any) -> JsonVocab:
    entry = _VOCABS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = (tokenizer, JsonVocab(tokenizer))
        _VOCABS[id(tokenizer)] = entry
    return entry[1]


def check_supported(tokenizer: Any) -> Optional[str]:
    """Why json_object mode cannot run with this tokenizer (None if it can)."""
    if not getattr(tokenizer, "has_text", True):
        return "response_format json_object needs a text tokenizer"
    vocab = vocab_for(tokenizer)
    missing = [c for c in '{}[]":,0123456789-.eEtrufalsn' if vocab.char_token(c) is None]
    if missing:
        return f"response_format json_object needs single-character tokens for {''.join(missing)!r}"
    return None


class _Decoder:
    """One json_object choice: state, output so far, and the engine calls."""

    def __init__(self, engine: Any, prompt_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.engine = engine
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id
        self.vocab = vocab_for(engine.tokenizer)
        self.budget = int(params.max_tokens or max(1, engine.max_model_len - len(prompt_ids)))
        self.state: g.State = g.START
        self.out_ids: list[int] = []
        self.counts: dict[int, int] = {}
        self.text = ""
        self.calls = 0
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        self.gen = torch.Generator().manual_seed(int(seed) % 2**63)

    # ---------------------------------------------------------------- helpers

    def _rid(self, kind: str) -> str:
        self.calls += 1
        return f"{self.request_id}.{kind}{self.calls}"

    def advance(self, token_id: int) -> Optional[g.State]:
        """The state after ``token_id`` if it is valid here and still closable within budget."""
        text = self.vocab.text(token_id)
        if text is None:
            return None
        new = g.feed(self.state, text)
        if new is None:
            return None
        room = self.budget - len(self.out_ids) - 1
        if not g.is_done(new) and len(g.closing(new)) > room:
            return None
        return new

    def accept(self, token_id: int, state: g.State) -> str:
        self.state = state
        self.out_ids.append(token_id)
        self.counts[token_id] = self.counts.get(token_id, 0) + 1
        piece = self.vocab.text(token_id) or ""
        self.text += piece
        return piece

    def stop_hit(self) -> Optional[int]:
        """Index where a stop string starts in the text, if one appeared."""
        hits = [self.text.find(s) for s in self.params.stop if s and s in self.text]
        return min(hits) if hits else None

    def delta(self, ids: list[int], text: str, lps: list[TokenLogprob], reason: Optional[str] = None) -> StreamDelta:
        return StreamDelta(self.request_id, ids, text, lps, reason is not None, reason, len(self.prompt_ids),
                           len(self.out_ids))

    async def distribution(self) -> torch.Tensor:
        """Log-probabilities of every token at the current position (the model's, unprocessed)."""
        V = int(getattr(self.engine.tokenizer, "vocab_size", 0) or 0) or 1 << 20
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=V, ignore_eos=True)
        stream = self.engine.stream(self.prompt_ids + self.out_ids, params, request_id=self._rid("d"))
        entry: Optional[TokenLogprob] = None
        try:
            async for d in stream:
                if d.logprobs:
                    entry = d.logprobs[0]
                    break
        finally:
            await stream.aclose()
        if entry is None or not entry.top:
            raise RuntimeError("the engine returned no log-probabilities for json_object decoding")
        size = max(t for t, _ in entry.top) + 1
        row = torch.full((size,), float("-inf"))
        ids = torch.tensor([t for t, _ in entry.top], dtype=torch.int64)
        row[ids] = torch.tensor([lp for _, lp in entry.top], dtype=torch.float32)
        return row

    def choose(self, row: torch.Tensor) -> Optional[tuple[int, g.State]]:
        """The token to emit from a full distribution, restricted to valid tokens."""
        from freetoken.engine.sampling import apply_penalties, sampling_probs

        p = self.params
        row = apply_penalties(row, p, self.prompt_ids, self.counts)
        if not p.greedy:
            probs = sampling_probs(row, p).clone()
            for _ in range(64):  # draws; most land on a valid token quickly
                if float(probs.sum()) <= 0:
                    break
                tid = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
                new = self.advance(tid)
                if new is not None:
                    return tid, new
                probs[tid] = 0.0
            # few valid tokens survive the filters: fall through to the best valid one
        for tid in torch.argsort(row, descending=True).tolist():
            if row[tid] == float("-inf"):
                break
            new = self.advance(tid)
            if new is not None:
                return tid, new
        return None

    def logprob_entry(self, row: torch.Tensor, tid: int) -> TokenLogprob:
        n = self.params.top_logprobs
        top: list[tuple[int, float]] = []
        if n > 0:
            v, i = torch.topk(row, min(n, row.shape[0]))
            top = [(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist())]
        return TokenLogprob(token_id=tid, logprob=float(row[tid]), top=top)


async def json_object_stream(engine: Any, prompt_ids: list[int], params: SamplingParams,
                             request_id: Optional[str] = None) -> AsyncIterator[StreamDelta]:
    """Like ``engine.stream``, but the generated text is always (a prefix of) a JSON object."""
    dec = _Decoder(engine, prompt_ids, params, request_id or "json")
    want_lp = params.logprobs or params.top_logprobs > 0
    while True:
        if g.is_done(dec.state):
            yield dec.delta([], "", [], "stop")
            return
        remaining = dec.budget - len(dec.out_ids)
        if remaining <= 0:
            yield dec.delta([], "", [], "length")
            return
        close = g.closing(dec.state)
        if remaining <= len(close):
            # Exactly enough budget left to close the object: emit the closing text.
            for ch in close[:remaining]:
                tid = dec.vocab.char_token(ch)
                if tid is None:
                    yield dec.delta([], "", [], "length")
                    return
                lps = [dec.logprob_entry(await dec.distribution(), tid)] if want_lp else []
                new = g.step(dec.state, ch)
                assert new is not None
                piece = dec.accept(tid, new)
                yield dec.delta([tid], piece, lps)
            continue
        sub_params = dataclasses.replace(
            params, max_tokens=remaining, stop=[], stop_token_ids=[], ignore_eos=True,
            seed=None if params.seed is None else (params.seed + 7919 * dec.calls) % 2**63,
        )
        stream = engine.stream(prompt_ids + dec.out_ids, sub_params, request_id=dec._rid("s"))
        rejected = False
        try:
            async for d in stream:
                ids: list[int] = []
                text = ""
                lps: list[TokenLogprob] = []
                for k, tid in enumerate(d.token_ids):
                    new = dec.advance(tid)
                    if new is None:
                        rejected = True
                        break
                    ids.append(tid)
                    text += dec.accept(tid, new)
                    if want_lp and k < len(d.logprobs):
                        lps.append(d.logprobs[k])
                    if g.is_done(dec.state):
                        break
                cut = dec.stop_hit()
                if cut is not None:
                    keep = len(text) - (len(dec.text) - cut)
                    yield dec.delta(ids, text[: max(0, keep)], lps, "stop")
                    return
                if ids:
                    yield dec.delta(ids, text, lps)
                if rejected or g.is_done(dec.state) or d.finished:
                    break
        finally:
            await stream.aclose()
        if not rejected:
            continue
        row = await dec.distribution()
        choice = dec.choose(row)
        if choice is None:  # nothing valid at all (cannot happen with a byte-level vocabulary): close
            tid = dec.vocab.char_token(close[0])
            new = g.step(dec.state, close[0])
            if tid is None or new is None:
                yield dec.delta([], "", [], "length")
                return
            choice = (tid, new)
        tid, new = choice
        piece = dec.accept(tid, new)
        cut = dec.stop_hit()
        if cut is not None:
            keep = len(piece) - (len(dec.text) - cut)
            yield dec.delta([tid], piece[: max(0, keep)], [dec.logprob_entry(row, tid)] if want_lp else [], "stop")
            return
        yield dec.delta([tid], piece, [dec.logprob_entry(row, tid)] if want_lp else [])

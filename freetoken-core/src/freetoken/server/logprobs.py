"""Engine log-probabilities in the two OpenAI shapes (chat and legacy completions)."""

from __future__ import annotations

import math
from typing import Any, Optional

from freetoken.engine.outputs import TokenLogprob


class TokenText:
    """Token id -> its text (special tokens included), cached per request."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI reports impossible tokens as a very negative number.
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: list[TokenLogprob], text_of: TokenText, top_n: int) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries."""
    out: list[dict[str, Any]] = []
    for entry in entries:
        token = text_of(entry.token_id)
        out.append({
            "token": token,
            "logprob": _finite(entry.logprob),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": text_of(tid), "logprob": _finite(lp), "bytes": list(text_of(tid).encode("utf-8"))}
                for tid, lp in entry.top[:top_n]
            ],
        })
    return out


class CompletionLogprobBuilder:
    """Accumulates the legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` object."""

    def __init__(self, text_of: TokenText, top_n: int, offset: int = 0) -> None:
        self.text_of = text_of
        self.top_n = top_n
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []

    def add_prompt(self, token_ids: list[int]) -> None:
        """Echoed prompt tokens: the engine does not score prompts, so their logprobs are null."""
        for tid in token_ids:
            self._append(tid, None, None)

    def add(self, entries: list[TokenLogprob]) -> None:
        for entry in entries:
            top: dict[str, float] = {}
            for tid, lp in entry.top[: self.top_n]:
                top.setdefault(self.text_of(tid), _finite(lp))
            self._append(entry.token_id, _finite(entry.logprob), top)

    def _append(self, token_id: int, logprob: Optional[float], top: Optional[dict[str, float]]) -> None:
        token = self.text_of(token_id)
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def take(self) -> dict[str, Any]:
        """The entries so far (then cleared: used per streamed chunk and once at the end)."""
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out

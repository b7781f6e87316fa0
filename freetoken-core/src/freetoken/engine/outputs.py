"""What the engine hands back per request: streamed deltas and final results."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives if asked."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RequestError:
    """Why a request finished with "error": ``code`` for programs ("out_of_memory"),
    ``message`` for people (what happened and what to change)."""

    code: str
    message: str


@dataclasses.dataclass
class StreamDelta:
    """One step's new output for one request (what the async stream yields).

    ``text`` is the newly *finalised* text (held back while it may still be the
    prefix of a stop string or an incomplete UTF-8 sequence). ``finish_reason`` is
    set on the last delta: "stop" (EOS, stop string or stop token), "length"
    (max_tokens or context), "abort" (cancelled) or "error" (``error`` says why, where the
    engine knows). ``cached_tokens``: prompt tokens whose K/V came from the prefix cache
    instead of being computed.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[RequestError] = None


@dataclasses.dataclass
class RequestOutput:
    """The whole result of one finished request (what ``LLM.generate`` returns)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    error: Optional[RequestError] = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

"""Per-request sampling parameters (shared by the engine, the CLI and the server)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "up to the context".
    ``stop`` strings are cut from the returned text; ``stop_token_ids`` end the
    request (the token is not included in the text). ``logprobs`` asks for the
    chosen token's log-probability, ``top_logprobs`` for that many alternatives.
    ``logit_bias`` maps token ids to values added to their logits after the penalties
    (as OpenAI's: -100 all but bans a token, +100 all but forces it).
    """

    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias of token {token} must be a finite number, got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

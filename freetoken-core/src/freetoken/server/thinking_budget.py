"""Anthropic's ``thinking.budget_tokens``: a reasoning model's reasoning ends after that many
tokens of it.

:class:`ThinkingBudget` is a token constraint (:mod:`freetoken.engine.constraints`) that
follows the answer token by token in the reasoning markup of :mod:`freetoken.server.reasoning`
and counts the tokens of reasoning. While fewer than the budget have been written it
restricts nothing, so the request is sampled as an unconstrained one (on the device, with the
next step launched ahead). Once the budget is spent inside the reasoning, the tokens that
close it are the only ones allowed, one at a time:

* think tags: ``</think>``; the model then writes its answer (a later ``<think>`` is closed
  at once);
* harmony: ``<|end|><|start|>assistant<|channel|>final<|message|>``: the analysis message
  ends and a final one begins. A later message's channel cannot start with ``analysis``
  (its first token is not allowed right after ``<|channel|>``), so a spent budget is not
  reopened; tool calls (``commentary`` messages to a recipient) stay possible.

The budget counts the reasoning's own tokens (the opening tag and the closing markup are
not counted), across every reasoning message of the answer; where the prompt leaves the
model inside the reasoning (a template that opens ``<think>``, a prefilled answer that stops
in an analysis message), from the answer's first token.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from freetoken.server.reasoning import (ANALYSIS, CALL, CHANNEL, END, MESSAGE, START, THINK_CLOSE, THINK_OPEN,
                                        starts_in_reasoning, style_for)


def thinking_budget(tokenizer: Any, prompt_ids: list[int], budget: int) -> Optional["ThinkingBudget"]:
    """A fresh budget for one answer to ``prompt_ids``; None where the vocabulary has no
    reasoning markup (nothing to end)."""
    style = style_for(tokenizer)
    if style is None:
        return None
    return ThinkingBudget(tokenizer, style, prompt_ids, budget)


class ThinkingBudget:
    """The constraint of one answer (see the module's doc)."""

    def __init__(self, tokenizer: Any, style: str, prompt_ids: list[int], budget: int) -> None:
        if budget < 1:
            raise ValueError(f"a thinking budget must be at least 1 token, got {budget}")
        self.budget = budget
        self.style = style
        self.spent = 0  # reasoning tokens written
        self._forced: list[int] = []  # the closing tokens still to come
        self._tok = tokenizer
        ids = tokenizer.token_to_id
        if style == "think":
            self._open, self._close = ids(THINK_OPEN), ids(THINK_CLOSE)
            self._in_reasoning = starts_in_reasoning(tokenizer, prompt_ids)
        else:
            self._start, self._channel, self._message = ids(START), ids(CHANNEL), ids(MESSAGE)
            self._ends = {ids(END), ids(CALL)}
            if None in (self._start, self._channel, self._message, *self._ends):
                raise ValueError(f"the vocabulary lacks harmony's markup ({START}, {CHANNEL}, {MESSAGE}, {END}, "
                                 f"{CALL})")
            self._closing = ([ids(END), self._start] + tokenizer.encode("assistant") + [self._channel]
                             + tokenizer.encode("final") + [self._message])  # fmt: skip
            self._analysis_first = tokenizer.encode(ANALYSIS)[0]
            self._in_reasoning = False
            self._header: Optional[list[int]] = None  # a message header's tokens, up to <|message|>
            self._channel_ids: Optional[list[int]] = None  # its tokens after <|channel|>
            # the prompt's last message (the generation prompt's header, or a prefilled answer
            # that may stop inside an analysis message): where the answer starts
            last = max((i for i, t in enumerate(prompt_ids) if t == self._start), default=len(prompt_ids))
            for t in prompt_ids[last:]:
                self._harmony(t)
            self.spent = 0  # the budget counts the answer's own reasoning

    # ---------------------------------------------------------------- the constraint

    def restricts(self) -> bool:
        return bool(self._forced) or self._banned() is not None

    def allows(self, token_id: int, remaining: int) -> bool:
        if self._forced:
            return token_id == self._forced[0]
        return token_id != self._banned()

    def allowed_mask(self, vocab_size: int, remaining: int) -> Optional[torch.Tensor]:
        if self._forced:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self._forced[0]] = True
            return mask
        banned = self._banned()
        if banned is None:
            return None
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[banned] = False
        return mask

    def fallback_token(self, remaining: int) -> Optional[int]:
        return self._forced[0] if self._forced else None

    def is_complete(self) -> bool:
        return False

    def advance(self, token_id: int) -> None:
        if self._forced:
            self._forced.pop(0)
        if self.style == "think":
            self._think(token_id)
        else:
            self._harmony(token_id)
        if self._in_reasoning and self.spent >= self.budget and not self._forced:
            self._forced = [self._close] if self.style == "think" else list(self._closing)
            self._in_reasoning = False  # what is forced now closes it

    # ---------------------------------------------------------------- the markup

    def _banned(self) -> Optional[int]:
        """harmony, the budget spent, right after a ``<|channel|>``: the first token of
        ``analysis``."""
        if self.style == "harmony" and self.spent >= self.budget and self._channel_ids == []:
            return self._analysis_first
        return None

    def _think(self, t: int) -> None:
        if self._in_reasoning:
            if t == self._close:
                self._in_reasoning = False
            else:
                self.spent += 1
        elif t == self._open:  # a spent budget closes a second reasoning at once
            self._in_reasoning = True

    def _harmony(self, t: int) -> None:
        if self._header is not None:  # in a header
            if t == self._message:
                header = self._tok.decode(self._header, skip_special_tokens=False)
                words = self._tok.decode(self._channel_ids or []).split()
                self._in_reasoning = words[:1] == [ANALYSIS] and "to=" not in header
                self._header = self._channel_ids = None
            elif t == self._channel:
                self._header.append(t)
                self._channel_ids = []
            else:
                self._header.append(t)
                if self._channel_ids is not None:
                    self._channel_ids.append(t)
        elif t in (self._start, self._channel):
            self._in_reasoning = False
            self._header = [t]
            self._channel_ids = [] if t == self._channel else None
        elif t in self._ends:
            self._in_reasoning = False
        elif self._in_reasoning:
            self.spent += 1

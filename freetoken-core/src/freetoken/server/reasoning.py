"""A reasoning model's reasoning apart from its answer (``reasoning_content`` in chat
completions, ``thinking`` blocks in Anthropic messages).

Two markups, chosen from the vocabulary (:func:`style_for`):

* think tags (Qwen3, Qwen3.5, DeepSeek-R1 and V3.1, GLM-4.5, Kimi-K2-Thinking): the
  reasoning is between ``<think>`` and ``</think>`` at the start of the answer. A chat
  template that ends the generation prompt with ``<think>`` has the model start inside
  the reasoning, so the split starts there too (:func:`starts_in_reasoning`).
* harmony (GPT-OSS): the answer is a series of messages, each ``<|channel|>CHANNEL
  [header]<|message|>BODY``, a later one after ``<|start|>assistant``. The ``analysis``
  channel is reasoning; the others (``final``, ``commentary``) are the answer. A message
  with a recipient (``to=...``: a tool call) stays in the answer in the form GPT-OSS's
  chat template writes calls back, ``<|start|>assistant to=RECIPIENT<|channel|>CHANNEL
  TYPE<|message|>ARGUMENTS<|call|>`` (whether the model put the recipient before or after
  the channel), which :class:`freetoken.server.tool_call_formats.HarmonyFormat` reads.
  Text before any channel is answer.

:class:`ReasoningSplit` reads the generated text piece by piece (the streamed deltas) and
returns ``(kind, text)`` pieces, ``kind`` :data:`REASONING` or :data:`ANSWER`; markup is
held back until it is complete, so no piece of a tag reaches either side. Whitespace
between the reasoning and the answer is dropped.
"""

from __future__ import annotations

import re
from typing import Any, Optional

REASONING = "reasoning"
ANSWER = "answer"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"
#: harmony's end of a message that another follows
END = "<|end|>"
#: harmony's channel of reasoning
ANALYSIS = "analysis"


def style_for(tokenizer: Any) -> Optional[str]:
    """``"harmony"``, ``"think"`` or None (no reasoning markup in the vocabulary)."""
    if getattr(tokenizer, "markup", None) and CHANNEL in tokenizer.markup.values():
        return "harmony"
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is not None and to_id(THINK_OPEN) is not None and to_id(THINK_CLOSE) is not None:
        return "think"
    return None


def starts_in_reasoning(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether a think-tags prompt leaves the model inside the reasoning: its last tag is a
    ``<think>`` (the template opened it)."""
    open_id, close_id = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
    for t in reversed(prompt_ids):
        if t == close_id:
            return False
        if t == open_id:
            return True
    return False


def split_for(tokenizer: Any, prompt_ids: list[int]) -> Optional["ReasoningSplit"]:
    """A new split of the answer to ``prompt_ids``; None where the vocabulary has no
    reasoning markup."""
    style = style_for(tokenizer)
    if style is None:
        return None
    return ReasoningSplit(style, style == "think" and starts_in_reasoning(tokenizer, prompt_ids))


_RECIPIENT = re.compile(r"to=([^\s<]+)")


def call_header(header: str) -> str:
    """A message header with a recipient (``<|start|>assistant to=R<|channel|>C <|constrain|>T``,
    or the recipient after the channel, or no ``<|start|>``) in the one form GPT-OSS's chat
    template writes: ``<|start|>assistant to=R<|channel|>C T<|message|>`` (T ``json`` when
    not given)."""
    recipient = _RECIPIENT.search(header)
    channel_part = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
    words = _RECIPIENT.sub("", channel_part).replace(CONSTRAIN, " ").split()
    channel = words[0] if words else "commentary"
    kind = words[1] if len(words) > 1 else "json"
    return f"{START}assistant to={recipient.group(1) if recipient else ''}{CHANNEL}{channel} {kind}{MESSAGE}"


def pieces(split: Optional["ReasoningSplit"], text: str, finished: bool) -> list[tuple[str, str]]:
    """The ``(kind, text)`` pieces of an answer's next ``text`` (``finished``: its last),
    through ``split``; without one (no reasoning markup) the text is all answer."""
    if split is None:
        return [(ANSWER, text)]
    return split.feed(text) + (split.finish() if finished else [])


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningSplit:
    """One answer's split, fed its text in pieces (:meth:`feed`, then :meth:`finish`)."""

    def __init__(self, style: str, in_reasoning: bool = False) -> None:
        if style not in ("think", "harmony"):
            raise ValueError(f"unknown reasoning markup {style!r}")
        self.style = style
        self._buf = ""
        # think: "start" (the answer's first non-space text may open the reasoning),
        # "reasoning", "answer"; harmony: "answer", "header", "body"
        self._state = "start"
        self._lead = False  # at the start of reasoning or of what follows it: leading whitespace dropped
        if style == "think" and in_reasoning:
            self._state, self._lead = "reasoning", True
        elif style == "harmony":
            self._state = "answer"
        self._header = ""  # harmony: the current message's header, up to <|message|>
        self._kind = ANSWER  # harmony: where the current message's body goes
        self._raw = False  # harmony: the body stays in the answer with its markup (a tool call)
        self._space = ""  # reasoning's trailing whitespace, held until more reasoning follows

    def whole(self, text: str) -> tuple[str, str]:
        """``(reasoning, answer)`` of a whole text (a fresh split's only call)."""
        parts = self.feed(text) + self.finish()
        return ("".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == ANSWER))

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        if self.style == "think":
            self._think(out, final=False)
        else:
            self._harmony(out, final=False)
        return _merged(out)

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.style == "think":
            self._think(out, final=True)
        else:
            self._harmony(out, final=True)
            self._end_call(out)
        return _merged(out)

    # ------------------------------------------------------------------ think tags

    def _think(self, out: list[tuple[str, str]], final: bool) -> None:
        while self._buf:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self._state, self._lead = "reasoning", True
                    continue
                if not final and (not stripped or THINK_OPEN.startswith(stripped)):
                    return  # may still become <think>
                self._state = "answer"
            if self._state == "answer":
                self._emit(out, ANSWER, self._buf)
                self._buf = ""
                return
            # reasoning
            end = self._buf.find(THINK_CLOSE)
            if end >= 0:
                self._emit(out, REASONING, self._buf[:end], closing=True)
                self._buf = self._buf[end + len(THINK_CLOSE):]
                self._state, self._lead, self._space = "answer", True, ""
                continue
            keep = 0 if final else _partial_suffix(self._buf, (THINK_CLOSE,))
            self._emit(out, REASONING, self._buf[: len(self._buf) - keep], closing=final)
            self._buf = self._buf[len(self._buf) - keep:]
            return

    # ------------------------------------------------------------------ harmony

    def _harmony(self, out: list[tuple[str, str]], final: bool) -> None:
        while self._buf:
            if self._state == "header":
                end = self._buf.find(MESSAGE)
                if end < 0:
                    if final:  # a header the generation stopped in: nothing of an answer
                        self._buf = ""
                    return
                self._header += self._buf[:end]
                self._buf = self._buf[end + len(MESSAGE):]
                self._open_body(out)
                continue
            marks = [i for i in (self._buf.find(START), self._buf.find(CHANNEL)) if i >= 0]
            at = min(marks) if marks else -1
            if at < 0:
                keep = 0 if final else _partial_suffix(self._buf, (START, CHANNEL))
                self._body(out, self._buf[: len(self._buf) - keep], final)
                self._buf = self._buf[len(self._buf) - keep:]
                return
            self._body(out, self._buf[:at], True)
            self._end_call(out)
            mark = START if self._buf.startswith(START, at) else CHANNEL  # <|start|>: the role, then the channel
            self._buf = self._buf[at + len(mark):]
            self._header, self._state = mark, "header"

    def _open_body(self, out: list[tuple[str, str]]) -> None:
        header, self._header = self._header, ""
        words = header.split(CHANNEL, 1)[1].split() if CHANNEL in header else []
        self._raw = "to=" in header  # a message to a recipient (a tool call)
        self._kind = REASONING if words[:1] == [ANALYSIS] and not self._raw else ANSWER
        self._state, self._lead, self._space = "body", not self._raw, ""
        if self._raw:
            self._emit(out, ANSWER, call_header(header))

    def _end_call(self, out: list[tuple[str, str]]) -> None:
        """The end of a message to a recipient (the generation stopped at its ``<|call|>``,
        or another message follows)."""
        if self._raw and self._state == "body":
            self._emit(out, ANSWER, CALL)
            self._raw = False

    def _body(self, out: list[tuple[str, str]], text: str, closing: bool) -> None:
        if self._state == "answer" or self._kind == ANSWER:
            self._emit(out, ANSWER, text)
        else:
            self._emit(out, REASONING, text, closing=closing)

    # ------------------------------------------------------------------ output

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str, closing: bool = False) -> None:
        """``text`` to ``kind``'s side: a side's leading whitespace dropped; reasoning's
        trailing whitespace held until more reasoning follows (dropped where it ends)."""
        if kind == REASONING:
            if self._lead:
                text = text.lstrip()
            text = self._space + text
            body = text.rstrip()
            self._space = "" if closing else text[len(body):]
            text = body
        elif self._lead and not self._raw:
            text = text.lstrip()
        if text:
            self._lead = False
            out.append((kind, text))


def _merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out

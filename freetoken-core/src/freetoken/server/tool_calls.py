"""Tool calls in generated text: finding them, streaming or not.

A model announces a function call in its own markup. :class:`ToolCallFormat` describes
one markup (how a call starts and ends, how its body names the function and its
arguments, and what text a constrained call is made of); :class:`HermesFormat` is
the one Qwen2.5/Qwen3 and the Hermes models use::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` reads generated text incrementally (the server feeds it each
streamed delta) and turns it into events: content text, and complete calls. Text that
may be the start of a call tag is held back until it is known not to be one, so call
markup never reaches the content. A call is reported once its closing tag arrives (or
at the end of the text, for a last call whose closing tag is missing), so its
arguments are always complete JSON. A call whose body does not parse, or names a
function that was not offered, is not a call: its text, tags included, is content.
Whitespace between the content and a call (and between calls) is dropped; other
text before, between and after calls is content.

:func:`parse_tool_calls` is the same parser over a whole text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Optional, Union


@dataclasses.dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object, as a string."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class CallStart:
    """Streaming: a call's name is known; its arguments follow as :class:`CallArguments`."""

    call: ToolCall  # arguments still ""


@dataclasses.dataclass
class CallArguments:
    """Streaming: the next piece of the open call's arguments, as the model wrote it."""

    text: str


@dataclasses.dataclass
class CallEnd:
    """Streaming: the open call is over."""


#: a parser event: content text, a complete call, or (incremental parsing) a call in pieces
Event = Union[str, ToolCall, CallStart, CallArguments, CallEnd]


class ToolCallFormat:
    """One model family's call markup."""

    name = ""
    start_tag = ""
    end_tag = ""

    def parse_body(self, body: str) -> Optional[tuple[str, str]]:
        """(function name, arguments as a JSON string) of the text between the tags, or None."""
        raise NotImplementedError

    def constrained_call(self, name: str) -> tuple[str, str]:
        """(text before, text after) the arguments object of a call to ``name``, as the
        model writes it: a constrained call is ``before + {json object} + after``."""
        raise NotImplementedError

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        """(function name, offset of the arguments object's ``{``) once the beginning of a
        call's body names the function and opens its arguments, else None (not yet, or a
        body that is not read incrementally)."""
        return None


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> Optional[tuple[str, str]]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return name, json.dumps(args, ensure_ascii=False)

    def constrained_call(self, name: str) -> tuple[str, str]:
        return f'{self.start_tag}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{self.end_tag}"

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        m = _HERMES_HEAD.match(body)
        if m is None:
            return None
        try:
            name = json.loads(m.group(1))
        except ValueError:
            return None
        return (name, m.end()) if isinstance(name, str) and name else None


#: the beginning of a Hermes call body up to the arguments object: ``{"name": "N", "arguments": {``
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(),)}


def format_for(tokenizer: Any) -> ToolCallFormat:
    """The call markup of the model behind ``tokenizer`` (read from its chat template;
    the Hermes format when the template does not say)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    for fmt in FORMATS.values():
        if fmt.start_tag and fmt.start_tag in template:
            return fmt
    return FORMATS["hermes"]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _ObjectEnd:
    """Finds where a JSON object ends, fed piece by piece (strings and escapes skipped)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the object (all of them until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Incremental parser: :meth:`feed` each piece of text, then :meth:`finish` once.

    With ``incremental``, a call whose body begins as the format expects
    (:meth:`ToolCallFormat.arguments_start`) and names an offered function is reported
    in pieces as the text arrives: :class:`CallStart` once the name is known, a
    :class:`CallArguments` with each new piece of the arguments object (up to its closing
    brace), :class:`CallEnd` at the closing tag (or at the end of the text). Such a call
    is not taken back if its body later turns out malformed (the pieces already went
    out); any other call is reported whole as without ``incremental``."""

    def __init__(self, fmt: ToolCallFormat, names: Optional[set[str]] = None, max_calls: Optional[int] = None,
                 incremental: bool = False) -> None:
        self.fmt = fmt
        self.names = names  # functions that were offered (None: any name)
        self.max_calls = max_calls  # calls beyond this many stay content
        self.incremental = incremental
        self.calls = 0
        self._pending = ""  # text not yet emitted (a possible tag start, or an open call's body)
        self._in_call = False
        self._held_ws = ""  # whitespace after the last emitted content
        self._after_call = False
        self._streamed: Optional[int] = None  # open incremental call: body characters consumed
        self._args: Optional[_ObjectEnd] = None

    def _content(self, text: str, out: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _full(self) -> bool:
        return self.max_calls is not None and self.calls >= self.max_calls

    def _call(self, body: str, closed: bool, out: list[Event]) -> None:
        parsed = self.fmt.parse_body(body)
        if parsed is None or self._full() or (self.names is not None and parsed[0] not in self.names):
            self._content(self.fmt.start_tag + body + (self.fmt.end_tag if closed else ""), out)
            return
        self._held_ws = ""
        self._after_call = True
        self.calls += 1
        out.append(ToolCall(parsed[0], parsed[1]))

    def _stream_body(self, body: str, out: list[Event]) -> None:
        """An open call's body so far: start the call, or pass on new argument text."""
        if self._streamed is None:
            head = self.fmt.arguments_start(body)
            if head is None or self._full() or (self.names is not None and head[0] not in self.names):
                return
            self._held_ws = ""
            self.calls += 1
            self._streamed = head[1]
            self._args = _ObjectEnd()
            out.append(CallStart(ToolCall(head[0], "")))
        assert self._args is not None
        if self._args.done:
            return
        new = body[self._streamed:]
        n = self._args.feed(new)
        if n:
            out.append(CallArguments(new[:n]))
        self._streamed += n

    def _end_streamed(self, out: list[Event]) -> None:
        self._streamed = None
        self._args = None
        self._after_call = True
        out.append(CallEnd())

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._pending += text
        while self._pending:
            if self._in_call:
                j = self._pending.find(self.fmt.end_tag)
                if self.incremental:
                    upto = j if j >= 0 else len(self._pending) - _partial_suffix(self._pending, self.fmt.end_tag)
                    self._stream_body(self._pending[:upto], out)
                    if self._streamed is not None:
                        if j < 0:
                            break
                        self._pending = self._pending[j + len(self.fmt.end_tag):]
                        self._in_call = False
                        self._end_streamed(out)
                        continue
                if j < 0:
                    break
                body = self._pending[:j]
                self._pending = self._pending[j + len(self.fmt.end_tag):]
                self._in_call = False
                self._call(body, True, out)
                continue
            i = self._pending.find(self.fmt.start_tag)
            if i >= 0:
                self._content(self._pending[:i], out)
                self._pending = self._pending[i + len(self.fmt.start_tag):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._pending, self.fmt.start_tag)
            self._content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_call and self._streamed is not None:
            self._stream_body(self._pending, out)
            self._end_streamed(out)
        elif self._in_call:
            self._call(self._pending, False, out)
        else:
            self._content(self._pending, out)
        self._pending = ""
        self._in_call = False
        if self._held_ws and not self.calls:
            out.append(self._held_ws)
        self._held_ws = ""
        return out


def parse_tool_calls(text: str, fmt: ToolCallFormat, names: Optional[set[str]] = None,
                     max_calls: Optional[int] = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generated text."""
    parser = ToolCallParser(fmt, names, max_calls)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]

"""Tool calls in generated text: finding them, streaming or not.

A model announces a function call in its own markup
(:mod:`freetoken.server.tool_call_formats`: how a call starts and ends, the section tags
around a group of calls, how its body names the function and its arguments).

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
import uuid
from typing import Any, Optional, Union

from freetoken.server.tool_call_formats import ToolCallFormat


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
                 incremental: bool = False, schemas: Optional[dict[str, Any]] = None) -> None:
        self.fmt = fmt
        self.names = names  # functions that were offered (None: any name)
        self.schemas = schemas  # their parameters schemas, for markups that leave types open
        self.max_calls = max_calls  # calls beyond this many stay content
        self.incremental = incremental
        self.calls = 0
        self._pending = ""  # text not yet emitted (a possible tag start, or an open call's body)
        self._in_call = False
        self._held_ws = ""  # whitespace after the last emitted content
        self._after_call = False
        self._streamed: Optional[int] = None  # open incremental call: body characters consumed
        self._args: Optional[_ObjectEnd] = None
        #: the tags looked for outside a call: a call's start, and the section tags (dropped)
        self._outer_tags = (fmt.start_tag, *fmt.section_tags)

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
        parsed = self.fmt.parse_body(body, self.schemas)
        if parsed is None or self._full() or (self.names is not None and parsed.name not in self.names):
            self._content(self.fmt.start_tag + body + (self.fmt.end_tag if closed else ""), out)
            return
        self._held_ws = ""
        self._after_call = True
        self.calls += 1
        out.append(ToolCall(parsed.name, parsed.arguments, parsed.call_id or new_call_id()))

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
            out.append(CallStart(ToolCall(head[0], "", self.fmt.call_id(body) or new_call_id())))
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
            found = [(i, tag) for tag in self._outer_tags if (i := self._pending.find(tag)) >= 0]
            if found:
                i, tag = min(found)
                self._content(self._pending[:i], out)
                self._pending = self._pending[i + len(tag):]
                self._in_call = tag == self.fmt.start_tag  # a section tag is dropped
                continue
            keep = max(_partial_suffix(self._pending, tag) for tag in self._outer_tags)
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
                     max_calls: Optional[int] = None, schemas: Optional[dict[str, Any]] = None,
                     ) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generated text."""
    parser = ToolCallParser(fmt, names, max_calls, schemas=schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]

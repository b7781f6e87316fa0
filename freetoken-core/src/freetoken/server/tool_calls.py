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


#: a parser event: content text, or a complete call
Event = Union[str, ToolCall]


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


class ToolCallParser:
    """Incremental parser: :meth:`feed` each piece of text, then :meth:`finish` once."""

    def __init__(self, fmt: ToolCallFormat, names: Optional[set[str]] = None, max_calls: Optional[int] = None) -> None:
        self.fmt = fmt
        self.names = names  # functions that were offered (None: any name)
        self.max_calls = max_calls  # calls beyond this many stay content
        self.calls = 0
        self._pending = ""  # text not yet emitted (a possible tag start, or an open call's body)
        self._in_call = False
        self._held_ws = ""  # whitespace after the last emitted content
        self._after_call = False

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

    def _call(self, body: str, closed: bool, out: list[Event]) -> None:
        parsed = self.fmt.parse_body(body)
        full = self.max_calls is not None and self.calls >= self.max_calls
        if parsed is None or full or (self.names is not None and parsed[0] not in self.names):
            self._content(self.fmt.start_tag + body + (self.fmt.end_tag if closed else ""), out)
            return
        self._held_ws = ""
        self._after_call = True
        self.calls += 1
        out.append(ToolCall(parsed[0], parsed[1]))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._pending += text
        while self._pending:
            if self._in_call:
                j = self._pending.find(self.fmt.end_tag)
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
        if self._in_call:
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

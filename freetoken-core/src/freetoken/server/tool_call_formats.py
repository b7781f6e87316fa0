"""The call markups models write tool calls in, one :class:`ToolCallFormat` each, and
:func:`format_for`, which finds a model's markup in its chat template.

* Hermes (Qwen2.5, Qwen3, Qwen3.5, Hermes)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* GLM-4.5/4.6: the function name, then each argument as a key and a value (strings as they
  are, other values as JSON)::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

* DeepSeek-V3.1 (and R1-0528-style templates without a fenced body), inside a calls section::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

  DeepSeek-V3/R1: ``function<｜tool▁sep｜>get_weather``, a newline and the arguments in a
  fenced ``json`` block.
* GPT-OSS (harmony): a message to the function, as its chat template writes calls back
  (:mod:`freetoken.server.reasoning` puts the model's own header in this form)::

      <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

  A call cannot be forced in this markup (its end is a control token that ends the turn).
* Kimi-K2: the call's id names the function (``functions.NAME:INDEX``), inside a calls section::

      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

A format names the tags that open and close one call and the section tags around a group of
calls (dropped from the content), parses a call's body, and gives the grammar of a call
forced by ``tool_choice`` (:meth:`ToolCallFormat.call_rules`: ``before + {arguments object} +
after``) where its arguments are one JSON object.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple, Optional

from freetoken.server.grammar_closing import CLOSING_ORDER, ClosingWalk


class ParsedCall(NamedTuple):
    """A call's function name, its arguments as a JSON object string, and the id the model
    wrote for it (None: it writes none)."""

    name: str
    arguments: str
    call_id: Optional[str] = None


class ToolCallFormat:
    """One model family's call markup."""

    name = ""
    start_tag = ""
    end_tag = ""
    #: tags around a group of calls: never content, never a call
    section_tags: tuple[str, ...] = ()
    #: text of a chat template that shows it uses this markup
    marker = ""
    #: how the closing walk of a forced call's grammar goes: the default JSON walk for
    #: markups whose arguments are one JSON object
    closing_walk = ClosingWalk()
    #: whether a call can be forced (``tool_choice`` required or a named function)
    forcible = True

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
        """The call of the text between the tags, or None (not a call); ``schemas`` (function
        name -> parameters schema) where the markup leaves argument types open."""
        raise NotImplementedError

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
        """(text before, text after) the arguments object of a call to ``name``, as the
        model writes it: a constrained call is ``before + {json object} + after``; None when
        the markup's arguments are no JSON object."""
        raise NotImplementedError

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        """(function name, offset of the arguments object's ``{``) once the beginning of a
        call's body names the function and opens its arguments, else None (not yet, or a
        body that is not read incrementally)."""
        return None

    def call_rules(self, rule: str, name: str, schema: Optional[dict[str, Any]],
                   schema_json: Callable[[Optional[dict[str, Any]]], str]) -> str:
        """Lark rules whose rule ``rule`` is one whole call to ``name`` in this markup, its
        arguments following the ``parameters`` ``schema`` (None: any object), which
        ``schema_json`` writes as a ``%json`` rule's body: by default ``before + %json +
        after`` of :meth:`constrained_call`."""
        ends = self.constrained_call(name)
        if ends is None:
            raise ValueError(f"the {self.name} markup has no constrained form")
        before, after = ends
        return f"{rule}: {json.dumps(before)} {rule}_args {json.dumps(after)}\n{rule}_args: %json {schema_json(schema)}\n"

    def call_id(self, body: str) -> Optional[str]:
        """The id the model wrote at the beginning of a call's body (None: it writes none)."""
        return None


def _json_object(text: str) -> Optional[str]:
    """``text`` as a compact JSON object string (a JSON string holding an object counts too), else None."""
    try:
        obj = json.loads(text)
        if isinstance(obj, str):
            obj = json.loads(obj)
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    marker = "<tool_call>"

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
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
        args_json = _json_object(args) if isinstance(args, str) else (
            json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None)
        return ParsedCall(name, args_json) if args_json is not None else None

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
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


class Glm45Format(ToolCallFormat):
    """GLM-4.5's ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``.
    The template writes strings as they are and other values as JSON, so a value is a string
    where the function's schema types the argument as one; otherwise, if it reads as JSON other
    than a string (a number, true, an object, ...) it is that value, else a string.

    A forced call (:meth:`call_rules`) writes the schema's properties in its order, the
    required ones always, each value as the template writes it: bare text without ``<``
    where the property is a string (one of its values where it has an enum), else JSON of
    its schema; a function without properties takes any keys with bare values. Bare text
    ends at ``<``, a byte the JSON closing walk would reach only after every character it
    may hold, so the walk tries ``/`` and ``<`` after the JSON closers and steps out of
    the text's loop."""

    name = "glm45"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    marker = "<arg_key>"
    closing_walk = ClosingWalk(order=b'"}]/<' + bytes(b for b in CLOSING_ORDER if b not in b'"}]/<'), skip_loops=True)
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
        head, sep, rest = body.partition("<arg_key>")
        name = head.strip()
        if not name or "<" in name or "\n" in name:
            return None
        rest = sep + rest
        props = ((schemas or {}).get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        pos = 0
        while pos < len(rest):
            m = self._PAIR.match(rest, pos)
            if m is None:
                break
            key, raw = m.group(1).strip(), m.group(2)
            if _typed_string(props.get(key)):
                args[key] = raw
            else:
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
                args[key] = raw if isinstance(value, str) else value
            pos = m.end()
        if rest[pos:].strip():
            return None
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
        return None

    def call_rules(self, rule: str, name: str, schema: Optional[dict[str, Any]],
                   schema_json: Callable[[Optional[dict[str, Any]]], str]) -> str:
        head = f"{rule}: {json.dumps(self.start_tag + name + chr(10))} "
        tail = f" {json.dumps(self.end_tag)}\n"
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not props:
            pair = '"<arg_key>" /[^<\\n]+/ "</arg_key>\\n<arg_value>" /[^<]*/ "</arg_value>\\n"'
            return head + f"({pair})*" + tail
        required = set(schema.get("required") or [])
        parts, values = [], []
        for i, (key, sub) in enumerate(props.items()):
            value = f"{rule}_v{i}"
            sub = sub if isinstance(sub, dict) else {}
            if _typed_string(sub) and isinstance(sub.get("enum"), list):
                values.append(f"{value}: " + " | ".join(json.dumps(str(v)) for v in sub["enum"]) + "\n")
            elif _typed_string(sub):
                values.append(f"{value}: /[^<]*/\n")
            else:
                values.append(f"{value}: %json {schema_json(sub)}\n")
            pair = (f"{json.dumps(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} {value} "
                    f"{json.dumps('</arg_value>' + chr(10))}")  # fmt: skip
            parts.append(pair if key in required else f"({pair})?")
        return head + " ".join(parts) + tail + "".join(values)


def _typed_string(schema: Any) -> bool:
    """Whether a property's schema allows strings only."""
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and [x for x in t if x != "null"] == ["string"])


class DeepSeekFormat(ToolCallFormat):
    """DeepSeek-V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, or with
    ``fenced`` DeepSeek-V3/R1's ``function<｜tool▁sep｜>NAME`` and a fenced json block; either
    is parsed, ``fenced`` decides what a forced call writes."""

    start_tag = "<｜tool▁call▁begin｜>"
    end_tag = "<｜tool▁call▁end｜>"
    section_tags = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    marker = "<｜tool▁call▁begin｜>"
    SEP = "<｜tool▁sep｜>"
    _FENCED = re.compile(r"function<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n(.*)\n```\s*$", re.S)

    def __init__(self, fenced: bool) -> None:
        self.fenced = fenced
        self.name = "deepseek-v3" if fenced else "deepseek-v3.1"

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
        m = self._FENCED.match(body.strip())
        if m is not None:
            args = _json_object(m.group(2))
            return ParsedCall(m.group(1).strip(), args) if args is not None else None
        name, sep, rest = body.partition(self.SEP)
        args = _json_object(rest) if sep else None
        if args is None or not name.strip() or name.strip() == "function":
            return None
        return ParsedCall(name.strip(), args)

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
        open_, close = self.section_tags
        if self.fenced:
            return (f"{open_}{self.start_tag}function{self.SEP}{name}\n```json\n",
                    f"\n```{self.end_tag}{close}")
        return f"{open_}{self.start_tag}{name}{self.SEP}", f"{self.end_tag}{close}"

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        if self.SEP not in body:
            return None
        name, _, rest = body.partition(self.SEP)
        offset = len(name) + len(self.SEP)
        if name.strip() == "function":
            line, nl, after = rest.partition("\n```json\n")
            if not nl or not after.lstrip().startswith("{"):
                return None
            name, offset = line, offset + len(line) + len(nl) + (len(after) - len(after.lstrip()))
        elif not rest.lstrip().startswith("{"):
            return None
        else:
            offset += len(rest) - len(rest.lstrip())
        return (name.strip(), offset) if name.strip() else None


class HarmonyFormat(ToolCallFormat):
    """GPT-OSS's ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>``."""

    name = "harmony"
    start_tag = "<|start|>assistant to=functions."
    end_tag = "<|call|>"
    marker = "<|start|>assistant to="
    forcible = False
    MESSAGE = "<|message|>"
    CHANNEL = "<|channel|>"

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
        start = self.arguments_start(body)
        if start is None:
            return None
        args = _json_object(body[start[1]:])
        return ParsedCall(start[0], args) if args is not None else None

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
        return None

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        head, sep, rest = body.partition(self.MESSAGE)
        name = head.partition(self.CHANNEL)[0].strip()
        if not sep or not name or not rest.lstrip().startswith("{"):
            return None
        return name, len(head) + len(sep) + len(rest) - len(rest.lstrip())


class KimiK2Format(ToolCallFormat):
    """Kimi-K2's ``<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{...}<|tool_call_end|>``;
    the call keeps the model's id (its template writes the ids of earlier calls back)."""

    name = "kimi-k2"
    start_tag = "<|tool_call_begin|>"
    end_tag = "<|tool_call_end|>"
    section_tags = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    marker = "<|tool_call_begin|>"
    ARGS = "<|tool_call_argument_begin|>"
    _ID = re.compile(r"\s*(?:functions\.)?([^\s:<]+):\d+\s*$")

    def _name(self, call_id: str) -> Optional[str]:
        m = self._ID.match(call_id)
        return m.group(1) if m else None

    def parse_body(self, body: str, schemas: Optional[dict[str, Any]] = None) -> Optional[ParsedCall]:
        call_id, sep, rest = body.partition(self.ARGS)
        name = self._name(call_id) if sep else None
        args = _json_object(rest) if name else None
        return ParsedCall(name, args, call_id.strip()) if name and args is not None else None

    def constrained_call(self, name: str) -> Optional[tuple[str, str]]:
        open_, close = self.section_tags
        return f"{open_}{self.start_tag}functions.{name}:0{self.ARGS}", f"{self.end_tag}{close}"

    def call_id(self, body: str) -> Optional[str]:
        call_id, sep, _ = body.partition(self.ARGS)
        return call_id.strip() if sep and self._name(call_id) else None

    def arguments_start(self, body: str) -> Optional[tuple[str, int]]:
        call_id, sep, rest = body.partition(self.ARGS)
        name = self._name(call_id) if sep else None
        if name is None or not rest.lstrip().startswith("{"):
            return None
        return name, len(call_id) + len(sep) + len(rest) - len(rest.lstrip())


#: the markups in the order :func:`format_for` tries their markers (GLM-4.5's template also
#: holds Hermes' ``<tool_call>``, so it goes first)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    Glm45Format(), DeepSeekFormat(fenced=True), DeepSeekFormat(fenced=False), KimiK2Format(), HarmonyFormat(),
    HermesFormat())}


def format_for(tokenizer: Any) -> ToolCallFormat:
    """The call markup of the model behind ``tokenizer``, read from its chat template (the
    Hermes format when the template shows none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if FORMATS["deepseek-v3"].marker in template:
        return FORMATS["deepseek-v3" if "```json" in template else "deepseek-v3.1"]
    for fmt in FORMATS.values():
        if fmt.marker and fmt.marker in template:
            return fmt
    return FORMATS["hermes"]

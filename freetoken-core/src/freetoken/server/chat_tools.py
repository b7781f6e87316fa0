"""Tools in /v1/chat/completions: what the template sees, what constrains decoding, and
how generated calls become ``message.tool_calls`` (whole) or ``delta.tool_calls`` (streamed).

``tool_choice``:

* ``auto`` (the default with tools): the tool definitions go to the chat template
  (``tools=``, as transformers passes them) and the output is parsed for calls
  (:mod:`freetoken.server.tool_calls`);
* ``required`` / ``{"type": "function", "function": {"name": ...}}``: the same, and
  each choice is constrained to one call to an offered / the named function, its
  arguments following the function's ``parameters`` schema
  (:mod:`freetoken.server.tool_constraint`);
* ``none``: the model is not to call tools, so the definitions are not rendered and
  the output is not parsed (all of it is content).

``parallel_tool_calls: false`` keeps at most one call: generation stops at the end of
the first call.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Callable, Optional

from freetoken.loading.tokenizer import REASONING_KEYS
from freetoken.server.errors import APIError
from freetoken.server.protocol import (
    CalledFunction,
    ChatCompletionRequest,
    ChatResponseMessage,
    NamedToolChoice,
    ResponseToolCall,
)
from freetoken.server.tool_calls import (
    CallArguments,
    CallStart,
    Event,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)
from freetoken.server.tool_call_formats import format_for
from freetoken.server.schema_constraint import SchemaError, grammar_vocab
from freetoken.server.schema_constraint import check_supported as check_schema_support
from freetoken.server.tool_constraint import call_grammar, tool_call_constraint


def _template_arguments(arguments: str) -> Any:
    """A call's arguments for the template: the object when they are a JSON object
    (templates such as Qwen3's write a dict with ``tojson``), else the string as given."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (transformers' layout)."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _template_arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        if m.role == "assistant":  # an earlier answer's reasoning, for templates that show it again
            msg.update({k: v for k, v in (m.model_extra or {}).items() if k in REASONING_KEYS and isinstance(v, str)})
        out.append(msg)
    return out


class ChatTools:
    """The tool handling of one chat request (only built when calls are to be parsed)."""

    def __init__(self, req: ChatCompletionRequest, tokenizer: Any) -> None:
        assert req.tools
        self.mode = req.tool_choice_mode()
        if not getattr(tokenizer, "template_renders_tools", False):
            raise APIError(400, "This model's chat template does not render tool definitions, so the model cannot "
                                "see the tools; send the request without tools (or with tool_choice 'none').",
                           param="tools", code="tools_not_supported")
        self.tokenizer = tokenizer
        self.definitions = [t.model_dump(mode="json", exclude_none=True) for t in req.tools]
        self.names = [t.function.name for t in req.tools]
        self.schemas = {t.function.name: t.function.parameters for t in req.tools}
        self.fmt = format_for(tokenizer)
        self.single = req.parallel_tool_calls is False
        self.grammar: Optional[str] = None  # the forced call's llguidance grammar (compile())
        choice = req.tool_choice
        self.forced: Optional[list[str]] = (
            [choice.function.name] if isinstance(choice, NamedToolChoice)
            else list(self.names) if self.mode == "required" else None
        )
        if self.forced is not None and not self.fmt.forcible:
            raise APIError(400, f"this model's tool-call format ({self.fmt.name}) cannot be forced: send tool_choice "
                                "'auto' (the model decides whether to call)", param="tool_choice",
                           code="unsupported_tool_choice")

    def stop_strings(self) -> list[str]:
        """Extra stop strings: the end of the first call when only one call is wanted."""
        return [self.fmt.end_tag] if self.single and self.forced is None else []

    def compile(self) -> None:
        """Compile the grammar of the forced call when the functions have parameter schemas
        (blocking: run off the event loop). A schema llguidance cannot enforce is a 400."""
        if self.forced is None:
            return
        try:
            self.grammar = call_grammar(self.fmt, {n: self.schemas[n] for n in self.forced})
            grammar_vocab(self.tokenizer)
        except SchemaError as exc:
            raise APIError(400, f"a function's parameters schema cannot be enforced: {exc}",
                           param="tools", code="unsupported_schema") from None

    def constraint(self) -> Optional[Callable[[], Any]]:
        """A factory of per-choice constraints when a call is forced, else None."""
        if self.forced is None:
            return None
        assert self.grammar is not None, "compile() first"
        return functools.partial(tool_call_constraint, self.tokenizer, self.grammar, self.fmt)

    async def checked_constraint(self) -> Optional[Callable[[], Any]]:
        """:meth:`constraint`, after checking that the tokenizer can run it and compiling
        the functions' schemas (:meth:`compile`); a 400 if either fails. Both block (the
        first check decodes the whole vocabulary), so they run off the event loop."""
        if self.forced is None:
            return None
        loop = asyncio.get_running_loop()
        problem = await loop.run_in_executor(None, check_schema_support, self.tokenizer)
        if problem:
            raise APIError(400, f"a forced tool call {problem}", param="tool_choice", code="unsupported_tool_choice")
        await loop.run_in_executor(None, self.compile)
        return self.constraint()

    def parser(self, incremental: bool = False) -> ToolCallParser:
        """A parser of this request's calls (``incremental``: calls in pieces, for streaming)."""
        return ToolCallParser(self.fmt, set(self.names), 1 if self.single else None, incremental, self.schemas)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        return parse_tool_calls(text, self.fmt, set(self.names), 1 if self.single else None, self.schemas)

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[ChatResponseMessage, Optional[str]]:
        """The whole answer: content and calls, and the finish reason to report."""
        content, calls = self.parse(text)
        if not calls:
            return ChatResponseMessage(content=content), finish_reason
        return (ChatResponseMessage(content=content or None, tool_calls=[response_call(c) for c in calls]),
                finish_reason_with_calls(finish_reason, True))


def response_call(call: ToolCall) -> ResponseToolCall:
    return ResponseToolCall(id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments))


def finish_reason_with_calls(finish_reason: Optional[str], called: bool) -> Optional[str]:
    """``tool_calls`` when the model stopped after making calls (a cut-off answer stays ``length``)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class StreamedCalls:
    """One choice's stream: text deltas in, ``delta`` objects out (content and tool_calls).

    A call goes out as it is generated: a first ``tool_calls`` delta with its index, id,
    type and name (``arguments: ""``), then one with each new piece of its arguments
    (``{"index": i, "function": {"arguments": piece}}``), as the official clients
    assemble them. A call the parser could only read whole comes as the first delta and
    one piece with all of its arguments."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.calls = 0

    def _start(self, call: ToolCall) -> dict[str, Any]:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}

    def _arguments(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]}

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        events: list[Event] = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, str):
                if out and "content" in out[-1]:
                    out[-1]["content"] += e
                else:
                    out.append({"content": e})
            elif isinstance(e, CallStart):
                out.append(self._start(e.call))
            elif isinstance(e, CallArguments):
                last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
                if last is not None and "id" not in last:  # pieces of one step go out together
                    last["function"]["arguments"] += e.text
                else:
                    out.append(self._arguments(e.text))
            elif isinstance(e, ToolCall):
                out.append(self._start(e))
                out.append(self._arguments(e.arguments))
        return out

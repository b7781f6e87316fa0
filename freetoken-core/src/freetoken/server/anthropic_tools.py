"""The Messages API on top of the chat-completions tool code: a request as the
:class:`~freetoken.server.protocol.ChatCompletionRequest` the chat template and
:mod:`freetoken.server.chat_tools` read, and an answer as Anthropic content blocks,
whole or streamed.

:func:`chat_request` maps

* ``tools`` (name, description, ``input_schema``) to function tools whose
  ``parameters`` are the input schema;
* ``tool_choice`` ``auto`` / ``any`` / ``{"type": "tool", "name": N}`` / ``none`` to
  ``auto`` / ``required`` / the named function / ``none``, and
  ``disable_parallel_tool_use: true`` to ``parallel_tool_calls: false``;
* an assistant message to one assistant message: its text blocks are the content,
  its ``tool_use`` blocks the ``tool_calls`` (``input`` as the JSON arguments), its
  ``thinking`` blocks the ``reasoning_content`` (``redacted_thinking`` dropped);
* a user message to, in the order of its blocks, a ``tool`` message per
  ``tool_result`` block (``tool_call_id`` = ``tool_use_id``, ``name`` = the tool
  used; the text of an ``is_error`` result is prefixed ``Error: ``) and a user message
  per run of text blocks;
* ``system`` to a first system message, and a final assistant message to the prefill
  text the answer continues;
* ``thinking`` to the template variable ``enable_thinking`` (false for ``disabled``).

So a conversation renders as the same conversation sent to /v1/chat/completions.
Calls in the answer come from the same parser (``<tool_call>`` markup and the like)
and become ``tool_use`` blocks after the text block; their ids are ``toolu_...``.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from freetoken.server.anthropic_protocol import ContentBlock, MessagesBase, TextBlock, ToolUseBlock
from freetoken.server.chat_tools import ChatTools
from freetoken.server.errors import json_dumps
from freetoken.server.protocol import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from freetoken.server.tool_calls import CallArguments, CallEnd, CallStart, Event, ToolCall, ToolCallParser

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(req: MessagesBase) -> tuple[ChatCompletionRequest, str]:
    """(the request in chat-completions form, the prefill text of a final assistant message)."""
    messages: list[ChatMessage] = []
    system = req.system_text()
    if system:
        messages.append(ChatMessage(role="system", content=system))
    tool_names: dict[str, str] = {}
    for m in req.messages:
        if m.role == "assistant":
            uses = m.blocks("tool_use")
            tool_names.update((str(b.id), str(b.name)) for b in uses)
            calls = [MessageToolCall(id=str(b.id), function=CalledFunction(
                name=str(b.name), arguments=json.dumps(b.input, ensure_ascii=False))) for b in uses]
            reasoning = "".join(b.thinking or "" for b in m.blocks("thinking"))
            extra = {"reasoning_content": reasoning} if reasoning else {}
            messages.append(ChatMessage(role="assistant", content=m.text(), tool_calls=calls or None, **extra))
        elif isinstance(m.content, str):
            messages.append(ChatMessage(role="user", content=m.content))
        else:
            messages.extend(_user_messages(m.content, tool_names))
    prefill = ""
    if messages[-1].role == "assistant":
        prefill = str(messages.pop().content)
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.input_schema)) for t in req.tools or []]
    choice: Union[str, NamedToolChoice, None] = None
    parallel: Optional[bool] = None
    if req.tool_choice is not None:
        if req.tool_choice.type == "tool":
            choice = NamedToolChoice(type="function", function=NamedFunction(name=str(req.tool_choice.name)))
        else:
            choice = _CHOICES[req.tool_choice.type]
        if req.tool_choice.disable_parallel_tool_use:
            parallel = False
    variables = None if req.thinking is None else {"enable_thinking": req.thinking.type != "disabled"}
    chat = ChatCompletionRequest.model_construct(model=req.model, messages=messages, tools=tools or None,
                                                 tool_choice=choice, parallel_tool_calls=parallel,
                                                 chat_template_kwargs=variables)
    return chat, prefill


def _user_messages(blocks: list[ContentBlock], tool_names: dict[str, str]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    text: list[str] = []
    for block in blocks:
        if block.type != "tool_result":
            text.append(block.text or "")
            continue
        if text:
            out.append(ChatMessage(role="user", content="".join(text)))
            text = []
        result = block.result_text()
        out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, name=tool_names.get(str(block.tool_use_id)),
                               content=f"Error: {result}" if block.is_error else result))
    if text or not out:
        out.append(ChatMessage(role="user", content="".join(text)))
    return out


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> ToolUseBlock:
    return ToolUseBlock(id=tool_use_id(call), name=call.name, input=json.loads(call.arguments))


def content_blocks(text: str, tools: Optional[ChatTools]) -> tuple[list[Union[TextBlock, ToolUseBlock]], bool]:
    """(the content blocks of a whole answer, whether it holds calls): the text block
    (left out when the answer is only calls), then a tool_use block per call."""
    if tools is None:
        return [TextBlock(text=text)], False
    content, calls = tools.parse(text)
    blocks: list[Union[TextBlock, ToolUseBlock]] = [TextBlock(text=content)] if content or not calls else []
    blocks += [tool_use_block(c) for c in calls]
    return blocks, bool(calls)


def sse_event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json_dumps({'type': kind, **payload})}\n\n"


class BlockEvents:
    """The content block events of one streamed answer, numbered in order: a thinking
    block takes the reasoning (:meth:`thinking`; its ``signature_delta`` is empty), a text
    block the text until a call comes; each call is a tool_use block of its own,
    streamed as it is generated (``content_block_start`` with the id, name and
    ``input: {}`` once the name is known, an ``input_json_delta`` with each new piece of
    the input's JSON, ``content_block_stop`` at the end of the call; a call the parser
    could only read whole has one ``input_json_delta`` with all of it). Without tools
    and without reasoning to show (``thinking`` false) the text block opens at once."""

    def __init__(self, parser: Optional[ToolCallParser], thinking: bool = False, thinking_text: bool = True) -> None:
        self.parser = parser
        self.index = -1
        self.text_open = False
        self.thinking_open = False
        self.shows_thinking = thinking
        self.thinking_text = thinking_text  # False: thinking blocks without their text (display "omitted")
        self.answer_blocks = 0  # text and tool_use blocks opened
        self.calls = 0

    def start(self) -> list[str]:
        """The events after ``message_start``."""
        opened = self._open_text() if self.parser is None and not self.shows_thinking else []
        return opened + [sse_event("ping", {})]

    def thinking(self, text: str) -> list[str]:
        """Reasoning: into the open thinking block, else a new one."""
        out: list[str] = []
        if not self.thinking_open:
            out += self._close_text()
            self.index += 1
            self.thinking_open = True
            out.append(sse_event("content_block_start", {
                "index": self.index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        if self.thinking_text:
            out.append(sse_event("content_block_delta", {
                "index": self.index, "delta": {"type": "thinking_delta", "thinking": text}}))
        return out

    def _close_thinking(self) -> list[str]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [sse_event("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta",
                                                                                 "signature": ""}}),
                sse_event("content_block_stop", {"index": self.index})]

    def _open_call(self, call: ToolCall) -> list[str]:
        out = self._close_thinking() + self._close_text()
        self.index += 1
        self.calls += 1
        self.answer_blocks += 1
        return out + [sse_event("content_block_start", {
            "index": self.index, "content_block": {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                                   "input": {}}})]

    def _input(self, partial_json: str) -> str:
        return sse_event("content_block_delta", {
            "index": self.index, "delta": {"type": "input_json_delta", "partial_json": partial_json}})

    def feed(self, text: str, finished: bool) -> list[str]:
        if self.parser is None:
            pieces: list[Event] = [text]
        else:
            pieces = list(self.parser.feed(text) if text else [])
            if finished:
                pieces += self.parser.finish()
        out: list[str] = []
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if not self.text_open:
                    out += self._open_text()
                out.append(sse_event("content_block_delta", {
                    "index": self.index, "delta": {"type": "text_delta", "text": piece}}))
            elif isinstance(piece, CallStart):
                out += self._open_call(piece.call)
            elif isinstance(piece, CallArguments):
                out.append(self._input(piece.text))
            elif isinstance(piece, CallEnd):
                out.append(sse_event("content_block_stop", {"index": self.index}))
            else:
                out += self._open_call(piece)
                out.append(self._input(piece.arguments))
                out.append(sse_event("content_block_stop", {"index": self.index}))
        return out

    def finish(self) -> list[str]:
        """Closes the open block (an answer without a text or tool_use block gets an empty text block)."""
        return self._close_thinking() + (self._open_text() if not self.answer_blocks else []) + self._close_text()

    def _open_text(self) -> list[str]:
        out = self._close_thinking()
        self.index += 1
        self.text_open = True
        self.answer_blocks += 1
        return out + [sse_event("content_block_start", {"index": self.index,
                                                        "content_block": {"type": "text", "text": ""}})]

    def _close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        return [sse_event("content_block_stop", {"index": self.index})]

"""Pydantic models of Anthropic's Messages API wire protocol, and its error bodies.

Requests are validated as strictly as the OpenAI ones (see protocol.py): a bad field
is a 400 naming it. Content blocks are ``text``, ``tool_use`` (assistant messages) and
``tool_result`` (user messages); the other types are recognised by their ``type`` and
refused with a message naming the block type. Tools are client tools (name,
description, ``input_schema``); :mod:`freetoken.server.anthropic_tools` turns a request
into the chat-completions form the chat template and the tool-call code read.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse

from freetoken.server.errors import APIError
from freetoken.server.protocol import FUNCTION_NAME_RE, MAX_STOP_SEQUENCES, FieldError

#: Paths whose errors have Anthropic's shape instead of OpenAI's.
PATH_PREFIX = "/v1/messages"

#: Content block types of the Messages API this server cannot take as input yet.
_UNSUPPORTED_BLOCKS = {
    "image": "not supported by this server (text only)",
    "document": "not supported by this server (text only)",
    "search_result": "not supported by this server (text only)",
    "server_tool_use": "not supported by this server (client tools only)",
    "web_search_tool_result": "not supported by this server (client tools only)",
}

#: Request fields of the Messages API that are refused when set.
_UNSUPPORTED_FIELDS = {"mcp_servers": "not supported by this server", "container": "not supported by this server"}

#: HTTP status -> Anthropic error ``type``.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "overloaded_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_body(error: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": ..., "message": ...}}`` for an APIError."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def response_for(path: str, error: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """The error in the shape the endpoint at ``path`` speaks."""
    return error_response(error, headers) if is_anthropic_path(path) else error.response(headers)


# ------------------------------------------------------------------ requests


class ContentBlock(BaseModel):
    """One content block: ``text`` (``text``), ``tool_use`` (``id``, ``name``, ``input``) or
    ``tool_result`` (``tool_use_id``, ``content``, ``is_error``); which fields a type
    needs, and where it may appear, is checked by :meth:`MessagesBase.check`."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list["ContentBlock"], None] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None

    def result_text(self) -> str:
        """A tool_result's content as one string (text blocks joined)."""
        if isinstance(self.content, list):
            return "".join(block.text or "" for block in self.content)
        return self.content or ""


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]

    def text(self) -> str:
        """The text blocks, joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text or "" for block in self.content if block.type == "text")

    def blocks(self, kind: str) -> list[ContentBlock]:
        return [] if isinstance(self.content, str) else [b for b in self.content if b.type == kind]


class ToolParam(BaseModel):
    """A client tool: the model is shown its name, description and input schema."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(pattern=FUNCTION_NAME_RE)
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None
    type: Optional[str] = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingParam(BaseModel):
    """Thinking: ``enabled`` (with a ``budget_tokens``, checked as Anthropic checks it; the
    reasoning ends after that many tokens), ``adaptive`` and ``between_tools`` show a
    reasoning model's reasoning as ``thinking`` blocks (``display: omitted``: the blocks
    without their text); ``disabled`` asks the chat template for an answer without reasoning
    (``enable_thinking`` false)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = None
    display: Optional[Literal["summarized", "omitted"]] = None


#: the smallest ``thinking.budget_tokens`` the Messages API takes
MIN_THINKING_BUDGET = 1024


class MessagesBase(BaseModel):
    """Fields shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: Optional[list[ToolParam]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingParam] = None

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    @property
    def omits_thinking_text(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    @property
    def thinking_budget(self) -> Optional[int]:
        """The reasoning's budget in tokens (thinking ``enabled``), else None."""
        return self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None

    def check(self) -> None:
        """Refuse what is recognised but not implemented, and what is inconsistent
        (called after validation)."""
        extra = self.model_extra or {}
        for name, why in _UNSUPPORTED_FIELDS.items():
            if extra.get(name) not in (None, [], {}):
                raise FieldError(name, f"'{name}' is {why}")
        if isinstance(self.system, list):
            _check_blocks(self.system, "system", ())
        self._check_tools()
        if self.thinking is not None and self.thinking.type == "enabled":
            budget = self.thinking.budget_tokens
            if budget is None:
                raise FieldError("thinking.budget_tokens", "thinking.budget_tokens: field required for type 'enabled'")
            if budget < MIN_THINKING_BUDGET:
                raise FieldError("thinking.budget_tokens",
                                 f"thinking.budget_tokens: must be at least {MIN_THINKING_BUDGET}, got {budget}")
        if self.shows_thinking and self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise FieldError("tool_choice", f"tool_choice '{self.tool_choice.type}' forces a tool call, which "
                                            "cannot follow a reasoning: use 'auto' or 'none' with thinking")
        if len(self.messages) == 1 and self.messages[0].role == "assistant" and not self.system_text():
            raise FieldError("messages", "messages: the only message is an assistant message, a prefill that "
                                         "answers nothing; put a user message (or a system prompt) before it")
        tool_use_ids: set[str] = set()
        last = len(self.messages) - 1
        for i, message in enumerate(self.messages):
            if isinstance(message.content, str):
                continue
            where = f"messages.{i}.content"
            _check_blocks(message.content, where, ("tool_use", "thinking", "redacted_thinking")
                          if message.role == "assistant" else ("tool_result",))
            for j, block in enumerate(message.content):
                if block.type == "tool_use":
                    if block.id in tool_use_ids:
                        raise FieldError(f"{where}.{j}.id", f"{where}.{j}.id: tool_use id {block.id!r} is used twice")
                    tool_use_ids.add(str(block.id))
                    if i == last:
                        raise FieldError(f"{where}.{j}", f"{where}.{j}: a final assistant message cannot hold "
                                                         "tool_use blocks; send their results in a user message")
                elif block.type == "tool_result" and block.tool_use_id not in tool_use_ids:
                    raise FieldError(f"{where}.{j}.tool_use_id",
                                     f"{where}.{j}.tool_use_id: {block.tool_use_id!r} answers no tool_use block "
                                     "of an earlier assistant message")

    def _check_tools(self) -> None:
        names = []
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise FieldError(f"tools.{i}.type", f"tools.{i}.type: '{tool.type}' tools are not supported by this "
                                                    "server (client tools with an input_schema only)")
            if tool.input_schema is None:
                raise FieldError(f"tools.{i}.input_schema", f"tools.{i}.input_schema: field required")
            if tool.input_schema.get("type") != "object":
                raise FieldError(f"tools.{i}.input_schema.type",
                                 f"tools.{i}.input_schema.type: must be 'object' (the input is a JSON object)")
            names.append(tool.name)
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools: tool names must be unique")
        choice = self.tool_choice
        if choice is None:
            return
        if choice.type != "none" and not names:
            raise FieldError("tool_choice", "tool_choice is only allowed when tools are given")
        if choice.type == "tool":
            if choice.name is None:
                raise FieldError("tool_choice.name", "tool_choice.name: field required for type 'tool'")
            if choice.name not in names:
                raise FieldError("tool_choice.name", f"tool_choice names tool {choice.name!r}, which is not in tools")
        elif choice.name is not None:
            raise FieldError("tool_choice.name", f"tool_choice.name is only allowed with type 'tool', "
                                                 f"not '{choice.type}'")

    def system_text(self) -> str:
        if self.system is None:
            return ""
        if isinstance(self.system, str):
            return self.system
        return "\n".join(block.text or "" for block in self.system)


#: fields each accepted block type requires
_REQUIRED = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
             "thinking": ("thinking",), "redacted_thinking": ("data",)}
#: block types allowed in assistant messages only
_ASSISTANT_BLOCKS = ("tool_use", "thinking", "redacted_thinking")


def _check_blocks(blocks: list[ContentBlock], where: str, tool_blocks: tuple[str, ...]) -> None:
    """Text blocks, plus the block types allowed here (``tool_use`` and thinking in
    assistant messages, ``tool_result`` in user messages)."""
    for j, block in enumerate(blocks):
        param = f"{where}.{j}"
        if block.type in ("text", *tool_blocks):
            for field in _REQUIRED[block.type]:
                if getattr(block, field) is None:
                    raise FieldError(f"{param}.{field}", f"{param}.{field}: field required")
            if block.type == "tool_use" and not block.id:
                raise FieldError(f"{param}.id", f"{param}.id: must not be empty")
            if block.type == "tool_result" and isinstance(block.content, list):
                _check_blocks(block.content, f"{param}.content", ())
            continue
        if block.type in (*_ASSISTANT_BLOCKS, "tool_result"):
            allowed = "assistant" if block.type in _ASSISTANT_BLOCKS else "user"
            raise FieldError(f"{param}.type", f"{param}: '{block.type}' blocks are only allowed in {allowed} messages")
        why = _UNSUPPORTED_BLOCKS.get(block.type)
        if why is None:
            raise FieldError(f"{param}.type", f"{param}: unknown content block type '{block.type}'")
        raise FieldError(f"{param}.type", f"{param}: '{block.type}' content blocks are {why}")


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    #: extension: keep generating past EOS (benchmarks, tests)
    ignore_eos: bool = False

    def check(self) -> None:
        super().check()
        if self.shows_thinking and self.thinking is not None and (self.thinking.budget_tokens or 0) >= self.max_tokens:
            raise FieldError("thinking.budget_tokens", f"thinking.budget_tokens ({self.thinking.budget_tokens}) must "
                                                       f"be less than max_tokens ({self.max_tokens})")

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is None:
            return None
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


class CountTokensRequest(MessagesBase):
    pass


# ------------------------------------------------------------------ responses


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    """A reasoning model's reasoning (requests with ``thinking`` enabled); the signature is
    empty: this server signs nothing, and takes thinking blocks back as they come."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    """``input_tokens`` are the prompt tokens computed for this request; with a prefix
    cache hit, ``cache_read_input_tokens`` are the ones taken from the cache (their sum
    is the rendered prompt's length, as in Anthropic's accounting)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> "Usage":
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[ThinkingBlock, TextBlock, ToolUseBlock]]
    stop_reason: Optional[StopReason] = None
    stop_sequence: Optional[str] = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int

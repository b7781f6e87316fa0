"""Pydantic models of Anthropic's Messages API wire protocol, and its error bodies.

Requests are validated as strictly as the OpenAI ones (see protocol.py): a bad field
is a 400 naming it. Content blocks other than ``text`` are recognised by their
``type`` and refused with a message naming the block type.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse

from freetoken.server.errors import APIError
from freetoken.server.protocol import MAX_STOP_SEQUENCES, FieldError

#: Paths whose errors have Anthropic's shape instead of OpenAI's.
PATH_PREFIX = "/v1/messages"

#: Content block types of the Messages API this server cannot take as input yet.
_UNSUPPORTED_BLOCKS = {
    "image": "not supported by this server (text only)",
    "document": "not supported by this server (text only)",
    "search_result": "not supported by this server (text only)",
    "tool_use": "not supported yet",
    "tool_result": "not supported yet",
    "server_tool_use": "not supported yet",
    "thinking": "not supported yet",
    "redacted_thinking": "not supported yet",
}

#: Request fields of the Messages API that are refused when set.
_UNSUPPORTED_FIELDS = {"tools": "not supported yet", "tool_choice": "not supported yet",
                       "mcp_servers": "not supported by this server", "container": "not supported by this server"}

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
    """One content block; only ``text`` blocks are accepted (see :meth:`MessagesBase.check`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text or "" for block in self.content)


class MessagesBase(BaseModel):
    """Fields shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None

    def check(self) -> None:
        """Refuse what is recognised but not implemented (called after validation)."""
        extra = self.model_extra or {}
        for name, why in _UNSUPPORTED_FIELDS.items():
            if extra.get(name) not in (None, [], {}):
                raise FieldError(name, f"'{name}' is {why}")
        if isinstance(self.system, list):
            _check_blocks(self.system, "system")
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                _check_blocks(message.content, f"messages.{i}.content")

    def system_text(self) -> str:
        if self.system is None:
            return ""
        if isinstance(self.system, str):
            return self.system
        return "\n".join(block.text or "" for block in self.system)


def _check_blocks(blocks: list[ContentBlock], where: str) -> None:
    for j, block in enumerate(blocks):
        param = f"{where}.{j}"
        if block.type == "text":
            if block.text is None:
                raise FieldError(f"{param}.text", f"{param}.text: field required")
            continue
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


StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock]
    stop_reason: Optional[StopReason] = None
    stop_sequence: Optional[str] = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int

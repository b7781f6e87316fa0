"""Pydantic models of the OpenAI-compatible wire protocol (requests and responses).

Requests validate value ranges here, so a bad field becomes a 400 with the field
named in ``param``. Unknown extra fields are accepted and ignored (the official
clients send a few, e.g. ``user``), except the ones listed in
:data:`UNSUPPORTED_FIELDS`, which are rejected so nobody believes they took effect.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from freetoken.loading.tokenizer import TEMPLATE_NAMES

#: Maximum number of choices per request (``n``) and per-token alternatives.
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
#: ``logit_bias``: at most this many tokens, each biased by a value in [-LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND]
MAX_LOGIT_BIAS_TOKENS = 1024
LOGIT_BIAS_BOUND = 100.0

#: Request fields we recognise but do not implement: sending them is a 400.
UNSUPPORTED_FIELDS = ("functions", "function_call", "suffix", "best_of", "audio")


class FieldError(ValueError):
    """A request that is well-formed but asks for something invalid or unsupported."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # strict: JSON numbers stay numbers ("0.5" is not a temperature), bools stay bools.
    model_config = ConfigDict(extra="allow", strict=True)

    def check(self) -> None:
        """Cross-field rules; raises FieldError (called after validation)."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            value = extra.get(name)
            if value is None or value == [] or value == {}:
                continue
            if name == "best_of" and value == 1:
                continue
            raise FieldError(name, f"'{name}' is not supported by this server")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


#: OpenAI's rule for function names
FUNCTION_NAME_RE = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME_RE)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str



class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=FUNCTION_NAME_RE)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation (as the API returned it)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Union[str, list[str], None]) -> Optional[list[str]]:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if not value:
            return None
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased, got {len(value)}")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
                raise ValueError(f"the bias of token {key} must be in [-{LOGIT_BIAS_BOUND:g}, "
                                 f"{LOGIT_BIAS_BOUND:g}], got {bias}")
        return value

    def check(self) -> None:
        super().check()
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with token-id keys."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    #: more variables for the chat template (e.g. ``{"enable_thinking": false}``)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    #: the template variable ``reasoning_effort`` (GPT-OSS's template reads it)
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None

    def template_variables(self) -> Optional[dict[str, Any]]:
        """The chat template's variables beyond the messages and tools: ``reasoning_effort``,
        then ``chat_template_kwargs`` (which win where both name one)."""
        out = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        out.update(self.chat_template_kwargs or {})
        return out or None

    def check(self) -> None:
        super().check()
        taken = sorted(set(self.chat_template_kwargs or {}) & set(TEMPLATE_NAMES))
        if taken:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs: {', '.join(taken)} are set by the "
                                                     "server (messages, tools and the generation prompt have fields "
                                                     "of their own)")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise FieldError("response_format.json_schema", "response_format json_schema needs a 'json_schema' "
                                                            "object with 'name' and 'schema'")
        self._check_tools()

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools: function names must be unique")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise FieldError("tool_choice", "tool_choice is only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {self.tool_choice.function.name!r}, "
                                            "which is not in tools")
        if self.tool_choice not in (None, "auto", "none") and self.response_format is not None \
                and self.response_format.type != "text":
            raise FieldError("response_format", f"response_format {self.response_format.type} cannot be combined "
                                                "with tool_choice 'required' or a named function")
        call_ids: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise FieldError(f"messages.{i}.tool_calls", "only assistant messages may carry tool_calls")
            for call in m.tool_calls or []:
                call_ids.add(call.id)
            if m.role == "tool":
                if not m.tool_call_id:
                    raise FieldError(f"messages.{i}.tool_call_id", "messages with role 'tool' need a tool_call_id")
                if m.tool_call_id not in call_ids:
                    raise FieldError(f"messages.{i}.tool_call_id",
                                     f"tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                                     "assistant message")

    def tool_choice_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (the default is ``auto`` with tools)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = Field(default=16, ge=1)
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: PromptType) -> PromptType:
        if isinstance(value, list) and len(value) == 0:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and value and isinstance(value[0], list):
            if any(len(ids) == 0 for ids in value):  # type: ignore[arg-type]
                raise ValueError("token-id prompts must not be empty")
        return value


# ----------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    #: a reasoning model's reasoning (freetoken.server.reasoning), apart from ``content``
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ResponseToolCall]] = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


def _now() -> int:
    return int(time.time())


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "freetoken"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (the OpenAI shape keeps explicit nulls)."""
    return model.model_dump(mode="json")

"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.server.chat_tools import ChatTools, StreamedCalls, finish_reason_with_calls, template_messages
from freetoken.server.errors import APIError, parse_body
from freetoken.server.faults import maybe_fail, step_fault
from freetoken.server.generation import (
    ChoiceJob,
    ChoiceResult,
    ChoiceStreams,
    ClientDisconnected,
    build_params,
    cached_prompt_tokens,
    choice_seed,
    collect,
    resolve_max_tokens,
    until_disconnect,
)
from freetoken.server.logprobs import TokenText, chat_logprobs
from freetoken.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    UsageInfo,
)
from freetoken.server.reasoning import REASONING, ReasoningSplit, pieces, split_for
from freetoken.server.schema_constraint import SchemaError, compile_schema, schema_constraint
from freetoken.server.schema_constraint import check_supported as check_schema_support
from freetoken.server.sse import DONE, event, sse_response
from freetoken.server.state import EngineHolder

CLIENT_CLOSED = 499


def render_prompt(req: ChatCompletionRequest, tokenizer: Any, tools: Optional[ChatTools] = None) -> list[int]:
    """Messages (and tool definitions) -> prompt token ids through the model's chat template."""
    if not getattr(tokenizer, "has_text", True):
        raise APIError(400, "This model has no text tokenizer; use /v1/completions with token-id prompts.",
                       param="messages", code="no_tokenizer")
    messages = template_messages(req)
    variables = req.template_variables()
    try:
        if tools is not None:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools.definitions,
                                                   variables=variables)
        else:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, variables=variables)
    except ValueError as exc:
        raise APIError(400, f"messages cannot be rendered with the model's chat template: {exc}",
                       param="messages", code="invalid_messages") from None
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def _compile_response_schema(tokenizer: Any, schema: Optional[dict[str, Any]], kind: str = "json_schema") -> str:
    """The grammar of a json_schema response format (blocking); 400 for what cannot be enforced.
    A format without ``schema`` accepts any JSON value; json_object is the schema
    ``{"type": "object"}``."""
    problem = check_schema_support(tokenizer)
    if problem:
        raise APIError(400, f"response_format {kind} {problem}", param="response_format",
                       code="unsupported_response_format")
    try:
        return compile_schema(tokenizer, schema if schema is not None else {})
    except SchemaError as exc:
        raise APIError(400, f"response_format json_schema: the schema cannot be enforced: {exc}",
                       param="response_format.json_schema.schema", code="unsupported_schema") from None


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    holder: EngineHolder = request.app.state.holder
    req = parse_body(ChatCompletionRequest, await request.body())
    engine = holder.require_engine()
    model = holder.check_model(req.model)
    json_mode = req.response_format is not None and req.response_format.type == "json_object"
    tools = ChatTools(req, engine.tokenizer) if req.tool_choice_mode() != "none" else None
    prompt_ids = render_prompt(req, engine.tokenizer, tools)
    max_tokens = resolve_max_tokens(req.requested_max_tokens(), len(prompt_ids), engine.max_model_len, "messages")
    top_n = req.top_logprobs or 0
    jobs = [
        ChoiceJob(i, prompt_ids, build_params(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=choice_seed(req.seed, i), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            stop=req.stop_list() + (tools.stop_strings() if tools else []), ignore_eos=req.ignore_eos,
            logprobs=req.logprobs, top_logprobs=top_n, logit_bias=req.logit_bias_ids(),
            vocab_size=getattr(engine.tokenizer, "vocab_size", None),
        ))
        for i in range(req.n)
    ]
    if json_mode or (req.response_format is not None and req.response_format.type == "json_schema"):
        # json_object: any JSON object; both through llguidance (the first compilation
        # reads the whole vocabulary: off the event loop)
        if json_mode:
            schema, kind = {"type": "object"}, "json_object"
        else:
            assert req.response_format.json_schema is not None  # checked by the request model
            schema, kind = req.response_format.json_schema.schema_, "json_schema"
        grammar = await asyncio.get_running_loop().run_in_executor(
            None, _compile_response_schema, engine.tokenizer, schema, kind)
        for job in jobs:
            job.constraint = functools.partial(schema_constraint, engine.tokenizer, grammar)
    forced = await tools.checked_constraint() if tools is not None else None
    if forced is not None:
        for job in jobs:
            job.constraint = forced
    maybe_fail(request, holder, "before")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = ChoiceStreams(engine, jobs, request_id, holder.metrics, arrival, holder.active,
                             fault=step_fault(request, holder))
    try:
        await until_disconnect(request.receive, streams.start())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    common = {"id": request_id, "model": model, "fingerprint": holder.system_fingerprint()}
    text_of = TokenText(engine.tokenizer)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        splits = {i: split_for(engine.tokenizer, prompt_ids) for i in range(req.n)}
        chunks = _stream(request, holder, streams, req, common, len(prompt_ids), text_of, include_usage, tools, splits)
        return sse_response(chunks, request_id)

    results = {i: ChoiceResult(i, len(prompt_ids)) for i in range(req.n)}
    try:
        await until_disconnect(request.receive, collect(streams, results))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for i in range(req.n):
        res = results[i]
        logprobs = ChatChoiceLogprobs(content=chat_logprobs(res.logprobs, text_of, top_n)) if req.logprobs else None
        split = split_for(engine.tokenizer, prompt_ids)
        reasoning, text = split.whole(res.text) if split is not None else ("", res.text)
        message, finish_reason = (tools.message(text, res.finish_reason) if tools
                                  else (ChatResponseMessage(content=text), res.finish_reason))
        message.reasoning_content = reasoning or None
        choices.append(ChatCompletionChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish_reason))
    completion_tokens = sum(len(r.token_ids) for r in results.values())
    response = ChatCompletionResponse(
        id=request_id, model=model, system_fingerprint=common["fingerprint"], choices=choices,
        usage=UsageInfo.of(len(prompt_ids), completion_tokens,
                           cached_prompt_tokens({i: r.cached_tokens for i, r in results.items()}, lambda i: 0)),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _choice_deltas(text: str, finished: bool, split: Optional[ReasoningSplit],
                   calls: Optional[StreamedCalls]) -> list[dict[str, Any]]:
    """A choice's ``delta`` objects for its next text: the reasoning as ``reasoning_content``,
    the answer as ``content`` and tool calls."""
    out: list[dict[str, Any]] = []
    for kind, piece in pieces(split, text, finished):
        if kind == REASONING:
            out.append({"reasoning_content": piece})
        elif calls is not None:
            out += calls.deltas(piece, False)
        elif piece:
            out.append({"content": piece})
    if finished and calls is not None:
        out += calls.deltas("", True)
    return out


async def _stream(request: Request, holder: EngineHolder, streams: ChoiceStreams, req: ChatCompletionRequest,
                  common: dict[str, Any], prompt_tokens: int, text_of: TokenText,
                  include_usage: bool, tools: Optional[ChatTools] = None,
                  splits: Optional[dict[int, Optional[ReasoningSplit]]] = None) -> AsyncIterator[str]:
    created = int(time.time())
    top_n = req.top_logprobs or 0

    def chunk(choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> str:
        payload: dict[str, Any] = {
            "id": common["id"], "object": "chat.completion.chunk", "created": created, "model": common["model"],
            "system_fingerprint": common["fingerprint"], "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage
        return event(payload)

    for i in range(req.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    calls = {i: StreamedCalls(tools.parser(incremental=True)) for i in range(req.n)} if tools else {}
    completion_tokens = 0
    cached: dict[int, int] = {}
    sent = 0
    async for index, delta in streams:
        completion_tokens += len(delta.token_ids)
        cached[index] = delta.cached_tokens
        deltas = _choice_deltas(delta.text, delta.finished, (splits or {}).get(index), calls.get(index))
        if req.logprobs and delta.logprobs and not any("content" in d for d in deltas):
            deltas.insert(0, {"content": ""})  # log-probabilities of held-back text ride on an empty content delta
        lp_pending = req.logprobs
        for d in deltas:
            logprobs = None
            if lp_pending and "content" in d:  # the step's log-probabilities go with its first content delta
                logprobs, lp_pending = {"content": chat_logprobs(delta.logprobs, text_of, top_n)}, False
            yield chunk([{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": None}])
            sent += 1
            if sent == 1:
                maybe_fail(request, holder, "stream")
        if delta.finished:
            if delta.finish_reason == "error":
                raise RuntimeError(f"engine reported an error for choice {index}")
            finish_reason = finish_reason_with_calls(delta.finish_reason, bool(tools) and calls[index].calls > 0)
            yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
    if include_usage:
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_prompt_tokens(cached, lambda i: 0))
        yield chunk([], usage.model_dump(mode="json"))
    yield DONE

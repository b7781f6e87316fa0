"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (text).

Messages are rendered with the model's chat template like /v1/chat/completions (the
system prompt first) and generated through the same engine streams (generation.py).
A final assistant message is a prefill: the answer continues its text. Errors on these
paths have Anthropic's shape (anthropic_protocol.response_for, used by the app's error
handlers and the middleware).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.server.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesBase,
    MessagesRequest,
    TextBlock,
    Usage,
    error_body,
)
from freetoken.server.chat import CLIENT_CLOSED, render_prompt
from freetoken.server.errors import APIError, json_dumps, parse_body
from freetoken.server.faults import maybe_fail
from freetoken.server.generation import (
    ChoiceJob,
    ChoiceResult,
    ChoiceStreams,
    ClientDisconnected,
    build_params,
    collect,
    resolve_max_tokens,
    until_disconnect,
)
from freetoken.server.protocol import ChatCompletionRequest, ChatMessage
from freetoken.server.sse import sse_response
from freetoken.server.state import EngineHolder


def render_messages(req: MessagesBase, tokenizer: Any) -> list[int]:
    """System prompt and messages -> prompt token ids through the model's chat template.
    A final assistant message is continued: its text follows the generation prompt."""
    messages = [ChatMessage(role=m.role, content=m.text()) for m in req.messages]
    prefill = ""
    if messages[-1].role == "assistant":
        prefill = str(messages.pop().content)
    system = req.system_text()
    if system:
        messages.insert(0, ChatMessage(role="system", content=system))
    chat = ChatCompletionRequest.model_construct(model=req.model, messages=messages)
    prompt = render_prompt(chat, tokenizer)
    if prefill:
        prompt += list(tokenizer.encode(prefill, add_special_tokens=False))
    return prompt


def stop_reason(result: ChoiceResult, stops: list[str], tokenizer: Any) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished choice. The engine reports a stop
    string and EOS alike as "stop" and cuts the stop string from the text, so the
    matched string is found in the decoded tokens: the earliest occurrence (first
    listed on a tie), as the engine matches."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if stops and result.token_ids:
        full = tokenizer.decode(result.token_ids)
        best: Optional[tuple[int, str]] = None
        for s in stops:
            i = full.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            return "stop_sequence", best[1]
    return "end_turn", None


def _cached(result: ChoiceResult) -> int:
    return int(getattr(result, "cached_tokens", 0) or 0)


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json_dumps({'type': kind, **payload})}\n\n"


def _error_events(error: APIError) -> list[str]:
    return [f"event: error\ndata: {json_dumps(error_body(error))}\n\n"]


async def create_message(request: Request) -> Response:
    arrival = time.monotonic()
    holder: EngineHolder = request.app.state.holder
    req = parse_body(MessagesRequest, await request.body())
    engine = holder.require_engine()
    model = holder.check_model(req.model)
    prompt_ids = render_messages(req, engine.tokenizer)
    max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), engine.max_model_len, "messages")
    stops = list(req.stop_sequences or [])
    params = build_params(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=0.0,
        seed=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, stop=stops,
        ignore_eos=req.ignore_eos, logprobs=False, top_logprobs=0,
    )
    maybe_fail(request, holder, "before")
    message_id = f"msg_{uuid.uuid4().hex}"
    streams = ChoiceStreams(engine, [ChoiceJob(0, prompt_ids, params)], message_id, holder.metrics, arrival,
                            holder.active)
    try:
        await until_disconnect(request.receive, streams.start())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    if req.stream:
        events = _stream(request, holder, streams, message_id, model, prompt_ids, stops, engine.tokenizer)
        return sse_response(events, message_id, error_events=_error_events)

    result = ChoiceResult(0, len(prompt_ids))
    try:
        await until_disconnect(request.receive, collect(streams, {0: result}))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    reason, sequence = stop_reason(result, stops, engine.tokenizer)
    response = MessageResponse(
        id=message_id, model=model, content=[TextBlock(text=result.text)], stop_reason=reason,
        stop_sequence=sequence, usage=Usage.of(len(prompt_ids), len(result.token_ids), _cached(result)),
    )
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(request: Request, holder: EngineHolder, streams: ChoiceStreams, message_id: str, model: str,
                  prompt_ids: list[int], stops: list[str], tokenizer: Any) -> AsyncIterator[str]:
    result = ChoiceResult(0, len(prompt_ids))
    started = False
    sent = 0
    async for _, delta in streams:
        result.add(delta)
        if not started:  # the first delta says how much of the prompt came from the cache
            started = True
            usage = Usage.of(len(prompt_ids), 0, _cached(result)).model_dump(mode="json")
            yield _event("message_start", {"message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage,
            }})
            yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield _event("ping", {})
        if delta.text:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta.text}})
            sent += 1
            if sent == 1:
                maybe_fail(request, holder, "stream")
        if delta.finished and delta.finish_reason == "error":
            raise RuntimeError("engine reported an error for the message")
    reason, sequence = stop_reason(result, stops, tokenizer)
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": len(result.token_ids)}})
    yield _event("message_stop", {})


async def count_tokens(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    req = parse_body(CountTokensRequest, await request.body())
    engine = holder.require_engine()
    holder.check_model(req.model)
    prompt_ids = render_messages(req, engine.tokenizer)
    return JSONResponse(CountTokensResponse(input_tokens=len(prompt_ids)).model_dump(mode="json"))

"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Messages are rendered with the model's chat template like /v1/chat/completions (the
system prompt first; tools, tool_use and tool_result blocks as function tools, tool
calls and tool messages: anthropic_tools.py) and generated through the same engine
streams (generation.py); ``any`` and a named tool force a call with the chat route's
constraint. ``thinking.budget_tokens`` ends a reasoning model's reasoning after that many
tokens (thinking_budget.py). A final assistant message is a prefill: the answer continues
its text.
Errors on these paths have Anthropic's shape (anthropic_protocol.response_for, used by
the app's error handlers and the middleware).
"""

from __future__ import annotations

import functools
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
    ThinkingBlock,
    Usage,
    error_body,
)
from freetoken.server.anthropic_tools import BlockEvents, chat_request, content_blocks, sse_event
from freetoken.server.chat import CLIENT_CLOSED, render_prompt
from freetoken.server.chat_tools import ChatTools, finish_reason_with_calls
from freetoken.server.errors import APIError, json_dumps, parse_body
from freetoken.server.faults import maybe_fail, step_fault
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
from freetoken.server.reasoning import REASONING, ReasoningSplit, pieces, split_for
from freetoken.server.sse import sse_response
from freetoken.server.state import EngineHolder
from freetoken.server.thinking_budget import thinking_budget


def render_messages(req: MessagesBase, tokenizer: Any) -> tuple[list[int], Optional[ChatTools]]:
    """(prompt token ids through the model's chat template, the request's tool handling:
    None without tools or with tool_choice none). A final assistant message is
    continued: its text follows the generation prompt."""
    chat, prefill = chat_request(req)
    tools = ChatTools(chat, tokenizer) if chat.tool_choice_mode() != "none" else None
    prompt = render_prompt(chat, tokenizer, tools)
    if prefill:
        prompt += list(tokenizer.encode(prefill, add_special_tokens=False))
    return prompt, tools


def stop_reason(result: ChoiceResult, stops: list[str], tokenizer: Any,
                called: bool = False) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished choice (``called``: the answer made
    tool calls). The engine reports a stop string and EOS alike as "stop" and cuts the
    stop string from the text, so the matched string is found in the decoded tokens:
    the earliest occurrence (first listed on a tie), as the engine matches."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if finish_reason_with_calls(result.finish_reason, called) == "tool_calls":
        return "tool_use", None
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


def _error_events(error: APIError) -> list[str]:
    return [f"event: error\ndata: {json_dumps(error_body(error))}\n\n"]


async def create_message(request: Request) -> Response:
    arrival = time.monotonic()
    holder: EngineHolder = request.app.state.holder
    req = parse_body(MessagesRequest, await request.body())
    engine = holder.require_engine()
    model = holder.check_model(req.model)
    prompt_ids, tools = render_messages(req, engine.tokenizer)
    max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), engine.max_model_len, "messages")
    stops = list(req.stop_sequences or [])
    params = build_params(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=0.0,
        seed=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
        stop=stops + (tools.stop_strings() if tools else []), ignore_eos=req.ignore_eos, logprobs=False,
        top_logprobs=0,
    )
    job = ChoiceJob(0, prompt_ids, params)
    if tools is not None:
        job.constraint = await tools.checked_constraint()
    budget = req.thinking_budget
    if budget is not None and job.constraint is None:  # (thinking_budget: None without reasoning markup)
        job.constraint = functools.partial(thinking_budget, engine.tokenizer, prompt_ids, budget)
    maybe_fail(request, holder, "before")
    message_id = f"msg_{uuid.uuid4().hex}"
    streams = ChoiceStreams(engine, [job], message_id, holder.metrics, arrival, holder.active,
                             fault=step_fault(request, holder))
    try:
        await until_disconnect(request.receive, streams.start())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    if req.stream:
        blocks = BlockEvents(tools.parser(incremental=True) if tools else None, req.shows_thinking,
                             not req.omits_thinking_text)
        events = _stream(request, holder, streams, message_id, model, prompt_ids, stops, engine.tokenizer, blocks)
        return sse_response(events, message_id, error_events=_error_events)

    result = ChoiceResult(0, len(prompt_ids))
    try:
        await until_disconnect(request.receive, collect(streams, {0: result}))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    split = split_for(engine.tokenizer, prompt_ids)
    reasoning, text = split.whole(result.text) if split is not None else ("", result.text)
    content, called = content_blocks(text, tools)
    if reasoning and req.shows_thinking:
        content.insert(0, ThinkingBlock(thinking="" if req.omits_thinking_text else reasoning))
    reason, sequence = stop_reason(result, stops, engine.tokenizer, called)
    response = MessageResponse(
        id=message_id, model=model, content=content, stop_reason=reason,
        stop_sequence=sequence, usage=Usage.of(len(prompt_ids), len(result.token_ids), _cached(result)),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _answer_events(blocks: BlockEvents, split: Optional[ReasoningSplit], text: str, finished: bool) -> list[str]:
    """The block events of the answer's next text: its reasoning as thinking blocks (where
    shown), the rest as text and tool_use blocks."""
    out: list[str] = []
    for kind, piece in pieces(split, text, finished):
        if kind == REASONING:
            out += blocks.thinking(piece) if blocks.shows_thinking else []
        else:
            out += blocks.feed(piece, False)
    return out + (blocks.feed("", True) if finished else [])


async def _stream(request: Request, holder: EngineHolder, streams: ChoiceStreams, message_id: str, model: str,
                  prompt_ids: list[int], stops: list[str], tokenizer: Any, blocks: BlockEvents) -> AsyncIterator[str]:
    result = ChoiceResult(0, len(prompt_ids))
    split = split_for(tokenizer, prompt_ids)
    started = False
    sent = 0
    async for _, delta in streams:
        result.add(delta)
        if not started:  # the first delta says how much of the prompt came from the cache
            started = True
            usage = Usage.of(len(prompt_ids), 0, _cached(result)).model_dump(mode="json")
            yield sse_event("message_start", {"message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage,
            }})
            for event in blocks.start():
                yield event
        for event in _answer_events(blocks, split, delta.text, delta.finished):
            yield event
            sent += 1
            if sent == 1:
                maybe_fail(request, holder, "stream")
        if delta.finished and delta.finish_reason == "error":
            raise RuntimeError("engine reported an error for the message")
    reason, sequence = stop_reason(result, stops, tokenizer, blocks.calls > 0)
    for event in blocks.finish():
        yield event
    yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"output_tokens": len(result.token_ids)}})
    yield sse_event("message_stop", {})


async def count_tokens(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    req = parse_body(CountTokensRequest, await request.body())
    engine = holder.require_engine()
    holder.check_model(req.model)
    prompt_ids, _ = render_messages(req, engine.tokenizer)
    return JSONResponse(CountTokensResponse(input_tokens=len(prompt_ids)).model_dump(mode="json"))

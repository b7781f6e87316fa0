"""POST /v1/completions (the legacy text-completion endpoint)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
from freetoken.server.logprobs import CompletionLogprobBuilder, TokenText
from freetoken.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, UsageInfo
from freetoken.server.sse import DONE, event, sse_response
from freetoken.server.state import EngineHolder

CLIENT_CLOSED = 499


@dataclasses.dataclass
class Prompt:
    text: Optional[str]  # None for token-id prompts
    ids: list[int]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Plain-text prompt -> ids (with the tokenizer's own special tokens, e.g. a BOS, if it adds any)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=True))
    except TypeError:
        return list(tokenizer.encode(text))


def normalize_prompts(req: CompletionRequest, tokenizer: Any) -> list[Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]
    else:
        items = list(raw)
    vocab = getattr(tokenizer, "vocab_size", None)
    prompts: list[Prompt] = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            if not getattr(tokenizer, "has_text", True):
                raise APIError(400, "This model has no text tokenizer; send the prompt as token ids.",
                               param="prompt", code="no_tokenizer")
            ids = encode_text(tokenizer, item)
            if not ids:
                raise APIError(400, f"prompt {k} is empty (it encodes to no tokens).", param="prompt",
                               code="empty_prompt")
            prompts.append(Prompt(item, ids))
        else:
            ids = list(item)
            bad = [t for t in ids if t < 0 or (isinstance(vocab, int) and t >= vocab)]
            if bad:
                raise APIError(400, f"prompt {k} has token ids outside the vocabulary (size {vocab}): {bad[:5]}",
                               param="prompt", code="invalid_token_id")
            prompts.append(Prompt(None, ids))
    return prompts


def _prompt_text(prompt: Prompt, tokenizer: Any) -> str:
    if prompt.text is not None:
        return prompt.text
    if not getattr(tokenizer, "has_text", True):
        return ""
    return str(tokenizer.decode(prompt.ids, skip_special_tokens=False))


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    holder: EngineHolder = request.app.state.holder
    req = parse_body(CompletionRequest, await request.body())
    engine = holder.require_engine()
    model = holder.check_model(req.model)
    tokenizer = engine.tokenizer
    prompts = normalize_prompts(req, tokenizer)
    top_n = req.logprobs or 0
    want_logprobs = req.logprobs is not None
    jobs: list[ChoiceJob] = []
    for p, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), engine.max_model_len, "prompt")
        for j in range(req.n):
            jobs.append(ChoiceJob(p * req.n + j, prompt.ids, build_params(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=choice_seed(req.seed, j), presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                stop=req.stop_list(), ignore_eos=req.ignore_eos, logprobs=want_logprobs, top_logprobs=top_n,
                logit_bias=req.logit_bias_ids(), vocab_size=getattr(tokenizer, "vocab_size", None),
            )))
    maybe_fail(request, holder, "before")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = ChoiceStreams(engine, jobs, request_id, holder.metrics, arrival, holder.active,
                             fault=step_fault(request, holder))
    try:
        await until_disconnect(request.receive, streams.start())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    text_of = TokenText(tokenizer)
    fingerprint = holder.system_fingerprint()
    prompt_of = {job.index: prompts[job.index // req.n] for job in jobs}
    prompt_tokens = sum(len(p.ids) for p in prompts)

    def builder(index: int) -> Optional[CompletionLogprobBuilder]:
        if not want_logprobs:
            return None
        b = CompletionLogprobBuilder(text_of, top_n)
        if req.echo:
            b.add_prompt(prompt_of[index].ids)
        return b

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _stream(request, holder, streams, req, model, request_id, fingerprint, prompt_of, prompt_tokens,
                         tokenizer, builder, include_usage, len(jobs))
        return sse_response(chunks, request_id)

    results = {job.index: ChoiceResult(job.index, len(job.prompt_ids)) for job in jobs}
    try:
        await until_disconnect(request.receive, collect(streams, results))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for index in sorted(results):
        res = results[index]
        prefix = _prompt_text(prompt_of[index], tokenizer) if req.echo else ""
        b = builder(index)
        logprobs = None
        if b is not None:
            b.add(res.logprobs)
            logprobs = CompletionLogprobs(**b.take())
        choices.append(CompletionChoice(index=index, text=prefix + res.text, logprobs=logprobs,
                                        finish_reason=res.finish_reason))
    completion_tokens = sum(len(r.token_ids) for r in results.values())
    response = CompletionResponse(
        id=request_id, model=model, system_fingerprint=fingerprint, choices=choices,
        usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_prompt_tokens(
            {i: r.cached_tokens for i, r in results.items()}, lambda i: i // req.n)),
    )
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(request: Request, holder: EngineHolder, streams: ChoiceStreams, req: CompletionRequest,
                  model: str, request_id: str, fingerprint: str, prompt_of: dict[int, Prompt], prompt_tokens: int,
                  tokenizer: Any, builder: Any, include_usage: bool, n_choices: int) -> AsyncIterator[str]:
    created = int(time.time())
    builders = {i: builder(i) for i in range(n_choices)}

    def chunk(choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> str:
        payload: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                   "model": model, "system_fingerprint": fingerprint, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return event(payload)

    if req.echo:
        for i in range(n_choices):
            b = builders[i]
            yield chunk([{"index": i, "text": _prompt_text(prompt_of[i], tokenizer),
                          "logprobs": b.take() if b is not None else None, "finish_reason": None}])
    completion_tokens = 0
    cached: dict[int, int] = {}
    sent = 0
    async for index, delta in streams:
        completion_tokens += len(delta.token_ids)
        cached[index] = delta.cached_tokens
        b = builders[index]
        if b is not None:
            b.add(delta.logprobs)
        if delta.text or (b is not None and b.tokens) or delta.finished:
            if delta.finished and delta.finish_reason == "error":
                raise RuntimeError(f"engine reported an error for choice {index}")
            yield chunk([{"index": index, "text": delta.text, "logprobs": b.take() if b is not None else None,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
            sent += 1
            if sent == 1:
                maybe_fail(request, holder, "stream")
    if include_usage:
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_prompt_tokens(cached, lambda i: i // req.n))
        yield chunk([], usage.model_dump(mode="json"))
    yield DONE

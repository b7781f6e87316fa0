"""The offline Python API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

from freetoken.engine.config import EngineConfig
from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.engine import LLMEngine
from freetoken.engine.outputs import RequestOutput
from freetoken.engine.request import Request
from freetoken.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]


class LLM:
    """Load a model and generate for batches of prompts (continuous batching).

    ``model`` is an HF directory or a ``.gguf`` file; ``None`` uses the built-in
    demo model. Other keyword arguments are :class:`EngineConfig` fields.
    """

    def __init__(self, model: Optional[str] = None, backend: Optional[str] = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, backend=backend, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Defaults from the checkpoint's generation_config.json (where present)."""
        gc = self.engine.loaded.generation_config or {}
        kw: dict[str, Any] = {}
        if gc.get("do_sample") is False:
            kw["temperature"] = 0.0
        elif "temperature" in gc:
            kw["temperature"] = float(gc["temperature"])
        for k in ("top_p", "top_k", "min_p", "repetition_penalty"):
            if k in gc and gc[k] is not None:
                kw[k] = type(getattr(SamplingParams(), k))(gc[k])
        return SamplingParams(**kw)

    def generate(self, prompts: Prompts, params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False,
                 constraints: Optional[Sequence[Optional[TokenConstraint]]] = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in order.
        ``params`` is one SamplingParams for all prompts or one per prompt; ``constraints``
        one token constraint (or None) per prompt."""
        params = params or self.get_default_sampling_params()
        if isinstance(prompts, str):
            items: list[Any] = [prompts]
        else:
            items = list(prompts)
            if items and all(isinstance(t, int) for t in items):
                items = [items]  # one prompt given as token ids
        if isinstance(params, SamplingParams):
            per = [params] * len(items)
        else:
            per = list(params)
            if len(per) != len(items):
                raise ValueError(f"{len(per)} SamplingParams for {len(items)} prompts")
        cons = list(constraints) if constraints is not None else [None] * len(items)
        if len(cons) != len(items):
            raise ValueError(f"{len(cons)} constraints for {len(items)} prompts")
        reqs: list[Request] = []
        try:
            for p, sp, c in zip(items, per, cons):
                if isinstance(p, str):
                    ids = self.tokenizer.encode(p, add_special_tokens=True)
                    reqs.append(self.engine.add_request(ids, sp, prompt=p, constraint=c))
                else:
                    reqs.append(self.engine.add_request([int(t) for t in p], sp, constraint=c))
            while self.engine.has_work():
                self.engine.step()
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [
            RequestOutput(
                request_id=r.request_id,
                prompt=r.prompt,
                prompt_token_ids=r.prompt_ids,
                token_ids=list(r.output_ids),
                text=r.text,
                finish_reason=r.finish_reason,
                logprobs=list(r.logprobs),
                error=r.error,
            )
            for r in reqs
        ]

    def chat(self, messages: list[dict[str, Any]], params: Optional[SamplingParams] = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, params)[0]

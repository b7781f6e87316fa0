"""One request's state inside the engine: tokens, KV blocks, text and stop rules."""

from __future__ import annotations

import enum
import itertools
from typing import Optional

import torch

from freetoken.backends.contract import on_gpu
from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.outputs import RequestError, StreamDelta, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.loading.tokenizer import Tokenizer

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Detokenizer:
    """Incremental byte-level detokenization: text is final once it no longer ends in
    an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.prefix = 0
        self.read = 0

    def step(self, ids: list[int]) -> str:
        if not self.tok.has_text:
            return ""
        prefix_text = self.tok.decode(ids[self.prefix : self.read])
        full = self.tok.decode(ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        new = full[len(prefix_text) :]
        self.prefix = self.read
        self.read = len(ids)
        return new

    def flush(self, ids: list[int]) -> str:
        """Whatever is still held back (an incomplete sequence at the very end)."""
        if not self.tok.has_text or self.read >= len(ids):
            return ""
        prefix_text = self.tok.decode(ids[self.prefix : self.read])
        full = self.tok.decode(ids[self.prefix :])
        self.prefix = self.read = len(ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""


class Request:
    """A generation request moving through the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_ids: list[int],
        max_model_len: int,
        generator: Optional[torch.Generator],
        prompt: Optional[str] = None,
        constraint: Optional[TokenConstraint] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.blocks: list[int] = []
        #: its slot of the recurrent state (models with linear-attention layers; None: none held)
        self.state_slot: Optional[int] = None
        self._table: Optional[torch.Tensor] = None
        self._table_len = 0  # len(self.blocks) when _table was made (its numel(), without a torch call)
        self.block_keys: list[bytes] = []  # prefix-cache keys of its full blocks (engine/prefix_cache.py)
        self.num_registered = 0  # leading blocks registered in (or attached from) the prefix cache
        self.cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at first admission
        self.generator = generator
        #: the generator of its draws on the logits' device (engine/sampling.py: plain sampled
        #: requests on a GPU), made at its first such draw, seeded from ``generator``; None: none yet
        self.device_generator: torch.Generator | None = None
        limit = max_model_len - len(self.prompt_ids)
        self.max_new = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_ids)
        self.detok = Detokenizer(tokenizer)
        self.text = ""  # all finalised output text (cut at a stop string)
        self.sent = 0  # characters of text already streamed
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.logprobs: list[TokenLogprob] = []
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.out_counts: dict[int, int] = {}
        self.aborted = False
        self.constraint = constraint  # which tokens may come next (None: any)
        self.error: Optional[RequestError] = None  # why it finished with "error", where known
        #: a fault to inject into a step it is in (:mod:`freetoken.engine.step_faults`; None: none)
        self.fault: Optional[str] = None

    # ------------------------------------------------------------ tokens / KV

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    def block_table(self, device: torch.device) -> torch.Tensor:
        """The block ids on ``device`` (kept while the blocks stay the same); a CUDA copy is
        queued from page-locked memory, so that a step launched ahead waits for nothing."""
        if self._table is None or self._table_len != len(self.blocks):
            table = torch.tensor(self.blocks, dtype=torch.int64)
            cuda = on_gpu(device)
            self._table = table.pin_memory().to(device, non_blocking=True) if cuda else table.to(device)
            self._table_len = len(self.blocks)
        return self._table

    def reset_blocks(self) -> list[int]:
        """Drop the KV state (preemption, finish): the caller releases the blocks."""
        blocks, self.blocks, self._table = self.blocks, [], None
        self.num_computed = 0
        self.num_registered = 0
        return blocks

    @property
    def constrained(self) -> bool:
        """Whether its next token is restricted: a constraint that
        :meth:`~freetoken.engine.constraints.TokenConstraint.restricts` it."""
        return self.constraint is not None and self.constraint.restricts()

    # --------------------------------------------------------------- outputs

    def append(self, token: int, logprob: Optional[TokenLogprob]) -> None:
        """Record one sampled token and apply the stop rules."""
        self.output_ids.append(token)
        self.out_counts[token] = self.out_counts.get(token, 0) + 1
        self.pending_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.pending_logprobs.append(logprob)
        if self.constraint is not None:
            self.constraint.advance(token)
        if token in self.stop_ids:
            # the text ends before the stop token; flush what the detokenizer held back
            tail = self.detok.flush(self.output_ids[:-1])
            if tail:
                self._add_text(tail)
            self.finish("stop")
            return
        new = self.detok.step(self.output_ids)
        if new:
            self._add_text(new)
            if self.status == Status.FINISHED:
                return
        if self.constraint is not None and self.constraint.is_complete():
            tail = self.detok.flush(self.output_ids)
            if tail:
                self._add_text(tail)
            self.finish("stop")
            return
        if len(self.output_ids) >= self.max_new:
            self.finish("length")

    def _add_text(self, new: str) -> None:
        old = len(self.text)
        self.text += new
        if self.params.stop:
            start = max(0, old - self.max_stop + 1)
            best = -1
            for s in self.params.stop:
                if not s:
                    continue
                i = self.text.find(s, start)
                if i >= 0 and (best < 0 or i < best):
                    best = i
            if best >= 0:
                self.text = self.text[:best]
                self.finish("stop")

    def finish(self, reason: str) -> None:
        if self.status == Status.FINISHED:
            return
        if reason == "length":
            tail = self.detok.flush(self.output_ids)
            if tail:
                self._add_text(tail)
                if self.status == Status.FINISHED:
                    return
        self.status = Status.FINISHED
        self.finish_reason = reason

    def _holdback(self) -> int:
        """Characters at the end of ``text`` that may be the start of a stop string."""
        if not self.params.stop or self.status == Status.FINISHED:
            return 0
        best = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def take_delta(self) -> Optional[StreamDelta]:
        """What is new since the last delta (None if nothing)."""
        end = len(self.text) - self._holdback()
        finished = self.status == Status.FINISHED
        if not self.pending_ids and end <= self.sent and not finished:
            return None
        text = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        d = StreamDelta(
            request_id=self.request_id,
            token_ids=self.pending_ids,
            text=text,
            logprobs=self.pending_logprobs,
            finished=finished,
            finish_reason=self.finish_reason if finished else None,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens or 0,
            error=self.error if finished else None,
        )
        self.pending_ids = []
        self.pending_logprobs = []
        return d

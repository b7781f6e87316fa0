"""The synchronous engine: requests in, one model step at a time, deltas out.

:class:`LLMEngine` owns the model, the paged KV cache and the scheduler. It is not
thread-safe; :class:`freetoken.engine.async_engine.AsyncEngine` drives it from one
background thread, :class:`freetoken.engine.llm.LLM` from the caller's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from freetoken.backends.contract import on_gpu
from freetoken.engine.config import EngineConfig
from freetoken.engine import memory_failure, step_faults
from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.outputs import StreamDelta
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.recurrent_state import RecurrentStatePool
from freetoken.engine.request import Request, Status, new_request_id
from freetoken.engine.sampling import device_picks, picked_on_device, plain_greedy, sample
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduled, Scheduler
from freetoken.models.attention import AttentionMetadata, SeqSlice

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run (says why)."""


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_total_tokens: int
    kv_used_tokens: int
    num_preemptions: int = 0
    requests_added: int = 0  # requests ever added to the engine
    prompt_tokens_added: int = 0  # their prompt tokens
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputation included)
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found in the cache (not computed)
    kv_cached_tokens: int = 0  # KV tokens in cached blocks no request uses (reusable)


def _read_back_later(t: torch.Tensor) -> Callable[[], list[Any]]:
    """``t.tolist()`` split in two: the copy to the host is queued now, in stream order (before
    whatever the caller queues next), and the returned function waits for that copy only.
    On a CUDA (or HIP) device the values go through page-locked memory and an event, so a
    step queued after this call runs while the host reads them; elsewhere ``t.tolist``."""
    if not on_gpu(t.device):
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def values() -> list[Any]:
        copied.synchronize()
        return host.tolist()

    return values


def _resolve_backend(name: Optional[str]) -> Any:
    from freetoken.backends.registry import get_backend

    return get_backend(name)


#: ``observer(request_ids, logits)``: called after each step that samples, with the
#: requests sampled and their float32 logits ``[len(request_ids), vocab]`` (before any
#: penalty or constraint). See :meth:`LLMEngine.add_logits_observer`.
LogitsObserver = Callable[[list[str], torch.Tensor], None]


class LLMEngine:
    """Loads the model and runs continuous-batching steps.

    Everything that depends on the backend goes through one
    :class:`~freetoken.backends.contract.ModelSession` (``self.session``): the weight
    policy the model loads with, each MoE layer's experts function, the KV budget, the
    start hook and the step itself.
    """

    def __init__(self, config: EngineConfig, backend: Any = None) -> None:
        from freetoken.models.loader import load, resolve_dtype

        self.config = config
        self.backend = backend if backend is not None else _resolve_backend(config.backend)
        path = config.model
        if path is None:
            from freetoken.models.demo import ensure_demo_model

            path = ensure_demo_model().hf_dir
        act = resolve_dtype(config.dtype, self.backend.default_dtype)
        self.session = self.backend.open_model(config.backend_options(act))
        try:
            self.kv_dtype = self._kv_dtype(act)  # refused before the weights load
            self._load(path, act, load)
        except BaseException:
            self.session.close()
            raise
        logger.info(
            "engine ready: %s, max_model_len %d, KV cache %d tokens (%.2f GiB), backend %s",
            self.model_name, self.max_model_len, self.kv.total_tokens, self.kv.bytes / 2**30, self.backend.name,
        )

    def _kv_dtype(self, act: torch.dtype) -> torch.dtype:
        """The KV cache's dtype: ``kv_cache_dtype`` (``auto``: ``act``). A GPU's attention
        kernels read a cache of the activation dtype only."""
        from freetoken.models.loader import resolve_dtype

        kv = resolve_dtype(self.config.kv_cache_dtype, str(act).removeprefix("torch."))
        if kv != act and torch.device(self.session.weight_policy.device).type != "cpu":
            raise ValueError(
                f"--kv-cache-dtype {self.config.kv_cache_dtype}: the {self.backend.name} backend keeps the KV cache "
                f"in the activation dtype ({str(act).removeprefix('torch.')}); leave it auto, or set --dtype"
            )
        return kv

    def _load(self, path: str, act: torch.dtype, load: Any) -> None:
        config = self.config
        loaded = load(path, self.session)
        self.loaded = loaded
        self.model = loaded.model
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = self.session.weight_policy.device
        self._host_device = torch.device(self.device).type == "cpu"
        default_name = "freetoken-demo" if config.model is None else loaded.name
        self.model_name = config.served_model_name or default_name
        for layer in self.model.layers:
            if getattr(layer, "moe", None) is not None:
                layer.moe.set_experts(self.session.routed_experts(layer.moe.spec()))
        kv_dtype = self.kv_dtype
        per_tok = cfg.kv_bytes_per_token(torch.empty((), dtype=kv_dtype).element_size())
        ctx = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context {cfg.max_position_embeddings}"
            )
        kv_tokens = config.kv_cache_tokens
        budget = self.session.kv_cache_budget()
        bs = config.kv_block_size
        # at least one request of the longest context given (whole blocks), even past the budget:
        # the plan counted that much (ModelSession.plan); without a context given, 4096 tokens
        floor = -(-ctx // bs) * bs if config.max_model_len else 4096
        all_running = ctx * config.max_running_requests  # every running request at the full context
        if kv_tokens is None:
            kv_tokens = all_running
            if budget is not None:
                kv_tokens = min(kv_tokens, max(floor, budget // per_tok))
        elif budget is not None and kv_tokens * per_tok > budget:
            from freetoken.loading.memory import InsufficientMemory, gib

            raise InsufficientMemory(
                f"{kv_tokens} tokens do not fit: KV cache {gib(kv_tokens * per_tok)}, but the {self.backend.name} backend leaves "
                f"{gib(budget)} for it after the weights; lower --kv-cache-tokens to at most {budget // per_tok}"
            )
        self.states: Optional[RecurrentStatePool] = None
        if cfg.recurrent is not None:
            # one slot per running request, plus one for prompt_logits outside the scheduler
            rows = max(config.max_running_requests, config.cuda_graph_max_bs, *(config.cuda_graph_bs or [1]))
            self.states = RecurrentStatePool(cfg.recurrent, config.max_running_requests + 1, act, self.device, rows)
            self.model.attach_recurrent_state(self.states)
            logger.info("recurrent state of %d linear-attention layers: %d slots, %.1f MiB",
                        len(cfg.recurrent.layers), self.states.num_slots, self.states.bytes / 2**20)
            if budget is not None and config.kv_cache_tokens is None:
                budget = max(0, budget - self.states.bytes)
                kv_tokens = min(kv_tokens, max(floor, budget // per_tok))
        if config.kv_cache_tokens is None:
            kv_tokens = -(-kv_tokens // bs) * bs  # whole blocks: a context of ctx tokens fits
            if kv_tokens < all_running and config.max_model_len:
                from freetoken.loading.memory import gib

                logger.warning(
                    "KV cache %d tokens (%s): room for %d full contexts of %d tokens at a time, where "
                    "--max-running-requests is %d; the others wait or are preempted. --kv-cache-tokens %d (%s) runs "
                    "them all at once (under a GPU memory limit, with fewer expert layers on the GPU)",
                    kv_tokens, gib(kv_tokens * per_tok), kv_tokens // ctx, ctx, config.max_running_requests,
                    all_running, gib(all_running * per_tok),
                )  # fmt: skip
        self.kv = KVCache(cfg, kv_tokens, config.kv_block_size, kv_dtype, self.device)
        if config.max_model_len and config.max_model_len > self.kv.total_tokens:
            raise ValueError(
                f"max_model_len {config.max_model_len} does not fit the KV cache ({self.kv.total_tokens} tokens); "
                "raise kv_cache_tokens"
            )
        self.max_model_len = min(ctx, self.kv.total_tokens)
        self.session.kv_cache_allocated(self.kv.bytes + (self.states.bytes if self.states is not None else 0))
        prefix = config.enable_prefix_cache
        if prefix and self.states is not None:
            # a cached KV prefix is useless without the recurrent state at its end, which is not kept
            logger.info("prefix cache off: %s has linear-attention layers whose recurrent state is not cached "
                        "per prefix", cfg.architecture)
            prefix = False
        self.prefix_cache = PrefixCache(self.kv, enabled=prefix)
        self.prefill_chunk = self.session.prefill_chunk(config.prefill_chunk)
        self.scheduler = Scheduler(self.prefix_cache, config.max_running_requests, self.prefill_chunk, self.states)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self._logits_observers: list[LogitsObserver] = []
        #: a decode step launched before the previous step's tokens were read back (its
        #: batch and final hidden states), taken by the next :meth:`step`
        self._ahead: Optional[tuple[list[Scheduled], torch.Tensor]] = None
        self._decode_ahead = config.decode_ahead
        self._step_batch: Optional[list[Scheduled]] = None  # the running step's batch (for its failure)
        self._faults = False  # a request with an injected fault was ever added
        self.num_requests_added = 0  # lifetime counters (metrics)
        self.prompt_tokens_added = 0
        self.prompt_tokens_computed = 0
        self.session.start(self.model, self.kv)
        self._warm_prompts()

    def add_logits_observer(self, observer: LogitsObserver) -> Callable[[], None]:
        """Call ``observer(request_ids, logits)`` after every sampling step (logit-level
        evaluation, debugging); returns a function that removes it. Observers run on the
        engine's thread and must not keep ``logits`` without copying it."""
        self._logits_observers.append(observer)
        return lambda: self._logits_observers.remove(observer)

    def close(self) -> None:
        """Release the backend's workers, hand-off tasks and graphs."""
        self.session.close()

    # ------------------------------------------------------------- requests

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestRejected("the prompt is empty; give at least one token")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not (0 <= int(t) < V)]
        if bad:
            raise RequestRejected(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token)"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"max_tokens={params.max_tokens} plus the prompt's {n} tokens exceeds the context of "
                f"{self.max_model_len} tokens; lower max_tokens to at most {self.max_model_len - n}"
            )
        if params.stop and not self.tokenizer.has_text:
            raise RequestRejected(f"{self.loaded.path} has no tokenizer, so stop strings cannot be matched; use stop_token_ids")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: Optional[str] = None,
                    prompt: Optional[str] = None, constraint: Optional[TokenConstraint] = None,
                    fault: Optional[str] = None) -> Request:
        """Queue a request. ``constraint`` (one object per request, it is stateful)
        restricts which tokens it may sample (:mod:`freetoken.engine.constraints`);
        ``fault`` makes a step it is in fail (tests only: :mod:`freetoken.engine.step_faults`)."""
        self.validate(prompt_ids, params)
        if fault is not None:
            step_faults.check(fault)
        rid = request_id or new_request_id()
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(rid, prompt_ids, params, self.tokenizer, list(self.model_config.eos_token_ids),
                      self.max_model_len, gen, prompt, constraint)
        if fault is not None:
            req.fault = fault
            self._faults = True
        self.requests[rid] = req
        self.num_requests_added += 1
        self.prompt_tokens_added += len(req.prompt_ids)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.aborted = True
        if req.status != Status.FINISHED:
            req.finish("abort")
        self.scheduler.remove(req)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        cached = self.prefix_cache.num_cached_free * self.kv.block_size
        used = self.kv.used_blocks * self.kv.block_size - cached
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=used / self.kv.total_tokens,
            kv_total_tokens=self.kv.total_tokens,
            kv_used_tokens=used,
            num_preemptions=self.scheduler.num_preemptions,
            requests_added=self.num_requests_added,
            prompt_tokens_added=self.prompt_tokens_added,
            prompt_tokens_computed=self.prompt_tokens_computed,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            kv_cached_tokens=cached,
        )

    def backend_info(self) -> dict[str, Any]:
        """The backend's decisions for this model (IO path, graphs, placement, why)."""
        return dict(self.session.report())

    # ------------------------------------------------------------------ step

    def _upload(self, t: torch.Tensor, queued: bool = False) -> torch.Tensor:
        """``t`` on the engine's device. ``queued``: without waiting for the device (a CUDA
        copy from pageable memory synchronizes the stream; from page-locked memory it is
        queued behind the step in flight)."""
        if self._host_device:  # .to() of a host tensor to the host: ~20 us for nothing on cold caches
            return t
        if queued and on_gpu(self.device):
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _metadata(self, batch: list[Scheduled], device_ids: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions and attention metadata on the device. With
        ``device_ids`` (a step launched ahead: its tokens are not on the host yet) those are
        the ids, nothing here waits for the device, and ``host_ids`` is None."""
        bs = self.kv.block_size
        dev = self.device
        queued = device_ids is not None
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs: list[SeqSlice] = []
        decode = True
        for s in batch:
            r = s.request
            start = r.num_computed
            end = start + s.num_tokens
            seqs.append(SeqSlice(len(pos), s.num_tokens, end, r.block_table(dev), list(r.blocks)))
            if not queued:
                ids.extend(r.all_ids[start:end] if s.num_tokens > 1 else [r.all_ids[start]])
            blocks = r.blocks
            for p in range(start, end):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            if s.num_tokens != 1:
                decode = False
        # ids, positions and slots reach the device in one copy (built through numpy: on the
        # caches a decode step's weight stream leaves, about half of torch.tensor's cost)
        packed = self._upload(torch.from_numpy(np.array([pos, slots] if queued else [ids, pos, slots],
                                                        dtype=np.int64)), queued)
        input_ids = device_ids if device_ids is not None else packed[0]
        positions, slot_mapping = packed[-2], packed[-1]
        meta = AttentionMetadata(slot_mapping, seqs, bs, decode, host_ids=None if queued else ids,
                                 host_positions=pos, host_slots=slots)
        if self.states is not None:
            meta.state_slots = [s.request.state_slot for s in batch]
            if decode:
                self.states.stage_decode(meta.state_slots)
        if decode and len(seqs) > 1:
            maxb = max(len(s.request.blocks) for s in batch)
            table = torch.zeros(len(batch), maxb, dtype=torch.int64)
            for i, s in enumerate(batch):
                table[i, : len(s.request.blocks)] = torch.tensor(s.request.blocks, dtype=torch.int64)
            ctx = torch.tensor([q.ctx_len for q in seqs], dtype=torch.int64)
            meta.block_tables = self._upload(table, queued)
            meta.ctx_lens = self._upload(ctx, queued)
            meta.mask = self._upload((torch.arange(maxb * bs)[None, :] < ctx[:, None]).view(len(batch), 1, 1, maxb * bs),
                                     queued)
        return input_ids, positions, meta

    def _greedy_picks(self, h: torch.Tensor, reqs: list[Request]) -> Optional[list[tuple[int, None]]]:
        """The tokens of a step whose sampled requests are all plain greedy, from the session
        (:meth:`~freetoken.backends.contract.ModelSession.greedy_tokens`: no logits row comes
        back), or None: the logits are computed and sampled."""
        if self._logits_observers or not all(plain_greedy(r) for r in reqs):
            return None
        tokens = self.session.greedy_tokens(h)
        return None if tokens is None else [(t, None) for t in tokens]

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int], chunk: Optional[int] = None) -> torch.Tensor:
        """Logits (float32 [N, vocab]) at every position of a prompt, computed through
        the paged cache in chunks of ``chunk`` tokens (default ``prefill_chunk``).
        Runs outside the scheduler: call it while no requests are in flight."""
        self.validate(prompt_ids, SamplingParams(max_tokens=1))
        return torch.cat(self._prefill(prompt_ids, chunk or self.prefill_chunk, every_position=True))

    @torch.inference_mode()
    def _warm_prompts(self) -> None:
        """Prefill the session's warm-up lengths once (random token ids, nothing kept), so
        that the prompt kernels a GPU builds at first use are built before any request. A
        warm-up that runs out of memory is logged and ends the warm-up (a request of that
        size would fail the same way, alone)."""
        room = min(self.max_model_len - 1, self.prefix_cache.num_available * self.kv.block_size)
        lengths = [n for n in self.session.warmup_prompt_lengths(self.prefill_chunk) if 1 <= n <= room]
        if not lengths:
            return
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        try:
            for n in lengths:
                ids = torch.randint(0, self.model_config.vocab_size, (n,), generator=gen).tolist()
                try:
                    self._prefill(ids, n, every_position=False)
                except Exception as exc:
                    if not self.backend.out_of_memory(exc):
                        raise
                    logger.warning("warm-up prefill of %d tokens ran out of memory (%s): the prompt kernels of "
                                   "larger steps are built at their first use", n, str(exc).strip().splitlines()[0])
                    self.session.step_failed()
                    return
            logger.info("prompt kernels ready: prefills of %s tokens in %.1f s", ", ".join(map(str, lengths)),
                        time.perf_counter() - t0)
        finally:
            self.session.warmup_done()

    def _prefill(self, prompt_ids: list[int], chunk: int, every_position: bool) -> list[torch.Tensor]:
        """Run a prompt through the paged cache outside the scheduler, in chunks of
        ``chunk`` tokens; the logits of every position, or of each chunk's last one. The
        blocks and the recurrent-state slot it takes are released after."""
        req = Request("prompt-logits", prompt_ids, SamplingParams(max_tokens=1), self.tokenizer, [],
                      self.max_model_len, None)
        out = []
        if self.states is not None:
            req.state_slot = self.states.allocate()
        try:
            while req.num_computed < len(prompt_ids):
                n = min(chunk, len(prompt_ids) - req.num_computed)
                need = self.kv.blocks_for(req.num_computed + n) - len(req.blocks)
                req.blocks.extend(self.prefix_cache.allocate(need))
                batch = [Scheduled(req, n, False)]
                ids, pos, meta = self._metadata(batch)
                hidden = self.session.forward(ids, pos, meta)
                out.append(self.model.compute_logits(hidden if every_position else hidden[-1:]))
                req.num_computed += n
        finally:
            self.prefix_cache.release(req.reset_blocks())
            if req.state_slot is not None and self.states is not None:
                self.states.free(req.state_slot)
                req.state_slot = None
        return out

    def _take_ahead(self) -> Optional[tuple[list[Scheduled], torch.Tensor]]:
        """The step launched ahead, without the requests that finished (or were aborted)
        since: their rows are dropped (what the step wrote to their KV blocks, which may
        have been released, came before anything queued after it); None if there is none."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        batch, hidden = ahead
        live = [i for i, s in enumerate(batch) if s.request.status != Status.FINISHED]
        if not live:
            return None
        if len(live) < len(batch):
            batch, hidden = [batch[i] for i in live], hidden[live]
        return batch, hidden

    def _ahead_batch(self, batch: list[Scheduled], reqs: list[Request],
                     logits: torch.Tensor) -> Optional[list[Scheduled]]:  # fmt: skip
        """The next step's batch, when it can be launched before this step's tokens are read
        back (``decode_ahead``): every running request sampled here, each picked where the
        logits are (:func:`~freetoken.engine.sampling.picked_on_device`: plain greedy, or plain
        sampled on a device) and not stopped by length at this token, nothing waiting to be
        admitted, no recurrent state (a discarded step would have changed it), and KV blocks for
        the next position; else None. Its rows are in ``reqs``' order, as this step's tokens."""
        if not self._decode_ahead or self.states is not None or self.scheduler.waiting:
            return None
        if not (len(reqs) == len(batch) == len(self.scheduler.running)) or not picked_on_device(logits, reqs):
            return None
        for r in reqs:
            if len(r.output_ids) + 1 >= r.max_new or r.num_tokens + 1 >= self.max_model_len:
                return None
        if not all(self.scheduler.reserve(r, r.num_tokens + 1) for r in reqs):
            return None
        return [Scheduled(r, 1, True) for r in reqs]

    def _pick(self, logits: torch.Tensor, batch: list[Scheduled], reqs: list[Request]) -> list[tuple[int, Any]]:
        """This step's tokens from its logits; when the next step can go ahead
        (:meth:`_ahead_batch`), it is launched from the tokens picked on the device before
        they are read back."""
        nxt = self._ahead_batch(batch, reqs, logits)
        if nxt is None:
            return sample(logits, reqs, self.generator)
        tokens = device_picks(logits, reqs, self.generator)
        # the copy to the host goes before the next step in stream order: the host has this
        # step's tokens while the next step runs (a plain tolist() would wait for it)
        read = _read_back_later(tokens)
        ids, pos, meta = self._metadata(nxt, device_ids=tokens)
        hidden = self.session.decode_ahead(ids, pos, meta)
        if hidden is None:
            logger.info("decode ahead: the %s backend cannot launch a step before its tokens are read back; "
                        "each step's tokens are read back before the next", self.backend.name)
            self._decode_ahead = False
        else:
            self._ahead = (nxt, hidden)
        return [(int(t), None) for t in read()]

    @torch.inference_mode()
    def step(self) -> list[StreamDelta]:
        """Run one model step; returns the deltas of the requests that advanced. A step that
        runs out of memory fails its largest request and preempts the others
        (:mod:`freetoken.engine.memory_failure`); the delta of the failed request is returned."""
        self._step_batch = None
        try:
            return self._step()
        except Exception as exc:
            if not self._step_batch or not self.backend.out_of_memory(exc):
                raise
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning("a step of %d request(s) ran out of memory: %s", len(self._step_batch), reason)
        # outside the except clause: the error's frames, and the tensors they hold, are gone
        return self._out_of_memory(reason)

    def _out_of_memory(self, reason: str) -> list[StreamDelta]:
        batch, self._step_batch = self._step_batch or [], None
        self._ahead = None
        self.session.step_failed()
        live = [s for s in batch if s.request.status != Status.FINISHED]
        if not live:
            return []
        victim = memory_failure.largest(live)
        req = victim.request
        req.error = memory_failure.out_of_memory_error(victim, self.backend.device(), reason,
                                                      self.prefill_chunk, self.max_model_len)
        req.finish("error")
        logger.error("request %s failed: %s", req.request_id, req.error.message)
        delta = req.take_delta()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        for s in live:
            if s is not victim and s.request.status == Status.RUNNING:
                self.scheduler.preempt(s.request, "a step ran out of memory")
        return [delta] if delta is not None else []

    def _step(self) -> list[StreamDelta]:
        ahead = self._take_ahead()
        if ahead is not None:  # launched by the previous step: one decode row per request
            batch, hidden = ahead
            self._step_batch = batch
            rows = list(range(len(batch)))
            if self._faults:
                step_faults.inject(batch, self.backend.device())
        else:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            self._step_batch = batch
            if self._faults:
                step_faults.inject(batch, self.backend.device())
            ids, pos, meta = self._metadata(batch)
            hidden = self.session.forward(ids, pos, meta)
            rows = [seq.q_start + seq.q_len - 1 for seq, s in zip(meta.seqs, batch) if s.sample]
        samplers = [s for s in batch if s.sample]
        for s in batch:
            r = s.request
            self.prompt_tokens_computed += max(0, min(s.num_tokens, len(r.prompt_ids) - r.num_computed))
            r.num_computed += s.num_tokens
        self.scheduler.computed(batch)
        deltas: list[StreamDelta] = []
        if samplers:
            h = hidden if len(rows) == hidden.shape[0] else hidden[rows]
            reqs = [s.request for s in samplers]
            picked = self._greedy_picks(h, reqs)
            if picked is None:
                logits = self.model.compute_logits(h)
                for observer in self._logits_observers:
                    observer([r.request_id for r in reqs], logits)
                picked = self._pick(logits, batch, reqs)
            for r, (tok, lp) in zip(reqs, picked):
                if tok < 0:  # its constraint allowed no token
                    logger.error("request %s: its constraint allows no token; finishing it", r.request_id)
                    r.finish("error")
                else:
                    r.append(tok, lp)
                if r.status != Status.FINISHED and r.num_tokens >= self.max_model_len:
                    r.finish("length")
                d = r.take_delta()
                if d is not None:
                    deltas.append(d)
                if r.status == Status.FINISHED:
                    self.scheduler.remove(r)
                    self.requests.pop(r.request_id, None)
        return deltas

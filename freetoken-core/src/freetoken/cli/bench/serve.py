"""``freetoken bench serve``: time to first token over the turns of a multi-turn chat,
with the prefix cache on and off.

The engine runs in-process. Turn 1's prompt is ``--user-tokens`` random token ids;
each later turn's prompt is the previous prompt, the previous answer (``--answer-tokens``
greedy tokens) and a new user message of ``--user-tokens`` random ids, so every prompt
extends the one before token for token (as a chat client resending the conversation
does; turns are token ids, no chat template). For each setting a fresh engine runs the
turns one after another; per turn it reports the time from ``add_request`` to the
first token (``engine.step()`` loop, ``time.perf_counter``), the prompt tokens taken
from the prefix cache and those computed. With the cache on, a turn computes only
what the previous turn did not: about the new user message, plus the partial last
KV block.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import time
from typing import Any

from freetoken.cli.engine_options import add_engine_arguments, engine_config_from_args, positive_int


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "serve", help="time to first token per turn of a multi-turn chat, prefix cache on and off",
        description="Time to first token of each turn of a multi-turn chat (each turn appends the previous answer "
        "and a new user message to the prompt) with the prefix cache on and off, and the prompt tokens computed "
        "and taken from the cache per turn, as one table (or --json).",
    )
    p.add_argument("--turns", type=positive_int, default=5, metavar="N", help="turns of the chat (default: 5)")
    p.add_argument("--user-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens of each user message (default: 256)")
    p.add_argument("--answer-tokens", type=positive_int, default=16, metavar="N",
                   help="tokens generated per turn (default: 16)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_engine_arguments(p, defaults={"max_running_requests": None, "prefill_chunk": None}, default_text={
        "max_running_requests": "1", "prefill_chunk": "the last turn's prompt: a prompt in one step",
        "max_model_len": "the last turn's prompt + --answer-tokens + 1",
        "kv_cache_tokens": "twice --max-model-len", "seed": "0; also seeds the random messages",
    })
    p.set_defaults(func=run)


def _turns(engine: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from freetoken.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    warm = engine.add_request([rng.randrange(vocab) for _ in range(8)], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work():  # pays first-call costs; its random ids share no prefix with the chat
        engine.step()
    assert warm.output_ids
    rng = random.Random(args.seed + 1)
    prompt: list[int] = []
    out = []
    for turn in range(1, args.turns + 1):
        prompt = prompt + [rng.randrange(vocab) for _ in range(args.user_tokens)]
        t0 = time.perf_counter()
        req = engine.add_request(list(prompt), params)
        while not req.output_ids:
            engine.step()
        ttft = time.perf_counter() - t0
        while engine.has_work():
            engine.step()
        cached = int(req.cached_tokens or 0)
        out.append({"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": cached,
                    "computed_tokens": len(prompt) - cached, "ttft_ms": 1000 * ttft})
        prompt = prompt + list(req.output_ids)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.backends.contract import BackendError
    from freetoken.engine.engine import LLMEngine
    from freetoken.moe.qualify.startup import QualificationError

    if args.threads:
        torch.set_num_threads(args.threads)
    last = args.turns * args.user_tokens + (args.turns - 1) * args.answer_tokens
    ctx = last + args.answer_tokens + 1
    base = engine_config_from_args(args, **{k: v for k, v in {
        "max_running_requests": 1, "prefill_chunk": last, "max_model_len": ctx, "kv_cache_tokens": 2 * ctx + 64,
    }.items() if getattr(args, k, None) is None})
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "turns": args.turns,
        "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens, "runs": {},
    }
    for name, enabled in (("prefix_cache", True), ("no_prefix_cache", False)):
        try:
            engine = LLMEngine(dataclasses.replace(base, enable_prefix_cache=enabled))
        except (ValueError, MemoryError, BackendError, QualificationError) as exc:
            print(f"freetoken bench serve: {exc}", file=sys.stderr)
            return 1
        try:
            results["model"], results["device"] = engine.model_name, str(engine.device)
            results["runs"][name] = _turns(engine, args)
        finally:
            engine.close()
    on, off = (results["runs"][k][-1] for k in ("prefix_cache", "no_prefix_cache"))
    results["last_turn_ttft_ms"] = {"prefix_cache": on["ttft_ms"], "no_prefix_cache": off["ttft_ms"]}
    results["last_turn_speedup"] = off["ttft_ms"] / on["ttft_ms"] if on["ttft_ms"] > 0 else None
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def format_table(results: dict[str, Any]) -> str:
    lines = [f"model {results['model']} on {results['device']}; machine {results['machine']}, torch threads "
             f"{results['torch_threads']}; {results['date']}",
             f"{results['turns']} turns, {results['user_tokens']} tokens per user message, "
             f"{results['answer_tokens']} per answer (greedy)", "",
             f"{'turn':>4}  {'prompt':>6}  {'cache: TTFT ms':>14}  {'cached':>6}  {'computed':>8}  "
             f"{'no cache: TTFT ms':>17}  {'computed':>8}"]
    for on, off in zip(results["runs"]["prefix_cache"], results["runs"]["no_prefix_cache"]):
        lines.append(f"{on['turn']:>4}  {on['prompt_tokens']:>6}  {on['ttft_ms']:>14.1f}  {on['cached_tokens']:>6}  "
                     f"{on['computed_tokens']:>8}  {off['ttft_ms']:>17.1f}  {off['computed_tokens']:>8}")
    speedup = results["last_turn_speedup"]
    lines += ["", f"last turn: {'-' if speedup is None else f'{speedup:.1f}x'} faster to the first token with "
                  "the prefix cache"]
    return "\n".join(lines)

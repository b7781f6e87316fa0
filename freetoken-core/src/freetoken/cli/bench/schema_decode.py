"""``freetoken bench schema``: the per-token cost of JSON-schema constrained decoding
against plain decoding, alone and in a batch with a plain request.

The engine runs in-process and is stepped directly. Four runs of ``--steps`` decode
steps each: one plain request; one ``json_schema`` request (an llguidance
:class:`~freetoken.server.schema_constraint.SchemaConstraint` over :data:`SCHEMA`, a
structure-heavy array of objects, so most tokens sit where the mask costs most); two
plain requests; a plain and a schema request in the same batch. Requests sample at
temperature 1 from random prompts; a finished request is replaced by a new one, and
only steps in which every request of the batch decodes are timed
(``time.perf_counter`` around ``engine.step()``). The schema constraint's own clock
says how long masks took to compute (in background threads) and how long the engine's
thread waited for them.

A model whose tokenizer has text uses its own vocabulary for the grammar; a file
without one (``freetoken bench make-model``) gets a synthetic byte-level vocabulary of
the model's size (:func:`synthetic_vocab`), whose masks cost what a real 150k-token
BPE vocabulary's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Optional

from freetoken.cli.engine_options import add_engine_arguments, engine_config_from_args, positive_int

#: the bench's schema: unbounded, with a structural position every few tokens
SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": False}}

_PIECES = ["{", "}", "[", "]", '"', ":", ",", '":', '",', '":"', '"}', "},{", "[{", "}]", "\\n", " ", "  ", "\n", "\t",
           "true", "false", "null", "-", ".", "e"]


def synthetic_vocab(size: int, eos_ids: list[int], seed: int = 0) -> tuple[list[bytes], list[int]]:
    """A byte-level vocabulary of ``size`` tokens (bytes of each id, special ids): the 256
    single bytes, JSON punctuation runs, numbers, random ASCII words with and without a
    leading space, whitespace runs and CJK pieces; the EOS ids are special tokens."""
    rng = random.Random(seed)
    tokens: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(tokens)

    def add(b: bytes) -> None:
        if b and b not in seen and len(tokens) < size:
            seen.add(b)
            tokens.append(b)

    for p in _PIECES:
        add(p.encode())
    for n in range(1000):
        add(str(n).encode())
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]
    while len(tokens) < size:
        kind = rng.random()
        if kind < 0.75:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            add(((" " if rng.random() < 0.5 else "") + word).encode())
        elif kind < 0.85:
            add("".join(rng.choice(cjk) for _ in range(rng.randint(1, 3))).encode())
        elif kind < 0.95:
            add("".join(rng.choice(_PIECES) for _ in range(rng.randint(2, 4))).encode())
        else:
            add((" " * rng.randint(2, 16)).encode())
    special = sorted(i for i in eos_ids if 0 <= i < size)
    for i in special:
        tokens[i] = b"\xff<eos>"
    return tokens, special


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "schema", help="per-token cost of json_schema decoding vs plain decoding, alone and batched",
        description="Per-token cost of JSON-schema constrained decoding (llguidance) against plain decoding: one "
        "request alone, and a schema request batched with a plain one against two plain requests.",
    )
    p.add_argument("--steps", type=positive_int, default=128, metavar="N",
                   help="timed decode steps per run (default: 128)")
    p.add_argument("--rounds", type=positive_int, default=8, metavar="N",
                   help="the runs take turns in this many rounds (default: 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=32, metavar="N",
                   help="random prompt tokens per request (default: 32)")
    p.add_argument("--answer-tokens", type=positive_int, default=96, metavar="N",
                   help="max_tokens of each request (default: 96)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_engine_arguments(p, defaults={"max_running_requests": 2}, default_text={
        "seed": "0; also seeds the prompts", "max_model_len": "--prompt-tokens + --answer-tokens + 1",
        "kv_cache_tokens": "room for the two requests"})
    p.set_defaults(func=run)


def _grammar_vocab(engine: Any) -> Any:
    from freetoken.server.schema_constraint import GrammarVocab, grammar_vocab

    tok = engine.tokenizer
    if getattr(tok, "has_text", False) and hasattr(tok, "_tok"):
        return grammar_vocab(tok)
    eos = list(engine.model_config.eos_token_ids) or [engine.model_config.vocab_size - 1]
    tokens, special = synthetic_vocab(engine.model_config.vocab_size, eos)
    return GrammarVocab(tokens, special, eos)


Slot = Callable[[int], tuple[Any, Optional[Any]]]  # seed -> (request, constraint or None)


class _Run:
    """One configuration's slots and what its timed steps measured."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.wall: list[float] = []
        self.cpu: list[float] = []  # the engine thread's CPU time
        self.constraints: list[Any] = []

    def measure(self, engine: Any, steps: int, seed: int) -> int:
        """Time ``steps`` engine steps in which every slot's request decodes; returns the next seed."""
        from freetoken.engine.request import Status

        running = []
        for slot in self.slots:
            running.append(slot(seed))
            seed += 1
        self.constraints += [c for _, c in running if c is not None]
        timed = 0
        while timed < steps:
            decoding = all(r.output_ids and r.status != Status.FINISHED for r, _ in running)
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if decoding:
                self.wall.append(dt)
                self.cpu.append(dc)
                timed += 1
            for i, (r, _) in enumerate(running):
                if r.status == Status.FINISHED:
                    running[i] = self.slots[i](seed)
                    seed += 1
                    if running[i][1] is not None:
                        self.constraints.append(running[i][1])
        for r, _ in running:
            engine.abort(r.request_id)
        while engine.has_work():
            engine.step()
        return seed

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step_ms_median": 1000 * statistics.median(self.wall),
                               "step_ms_mean": 1000 * statistics.fmean(self.wall),
                               "cpu_ms_median": 1000 * statistics.median(self.cpu), "steps": len(self.wall)}
        if self.constraints:
            states = sum(c.timing.states for c in self.constraints)
            out["mask_states"] = states
            out["mask_compute_ms_per_state"] = 1000 * sum(c.timing.computed for c in self.constraints) / max(1, states)
            out["mask_wait_ms_per_state"] = 1000 * sum(c.timing.waited for c in self.constraints) / max(1, states)
        return out


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.backends.contract import BackendError
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.sampling_params import SamplingParams
    from freetoken.moe.qualify.startup import QualificationError
    from freetoken.server.schema_constraint import SchemaConstraint, schema_grammar

    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = args.prompt_tokens + args.answer_tokens + 1
    config = engine_config_from_args(args, **{k: v for k, v in {
        "max_model_len": ctx, "kv_cache_tokens": 2 * ctx + 64}.items() if getattr(args, k, None) is None})
    try:
        engine = LLMEngine(config)
    except (ValueError, MemoryError, BackendError, QualificationError) as exc:
        print(f"freetoken bench schema: {exc}", file=sys.stderr)
        return 1
    try:
        t0 = time.perf_counter()
        vocab = _grammar_vocab(engine)
        vocab_s = time.perf_counter() - t0
        grammar = schema_grammar(SCHEMA)
        rng = random.Random(args.seed)
        V = engine.model_config.vocab_size

        def plain(seed: int) -> tuple[Any, None]:
            params = SamplingParams(max_tokens=args.answer_tokens, temperature=1.0, seed=seed, ignore_eos=True)
            return engine.add_request([rng.randrange(V) for _ in range(args.prompt_tokens)], params), None

        def schema(seed: int) -> tuple[Any, Any]:
            c = SchemaConstraint(vocab, grammar)
            params = SamplingParams(max_tokens=args.answer_tokens, temperature=1.0, seed=seed)
            return engine.add_request([rng.randrange(V) for _ in range(args.prompt_tokens)], params, constraint=c), c

        _Run([plain]).measure(engine, 4, 10**6)  # first-call costs
        runs = {"plain": _Run([plain]), "schema": _Run([schema]), "plain+plain": _Run([plain, plain]),
                "plain+schema": _Run([plain, schema])}
        seed = 0
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):  # interleaved, so a change of machine load touches every run alike
            for run_ in runs.values():
                seed = run_.measure(engine, per_round, seed)
        summary = {name: run_.summary() for name, run_ in runs.items()}
        results: dict[str, Any] = {
            "model": engine.model_name, "device": str(engine.device), "vocab": V, "grammar_vocab_s": vocab_s,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": summary,
            "schema_vs_plain": summary["schema"]["step_ms_median"] / summary["plain"]["step_ms_median"],
            "batched_schema_vs_plain": summary["plain+schema"]["step_ms_median"] / summary["plain+plain"]["step_ms_median"],
            "schema_vs_plain_cpu": summary["schema"]["cpu_ms_median"] / summary["plain"]["cpu_ms_median"],
            "batched_schema_vs_plain_cpu": summary["plain+schema"]["cpu_ms_median"] / summary["plain+plain"]["cpu_ms_median"],
        }
    finally:
        engine.close()
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def format_table(results: dict[str, Any]) -> str:
    lines = [f"model {results['model']} on {results['device']} (vocabulary {results['vocab']}); machine "
             f"{results['machine']}, torch threads {results['torch_threads']}; {results['date']}", "",
             f"{'run':<13} {'step ms (median)':>16} {'mean':>7} {'engine CPU ms':>13} {'mask ms/state':>13} "
             f"{'waited ms/state':>15}"]
    for name, r in results["runs"].items():
        mask = f"{r['mask_compute_ms_per_state']:.2f}" if "mask_states" in r else "-"
        wait = f"{r['mask_wait_ms_per_state']:.3f}" if "mask_states" in r else "-"
        lines.append(f"{name:<13} {r['step_ms_median']:>16.2f} {r['step_ms_mean']:>7.2f} {r['cpu_ms_median']:>13.2f} "
                     f"{mask:>13} {wait:>15}")
    lines += ["", f"schema / plain per token: {results['schema_vs_plain']:.3f}x wall, "
                  f"{results['schema_vs_plain_cpu']:.3f}x engine-thread CPU",
              f"batch with a schema request / two plain: {results['batched_schema_vs_plain']:.3f}x wall, "
              f"{results['batched_schema_vs_plain_cpu']:.3f}x engine-thread CPU"]
    return "\n".join(lines)

"""``freetoken generate``: run one prompt (or a chat) and stream the text."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Optional

from freetoken.cli.engine_options import add_engine_arguments, any_int, engine_config_from_args
from freetoken.engine.config import EngineConfig
from freetoken.backends.contract import BackendError
from freetoken.engine.sampling_params import SamplingParams


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt (built-in demo model without --model)",
        description="Generate from a prompt, token ids or an interactive chat. Without --model the built-in demo "
        "model (random weights, created on first use) is used.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (with --chat: the user message)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="chat mode: apply the model's chat template; without --prompt read user turns from stdin")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation config)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling (default: the model's generation config)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the K likeliest tokens (default: the model's "
                   "generation config)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the likeliest one's "
                   "probability (default: the model's generation config)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalty for tokens already seen (default: the model's generation config)")
    p.add_argument("--seed", type=any_int, default=None, metavar="N",
                   help="sampling seed of the request, also the engine's seed (default: none; the engine seeds with 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report the chosen tokens' log-probabilities and N alternatives (with --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    # --seed above is the request's (and the engine's) seed; one request runs at a time
    add_engine_arguments(p, defaults={"max_running_requests": 1}, exclude=("seed",))
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options; ``--seed`` seeds the engine as well as the request."""
    return engine_config_from_args(args, seed=0 if args.seed is None else args.seed)


def _params(args: argparse.Namespace, defaults: SamplingParams) -> SamplingParams:
    kw: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": defaults.temperature if args.temperature is None else args.temperature,
        "top_p": defaults.top_p if args.top_p is None else args.top_p,
        "top_k": defaults.top_k if args.top_k is None else args.top_k,
        "min_p": defaults.min_p if args.min_p is None else args.min_p,
        "repetition_penalty": defaults.repetition_penalty if args.repetition_penalty is None else args.repetition_penalty,
        "seed": args.seed,
        "stop": list(args.stop),
        "ignore_eos": args.ignore_eos,
    }
    if args.logprobs is not None:
        kw["logprobs"] = True
        kw["top_logprobs"] = args.logprobs
    return SamplingParams(**kw)


def _run_one(llm: Any, ids: list[int], params: SamplingParams, prompt: Optional[str], as_json: bool) -> dict[str, Any]:
    eng = llm.engine
    req = eng.add_request(ids, params, prompt=prompt)
    stream = not as_json
    try:
        while eng.has_work():
            for d in eng.step():
                if stream and d.request_id == req.request_id and d.text:
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        eng.abort(req.request_id)
        raise
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    out: dict[str, Any] = {
        "model": eng.model_name,
        "token_ids": list(req.output_ids),
        "text": req.text,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finish_reason,
    }
    if params.logprobs:
        out["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                           for lp in req.logprobs]
    return out


def run(args: argparse.Namespace) -> int:
    from freetoken.engine.engine import RequestRejected
    from freetoken.engine.llm import LLM
    from freetoken.loading.hf import CheckpointError
    from freetoken.loading.tokenizer import NoTokenizerError

    if args.prompt is None and args.prompt_ids is None and not args.chat:
        print("freetoken generate: give --prompt TEXT, --prompt-ids 1,2,3 or --chat", file=sys.stderr)
        return 2
    if args.prompt_ids is not None and args.chat:
        print("freetoken generate: --chat takes text (--prompt or stdin), not --prompt-ids", file=sys.stderr)
        return 2
    config = engine_config(args)
    try:
        llm = LLM(**dataclasses.asdict(config))
        params = _params(args, llm.get_default_sampling_params())
        tok = llm.tokenizer
        if args.prompt_ids is not None:
            try:
                ids = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
            except ValueError:
                print(f"freetoken generate: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}",
                      file=sys.stderr)
                return 2
            result = _run_one(llm, ids, params, None, args.json)
        elif not args.chat:
            result = _run_one(llm, tok.encode(args.prompt, add_special_tokens=True), params, args.prompt, args.json)
        else:
            history: list[dict[str, str]] = []
            if args.system:
                history.append({"role": "system", "content": args.system})
            turns = [args.prompt] if args.prompt is not None else None
            result = {}
            while True:
                if turns is not None:
                    if not turns:
                        break
                    user = turns.pop(0)
                else:
                    if sys.stdin.isatty():
                        sys.stderr.write("> ")
                        sys.stderr.flush()
                    line = sys.stdin.readline()
                    if not line:
                        break
                    user = line.rstrip("\n")
                    if not user.strip():
                        continue
                history.append({"role": "user", "content": user})
                text = tok.apply_chat_template(history, add_generation_prompt=True)
                result = _run_one(llm, tok.encode(text), params, text, args.json)
                history.append({"role": "assistant", "content": result["text"]})
                if args.json and turns is None:
                    print(json.dumps(result, ensure_ascii=False))
            if turns is None:
                return 0
    except (CheckpointError, RequestRejected, NoTokenizerError, MemoryError, ValueError, BackendError) as exc:
        print(f"freetoken generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    return 0

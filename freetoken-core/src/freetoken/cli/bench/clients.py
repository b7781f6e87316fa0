"""``freetoken bench clients``: many users at once against an OpenAI-compatible server.

For each count N of ``--clients``, N concurrent clients each send ``--requests`` streaming
``POST /v1/completions`` one after another to ``--url`` (a ``freetoken serve``, or any
server of that API: llama.cpp's ``llama-server`` takes the same body). Every prompt is
``--prompt-tokens`` random token ids (fresh per request, so no prompt shares a cached
prefix with another), answered with exactly ``--max-tokens`` greedy tokens
(``ignore_eos``). The client measures, per request, the time to the first streamed token,
the gaps between the streamed chunks and the tokens generated (the final ``usage`` where the
server sends one, else one per chunk with text); per N it reports the aggregate output
rate (every generated token over the wall time from the first request sent to the last
answer), each user's decode rate (tokens after the first over the time after the first),
time to first token and inter-token latency at p50/p99, and every failed request with the
server's message. The exit status is 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from typing import Any, Optional

from freetoken.cli.engine_options import positive_int


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "clients", help="N concurrent streaming users against an OpenAI-compatible server",
        description="Drive N concurrent streaming /v1/completions users (for each N of --clients) against a running "
        "server and report aggregate and per-user tokens/s, time to first token and inter-token latency (p50/p99) "
        "and the failed requests.",
    )
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=positive_int, nargs="+", default=[8, 32], metavar="N",
                   help="concurrent users, one run per value (default: 8 32)")
    p.add_argument("--requests", type=positive_int, default=2, metavar="R",
                   help="requests each user sends one after another (default: 2)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, metavar="P",
                   help="random token ids per prompt (default: 512)")
    p.add_argument("--max-tokens", type=positive_int, default=128, metavar="G",
                   help="tokens generated per request, end of sequence ignored (default: 128)")
    p.add_argument("--vocab", type=positive_int, default=32000, metavar="V",
                   help="prompt ids are drawn from [100, V - 100) (default: 32000)")
    p.add_argument("--model", default=None, help="the body's model field (default: the first of GET /v1/models)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per request (default: 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


@dataclasses.dataclass
class RequestRecord:
    """What one client saw of one request (seconds from the run's start)."""

    user: int
    sent: float
    first: Optional[float] = None
    last: Optional[float] = None
    tokens: int = 0
    gaps: list[float] = dataclasses.field(default_factory=list)
    error: Optional[str] = None


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def carries_token(event: dict[str, Any]) -> bool:
    """Whether a streamed completion chunk brings generated text: a choice with text, or
    with an empty text and no finish reason yet (a token whose bytes end later)."""
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("text") is None:
            continue
        if choice["text"] or choice.get("finish_reason") is None:
            return True
    return False


async def _one_request(client: Any, url: str, body: dict[str, Any], rec: RequestRecord, t0: float) -> None:
    usage_tokens: Optional[int] = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return
                if event.get("usage"):
                    usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                if not carries_token(event):
                    continue
                now = time.perf_counter() - t0
                if rec.first is None:
                    rec.first = now
                elif rec.last is not None:
                    rec.gaps.append(now - rec.last)
                rec.last = now
                chunks_with_text += 1
    except Exception as exc:  # noqa: BLE001 - every transport failure is a failed request, named
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    rec.tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    if rec.first is None:
        rec.error = "the stream ended without a token"


async def _run_clients(args: argparse.Namespace, model: str, n: int) -> tuple[list[RequestRecord], float]:
    import httpx

    rng = random.Random(args.seed * 1_000_003 + n)
    hi = max(args.vocab - 100, 101)
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def user(u: int) -> None:
            for _ in range(args.requests):
                prompt = [rng.randrange(100, hi) for _ in range(args.prompt_tokens)]
                body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
                rec = RequestRecord(user=u, sent=time.perf_counter() - t0)
                records.append(rec)
                await _one_request(client, args.url.rstrip("/"), body, rec, t0)

        await asyncio.gather(*(user(u) for u in range(n)))
    return records, time.perf_counter() - t0


def summarize(records: list[RequestRecord], wall: float, n: int) -> dict[str, Any]:
    """One run's figures (times in ms, rates in tokens/s)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [(r.first - r.sent) * 1e3 for r in ok if r.first is not None]
    per_user = [(r.tokens - 1) / (r.last - r.first) for r in ok
                if r.first is not None and r.last is not None and r.last > r.first and r.tokens > 1]
    gaps = [g * 1e3 for r in ok for g in r.gaps]

    def pct(xs: list[float], q: float) -> Optional[float]:
        v = percentile(xs, q)
        return None if v is None else round(v, 3)

    return {
        "clients": n, "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
        "wall_s": round(wall, 3), "tokens": tokens, "aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "per_user_tok_s_p50": pct(per_user, 50), "per_user_tok_s_min": round(min(per_user), 2) if per_user else None,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99),
        "errors": sorted({r.error for r in records if r.error is not None})[:5],
    }


def _first_model(url: str, timeout: float) -> str:
    import httpx

    resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise SystemExit(f"{url}/v1/models lists no model: pass --model")
    return str(data[0]["id"])


def run(args: argparse.Namespace) -> int:
    try:
        import httpx
    except ImportError:
        print("freetoken bench clients needs httpx: pip install httpx", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        model = args.model or _first_model(args.url, min(args.timeout, 30.0))
    except httpx.HTTPError as exc:
        print(f"cannot reach {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    runs = []
    for n in args.clients:
        records, wall = asyncio.run(_run_clients(args, model, n))
        runs.append(summarize(records, wall, n))
    result = {"url": args.url, "model": model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "requests_per_client": args.requests, "runs": runs}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.url} model {model}: prompts of {args.prompt_tokens} ids, {args.max_tokens} tokens each, "
              f"{args.requests} requests per user")
        print(f"{'users':>5} {'ok':>5} {'failed':>6} {'wall s':>8} {'agg tok/s':>10} {'user tok/s p50':>14} "
              f"{'ttft ms p50':>11} {'p99':>9} {'itl ms p50':>10} {'p99':>8}")

        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.1f}"

        for r in runs:
            print(f"{r['clients']:>5} {r['ok']:>5} {r['failed']:>6} {r['wall_s']:>8.2f} {f(r['aggregate_tok_s']):>10} "
                  f"{f(r['per_user_tok_s_p50']):>14} {f(r['ttft_ms_p50']):>11} {f(r['ttft_ms_p99']):>9} "
                  f"{f(r['itl_ms_p50']):>10} {f(r['itl_ms_p99']):>8}")
            for e in r["errors"]:
                print(f"      failed: {e}")
    return 1 if any(r["failed"] for r in runs) else 0

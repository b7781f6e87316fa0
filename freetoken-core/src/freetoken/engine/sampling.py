"""Turning a step's logits into tokens, per request.

Order (as vLLM/transformers): repetition penalty (prompt + output tokens),
presence/frequency penalties (output tokens), the request's logit bias, temperature,
top-k, top-p, min-p, then a draw from the request's own generator (seeded requests
are reproducible whatever else runs in the batch). Log-probabilities report the
model's distribution (log-softmax of the raw logits), independent of the sampling
knobs.

A request with a token constraint (:mod:`freetoken.engine.constraints`) that restricts
its next token has its disallowed tokens masked right after the penalties, before
temperature and the filters. Its log-probabilities are those of the distribution it was
actually drawn from before the knobs: the model's log-softmax renormalised over the allowed
tokens (``top_logprobs`` lists allowed tokens only). Unconstrained requests take
exactly the same path as before.

Where each request is sampled (:func:`sample`):

- a batch of plain greedy requests (:func:`plain_greedy`) is decided where the logits
  are, by argmax; only the token ids travel;
- on a device other than the CPU, plain sampled requests (:func:`plain_sampled`:
  temperature > 0, top-k allowed, nothing else) and the plain greedy ones beside them
  are drawn on that device with the Gumbel-max trick (:func:`gumbel_pick`), each from
  its own device generator (:func:`device_generator`), whatever else runs in the batch;
  their ids come back in one transfer (:func:`device_picks` gives the same picks as a
  device tensor, for a next step launched before they are read back);
- everything else (penalties, constraints, log-probabilities, top-p, min-p, and every
  request whose logits are on the CPU) is sampled on the host: its rows are copied
  there and drawn with ``torch.multinomial`` from the request's CPU generator.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from freetoken.engine.constraints import NoAllowedToken, TokenConstraint
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.request import Request
from freetoken.engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    out_counts: dict[int, int]) -> torch.Tensor:
    """Penalised copy of one row of logits (float32 [V]), the request's logit bias added
    (token ids beyond the row are left out)."""
    rep = params.repetition_penalty
    pres = params.presence_penalty
    freq = params.frequency_penalty
    if _trivial(params):
        return logits
    logits = logits.clone()
    V = logits.shape[0]
    if rep != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(out_counts)), dtype=torch.int64)
        seen = seen[seen < V]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if (pres != 0.0 or freq != 0.0) and out_counts:
        ids = torch.tensor(list(out_counts), dtype=torch.int64)
        cnt = torch.tensor([out_counts[i] for i in out_counts], dtype=torch.float32)
        keep = ids < V
        ids, cnt = ids[keep], cnt[keep]
        logits[ids] -= freq * cnt + pres * (cnt > 0).float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        keep = ids < V
        logits[ids[keep]] += bias[keep]
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from (float32 [V], sums to 1)."""
    x = logits / params.temperature
    V = x.shape[0]
    k = params.top_k
    if k is not None and 0 < k < V:
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the crossing token included)
        remove = (cum - sp) >= params.top_p
        remove[0] = False
        mask = torch.zeros_like(remove).scatter(0, si, remove)
        probs = probs.masked_fill(mask, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _logprob_entry(lp_row: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if n_top > 0:
        v, i = torch.topk(lp_row, min(n_top, lp_row.shape[0]))
        top = [(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist()) if b != float("-inf")]
    return TokenLogprob(token_id=token, logprob=float(lp_row[token]), top=top)


#: constrained greedy requests (no logprobs) test this many top candidates one by one
#: before asking the constraint for its full mask
GREEDY_CANDIDATES = 32


def _greedy_candidates(row: torch.Tensor, constraint: TokenConstraint, remaining: int) -> Optional[int]:
    """The best allowed token among the top candidates (ties: lowest id, as argmax), or None."""
    best = int(torch.argmax(row))
    if constraint.allows(best, remaining):
        return best
    vals, idx = torch.topk(row, min(GREEDY_CANDIDATES, row.shape[0]))
    cands = sorted(zip(vals.tolist(), idx.tolist()), key=lambda c: (-c[0], c[1]))
    complete = len(cands) == row.shape[0]
    for v, t in cands:
        if v == float("-inf"):
            return None
        if constraint.allows(t, remaining):
            # a value tied with the last candidate may hide a lower id outside the top-k
            return t if complete or v > cands[-1][0] else None
    return None


#: a constrained pick that ``allows`` rejects is redrawn without it at most this many
#: times before the constraint's fallback token is taken
MAX_REDRAWS = 16


def _pick(row: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(row))
    return int(torch.multinomial(sampling_probs(row, params), 1, generator=gen))


def constrained_pick(raw: torch.Tensor, row: torch.Tensor, params: SamplingParams, constraint: TokenConstraint,
                     remaining: int, gen: torch.Generator) -> tuple[int, Optional[TokenLogprob]]:
    """One token for a constrained request: ``raw`` is the model's row of logits,
    ``row`` the penalised one. Raises :class:`NoAllowedToken` if nothing is allowed.

    A pick from the mask that :meth:`~TokenConstraint.allows` rejects (a mask may hold
    more than the constraint allows) is dropped and the pick redrawn from the rest, so
    the result follows the distribution renormalised over the allowed tokens; after
    :data:`MAX_REDRAWS` rejections the constraint's fallback token is taken."""
    want_lp = params.logprobs or params.top_logprobs > 0
    if params.greedy and not want_lp:
        tok = _greedy_candidates(row, constraint, remaining)
        if tok is not None:
            return tok, None
    mask = constraint.allowed_mask(row.shape[0], remaining)
    if mask is not None:
        if not bool(mask.any()):
            raise NoAllowedToken("the request's constraint allows no token")
        row = row.masked_fill(~mask, float("-inf"))
    tok = _pick(row, params, gen)
    redraws = 0
    while not constraint.allows(tok, remaining):
        redraws += 1
        row = row.clone()
        row[tok] = float("-inf")
        if redraws > MAX_REDRAWS or not bool(torch.isfinite(row).any()):
            fallback = constraint.fallback_token(remaining)
            if fallback is None:
                raise NoAllowedToken("the request's constraint rejected every token it was offered")
            tok = fallback
            break
        tok = _pick(row, params, gen)
    lp = None
    if want_lp:
        masked_raw = raw if mask is None else raw.masked_fill(~mask, float("-inf"))
        lp = _logprob_entry(torch.log_softmax(masked_raw, dim=-1), tok, params.top_logprobs)
    return tok, lp


def _trivial(p: SamplingParams) -> bool:
    """No penalty and no logit bias: the logits are sampled as the model gave them."""
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not p.logit_bias)


def plain_greedy(r: Request) -> bool:
    """Whether ``r`` takes the largest logit as it is: greedy, with no penalty or logit
    bias, no constraint and no log-probabilities."""
    p = r.params
    return p.greedy and _trivial(p) and not r.constrained and not p.logprobs and p.top_logprobs == 0


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value of ``logits`` [B, V] (the first of equal ones;
    a NaN counts as the largest, as in torch). Float32 rows on the host go through numpy's
    vectorised argmax, about 10x faster than torch's over a 150k-token vocabulary on one
    thread (13 vs 145 us per row on the CPU machine); anything else is decided by torch
    where it lives, so only the ids travel."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def plain_sampled(r: Request) -> bool:
    """Whether ``r`` draws from softmax(logits / temperature), at most top-k filtered: a
    temperature above 0, no penalty or logit bias, no constraint, no log-probabilities,
    no top-p and no min-p."""
    p = r.params
    return (not p.greedy and _trivial(p) and not r.constrained and not p.logprobs and p.top_logprobs == 0
            and p.top_p == 1.0 and p.min_p == 0.0)


def draws_on_device(logits: torch.Tensor) -> bool:
    """Whether plain sampled rows of ``logits`` are drawn where they are (:func:`gumbel_pick`),
    not on the host: for logits off the CPU."""
    return logits.device.type != "cpu"


def device_rows(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """The rows of ``logits`` that :func:`sample` draws where the logits are, with
    :func:`gumbel_pick`: none for logits on the CPU or a batch without a plain sampled
    request (a plain greedy batch keeps its argmax path, anything else the host path),
    else every plain sampled and plain greedy row."""
    if not draws_on_device(logits) or not any(plain_sampled(r) for r in requests):
        return []
    return [i for i, r in enumerate(requests) if plain_sampled(r) or plain_greedy(r)]


def picked_on_device(logits: torch.Tensor, requests: Sequence[Request]) -> bool:
    """Whether :func:`sample` picks every row of ``logits`` where the logits are: every
    request plain greedy (argmax), or each plain greedy or plain sampled with
    :func:`draws_on_device` (:func:`gumbel_pick`)."""
    if all(plain_greedy(r) for r in requests):
        return True
    return draws_on_device(logits) and all(plain_greedy(r) or plain_sampled(r) for r in requests)


def device_picks(logits: torch.Tensor, requests: Sequence[Request], default_gen: torch.Generator) -> torch.Tensor:
    """The tokens :func:`sample` would pick for a batch :func:`picked_on_device` admits, as an
    int64 tensor where the logits are, without reading them back (the same argmax, or the same
    :func:`gumbel_pick` draws from the same generators in the same order)."""
    if not picked_on_device(logits, requests):
        raise ValueError("device_picks: a request of this batch is sampled on the host")
    if all(plain_greedy(r) for r in requests):
        return torch.argmax(logits, dim=-1)  # as argmax_rows: the first largest, a NaN the largest
    gens = [device_generator(r, logits.device, default_gen) if plain_sampled(r) else None for r in requests]
    return gumbel_picks(logits, [r.params.temperature for r in requests], [r.params.top_k for r in requests], gens)


#: a 63-bit seed, drawn from the request's (or the engine's) host generator
_SEED_BOUND = 2**63 - 1


def device_generator(r: Request, device: torch.device, default_gen: torch.Generator) -> torch.Generator:
    """``r``'s generator on ``device``, made at its first use and seeded with one 63-bit
    draw from its own host generator (``default_gen`` for a request without one), so a
    seeded request's device draws follow from its seed alone."""
    g = r.device_generator
    if g is None or g.device != device:
        src = r.generator if r.generator is not None else default_gen
        seed = int(torch.randint(0, _SEED_BOUND, (1,), generator=src))
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        r.device_generator = g
    return g


#: the uniform draws are kept inside [_U_MIN, _U_MAX] (float32): both logs of the Gumbel
#: noise -log(-log u) stay finite (u = 0 or 1 would give an infinite score)
_U_MIN = torch.finfo(torch.float32).tiny
_U_MAX = 1.0 - 2.0**-24


def gumbel_pick(rows: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``rows`` [B, V] (on any device), computed where the rows are;
    only the ids travel (one transfer): :func:`gumbel_picks` read back."""
    return gumbel_picks(rows, temperatures, top_ks, generators).tolist()


def gumbel_picks(rows: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``rows`` [B, V] (on any device), an int64 tensor where the rows
    are.

    A row with a temperature above 0 takes argmax(rows / T + G), G standard Gumbel noise
    (-log(-log u), u uniform from the row's generator, which lives on the rows' device),
    after the values below the k-th largest of rows / T are set to -inf (``top_ks[i]``
    between 1 and V - 1; ties with the k-th are kept, as :func:`sampling_probs`): exactly
    a draw from softmax(rows / T) over the kept tokens (the Gumbel-max trick; in float32,
    u's steps of 2**-24 keep the noise within about [-4.5, 16.6]: a token more than ~21
    nats below the best, under 1e-9 of its probability, is never drawn, and tokens of
    probability below ~1e-7 come slightly less often than they should). A row with
    temperature 0 takes its largest value (its generator may be None)."""
    B, V = rows.shape
    x = rows.float()
    sampled = [i for i in range(B) if temperatures[i] > 0]
    if not sampled:
        return torch.argmax(x, dim=-1)
    dev = x.device
    idx = None if len(sampled) == B else torch.tensor(sampled, dtype=torch.int64, device=dev)
    xs = x if idx is None else x.index_select(0, idx)
    temps = [float(temperatures[i]) for i in sampled]
    if all(t == temps[0] for t in temps):
        score = xs / temps[0]
    else:
        score = xs / torch.tensor(temps, dtype=torch.float32, device=dev)[:, None]
    u = torch.empty_like(score)
    for j, i in enumerate(sampled):
        k = top_ks[i]
        if k is not None and 0 < k < V:
            row = score[j]
            row.masked_fill_(row < torch.topk(row, k).values[-1], float("-inf"))
        u[j].uniform_(generator=generators[i])
    u.clamp_(_U_MIN, _U_MAX)
    score -= torch.log(-torch.log(u))  # + Gumbel noise (equivalently: - log of an Exponential(1) draw)
    picks = torch.argmax(score, dim=-1)
    if idx is not None:
        picks = torch.argmax(x, dim=-1).index_copy_(0, idx, picks)
    return picks


def sample(logits: torch.Tensor, requests: list[Request], default_gen: torch.Generator) -> list[tuple[int, Optional[TokenLogprob]]]:
    """One token (and its log-probability if asked) per row of ``logits`` [B, V] (on any
    device). A constrained request whose constraint allows nothing gets token -1.

    A batch of plain greedy requests is decided where the logits are (only the token ids
    travel). On a device other than the CPU, the plain sampled requests and the plain
    greedy ones beside them are drawn there too (:func:`device_rows`,
    :func:`gumbel_pick`); anything else is sampled on the host."""
    if all(plain_greedy(r) for r in requests):
        return [(int(t), None) for t in argmax_rows(logits)]
    rows = device_rows(logits, requests)
    if not rows:
        return _sample_host(logits, requests, default_gen)
    reqs = [requests[i] for i in rows]
    gens = [device_generator(r, logits.device, default_gen) if plain_sampled(r) else None for r in reqs]
    picks = gumbel_pick(logits if len(rows) == len(requests) else logits[rows],
                        [r.params.temperature for r in reqs], [r.params.top_k for r in reqs], gens)
    if len(rows) == len(requests):
        return [(t, None) for t in picks]
    on_device = set(rows)
    rest = [i for i in range(len(requests)) if i not in on_device]
    out: list[tuple[int, TokenLogprob | None]] = [(-1, None)] * len(requests)
    for i, t in zip(rows, picks):
        out[i] = (t, None)
    for i, picked in zip(rest, _sample_host(logits[rest], [requests[i] for i in rest], default_gen)):
        out[i] = picked
    return out


def _sample_host(logits: torch.Tensor, requests: list[Request],
                 default_gen: torch.Generator) -> list[tuple[int, TokenLogprob | None]]:
    """:func:`sample` on the host: ``logits`` are copied there as float32."""
    B = logits.shape[0]
    logits = logits.float().cpu()
    tokens: list[Optional[int]] = [None] * B
    done_lp: dict[int, Optional[TokenLogprob]] = {}  # constrained rows: their own log-probabilities
    fast = [i for i, r in enumerate(requests) if r.params.greedy and _trivial(r.params) and not r.constrained]
    if fast:
        if len(fast) == B:
            tokens = list(argmax_rows(logits))
        else:
            am = argmax_rows(logits[fast])
            for i, t in zip(fast, am):
                tokens[i] = t
    for i, r in enumerate(requests):
        if tokens[i] is not None:
            continue
        p = r.params
        row = apply_penalties(logits[i], p, r.prompt_ids, r.out_counts)
        g = r.generator if r.generator is not None else default_gen
        if r.constrained:
            assert r.constraint is not None
            try:
                tokens[i], done_lp[i] = constrained_pick(logits[i], row, p, r.constraint, r.max_new - len(r.output_ids), g)
            except NoAllowedToken:
                tokens[i], done_lp[i] = -1, None
            continue
        if p.greedy:
            tokens[i] = int(torch.argmax(row))
            continue
        probs = sampling_probs(row, p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=g))
    out: list[tuple[int, Optional[TokenLogprob]]] = []
    need_lp = [i for i, r in enumerate(requests)
               if (r.params.logprobs or r.params.top_logprobs > 0) and i not in done_lp]
    lps = torch.log_softmax(logits[need_lp], dim=-1) if need_lp else None
    j = 0
    for i, r in enumerate(requests):
        tok = int(tokens[i])  # type: ignore[arg-type]
        lp = done_lp.get(i)
        if lps is not None and j < len(need_lp) and need_lp[j] == i:
            lp = _logprob_entry(lps[j], tok, r.params.top_logprobs)
            j += 1
        out.append((tok, lp))
    return out

"""Per-request token constraints: which tokens a request may sample next.

A constraint is a small stateful object attached to one request
(``LLMEngine.add_request(..., constraint=...)``, ``AsyncEngine.stream(..., constraint=...)``).
The sampler (:func:`freetoken.engine.sampling.sample`) consults it at every step of
that request, after the penalties and before temperature / top-k / top-p / min-p:

* greedy requests that do not ask for log-probabilities test candidates one at a
  time in descending (penalised) logit order with :meth:`TokenConstraint.allows`
  and take the first allowed one; only when none of the first
  ``GREEDY_CANDIDATES`` is allowed is the full mask built;
* every other constrained request gets the full mask from
  :meth:`TokenConstraint.allowed_mask`; disallowed logits become ``-inf``, so
  greedy is the best allowed token and sampling draws from the distribution
  renormalised over the allowed tokens (the knobs then act on that distribution).
  The mask may hold tokens :meth:`TokenConstraint.allows` rejects (when the exact set
  is too costly to build, e.g. "does the output still close within the budget after
  this token"): the pick is checked with ``allows`` and redrawn without a rejected
  token; after a few rejections :meth:`TokenConstraint.fallback_token` is taken.

After a token is drawn the engine calls :meth:`TokenConstraint.advance`; when
:meth:`TokenConstraint.is_complete` turns true the request finishes with
``finish_reason`` "stop". ``remaining`` (passed to both queries) is how many tokens
the request may still generate, this one included, so a constraint can keep its
output closable within ``max_tokens``.

Requests without a constraint never reach any of this (same code path, same cost), nor
do requests whose constraint says it does not restrict the next token
(:meth:`TokenConstraint.restricts` false: a budget that is not spent yet); those are
sampled as unconstrained ones, where the logits are, and only :meth:`TokenConstraint.advance`
sees their tokens.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch


class NoAllowedToken(RuntimeError):
    """A constraint allowed no token at all; its request finishes with "error"."""


@runtime_checkable
class TokenConstraint(Protocol):
    """What the engine needs from a per-request constraint."""

    def restricts(self) -> bool:
        """Whether the next token is restricted at all; False: every token is allowed, and
        the request is sampled as an unconstrained one (:meth:`advance` still sees it)."""
        return True

    def allows(self, token_id: int, remaining: int) -> bool:
        """Whether ``token_id`` may come next (cheap; used for greedy candidates)."""
        ...

    def allowed_mask(self, vocab_size: int, remaining: int) -> Optional[torch.Tensor]:
        """BoolTensor ``[vocab_size]`` of the tokens that may come next (None: all):
        every token :meth:`allows` accepts, and possibly some it rejects."""
        ...

    def fallback_token(self, remaining: int) -> Optional[int]:
        """A token :meth:`allows` accepts, taken when picks from the mask keep being
        rejected (None: the mask is exact, so this is never needed)."""
        ...

    def advance(self, token_id: int) -> None:
        """Record the token that was sampled (always one the constraint allowed)."""
        ...

    def is_complete(self) -> bool:
        """True once the output is complete: the request then stops."""
        ...

"""The shortest way to finish an llguidance document: how many tokens an output still
needs before it is complete, so a schema-constrained choice can end as valid JSON
within ``max_tokens`` (:class:`freetoken.server.schema_constraint.SchemaConstraint`).

From a matcher state, :func:`closing_tokens` writes the document to its end: text the
grammar forces (a property name, the markup after a tool call's arguments) as the
tokens llguidance splits it into (the only ones its mask allows there), anything else
one byte at a time with the single-byte tokens, always taking the first byte of
:data:`CLOSING_ORDER` the grammar accepts (a closing quote or bracket before
anything else, then the shortest values: ``0``, ``""``, ``null``, then any printable
character for text the grammar forces, such as a required property name), and ends
with EOS where the grammar accepts the document but could go on (a top-level number).
The walk is deterministic, so the walk from the state after its first token is the
rest of the same walk: forcing its first token at every step writes exactly the
closing it measured. Its length is an upper bound of the shortest closing (one token
per byte; a value such as ``0`` may be shorter than the one a type forces), found in
microseconds per byte (``validate_tokens`` on a copy of the matcher).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Optional

#: the order in which the walk tries bytes: closers, short values, then every other
#: printable ASCII character and whitespace (for property names, patterns, markup)
CLOSING_ORDER: bytes = (
    b'"}]0,:' + b"123456789" + b"nulltruefalse-.eE"
    + string.ascii_letters.encode() + string.punctuation.encode() + b" \n\t"
)

#: a walk longer than this many bytes gives up (the closing is then unknown)
MAX_CLOSING = 512


@dataclasses.dataclass(frozen=True)
class ClosingWalk:
    """How :func:`closing_tokens` walks a grammar: the order it tries bytes in (None:
    :data:`CLOSING_ORDER`) and whether it steps out of free text's loops (``skip_loops``)."""

    order: Optional[bytes] = None
    skip_loops: bool = False


def candidate_tokens(token_bytes: list[bytes], special: set[int], order: bytes = CLOSING_ORDER) -> list[int]:
    """The single-byte token of each byte of ``order`` that has one, in that order."""
    by_byte: dict[int, int] = {}
    for i, b in enumerate(token_bytes):
        if len(b) == 1 and i not in special and b[0] not in by_byte:
            by_byte[b[0]] = i
    seen: set[int] = set()
    out = []
    for b in order:
        if b in by_byte and b not in seen:
            seen.add(b)
            out.append(by_byte[b])
    return out


def still_closes(matcher: Any, closing: list[int], eos: int) -> bool:
    """Whether ``closing`` (a closing found from an earlier state) also finishes the
    document from ``matcher``'s state: one ``validate_tokens`` call, much cheaper than a walk."""
    return still_closes_after(matcher, None, closing, eos)


def still_closes_after(matcher: Any, token: Optional[int], closing: list[int], eos: int) -> bool:
    """Whether ``token`` (None: nothing) then ``closing`` finish the document from
    ``matcher``'s state (left unchanged)."""
    body = ([] if token is None else [token]) + (closing[:-1] if closing and closing[-1] == eos else closing)
    return matcher.validate_tokens(body + [eos]) == len(body) + 1


def _accepted(matcher: Any, candidates: list[int]) -> list[int]:
    return [tok for tok in candidates if matcher.validate_tokens([tok]) == 1]


def _leaves_the_loop(matcher: Any, tok: int, accepted: list[int], candidates: list[int]) -> bool:
    """Whether taking ``tok`` changes what can follow: text is then forced, the document
    may end, or another set of candidates is accepted. Inside free text (a regular
    expression's star) a character leads back to the same state, so none of these holds."""
    m = matcher.deep_copy()
    m.consume_token(tok)
    return m.is_accepting() or bool(m.compute_ff_tokens()) or _accepted(m, candidates) != accepted


def closing_tokens(matcher: Any, candidates: list[int], eos: int, limit: int = MAX_CLOSING,
                   skip_loops: bool = False) -> Optional[list[int]]:  # fmt: skip
    """The tokens that finish the document from ``matcher``'s state (left unchanged): the
    walk described above; an EOS last if the grammar needs one to end. None when the
    walk finds no way to finish within ``limit`` bytes (or the matcher is in error).

    ``skip_loops``: for grammars with free text that ends at a byte late in the order (a
    tool call's bare string arguments, ended by ``<``), the walk takes the first accepted
    byte that leaves the text's loop (:func:`_leaves_the_loop`), and only if none does the
    first accepted one; a choice that depends only on the state, so the walk stays
    deterministic. It costs a matcher copy and a pass over the candidates per byte tried."""
    if matcher.is_error():
        return None
    m = matcher.deep_copy()
    out: list[int] = []
    while not m.is_stopped():
        if m.is_accepting():
            out.append(eos)
            return out
        if len(out) >= limit:
            return None
        forced = m.compute_ff_tokens()
        if forced:  # text only one way on: its tokens as llguidance splits it (all the mask allows)
            m.consume_tokens(forced)
            out.extend(forced)
            continue
        if skip_loops:
            accepted = _accepted(m, candidates)
            if not accepted:
                return None
            tok = next((t for t in accepted if _leaves_the_loop(m, t, accepted, candidates)), accepted[0])
            m.consume_token(tok)
            out.append(tok)
            continue
        for tok in candidates:
            if m.validate_tokens([tok]) == 1:
                m.consume_token(tok)
                out.append(tok)
                break
        else:
            return None
    return out

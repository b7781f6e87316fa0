"""A character-level JSON automaton for ``response_format: {"type": "json_object"}``.

States are small immutable tuples, so trying a token from a state costs nothing to
undo. The grammar is RFC 8259 JSON whose top level is an object, with two
restrictions that keep sampling from wandering: no whitespace before the opening
``{`` and never two whitespace characters in a row outside strings. Container depth
is capped (:data:`MAX_DEPTH`), so the shortest way to close a document from any
state (:func:`closing`) is short and always known.
"""

from __future__ import annotations

from typing import Optional

MAX_DEPTH = 24

# modes
TOP, OBJ_FIRST, OBJ_KEY, COLON, VALUE, ARR_FIRST, AFTER, STR, ESC, UHEX = range(10)
NUM_SIGN, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_E, NUM_ESIGN, NUM_EXP, LIT, DONE = range(10, 20)

#: (mode, container stack such as "{[", extra, previous char was whitespace)
#: extra: STR/ESC/UHEX -> (is_key, hex digits left); LIT -> the literal's remaining characters.
State = tuple[int, str, object, bool]

START: State = (TOP, "", None, False)
_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_NUM_END_OK = (NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP)
_WS_OK = (OBJ_FIRST, OBJ_KEY, COLON, VALUE, ARR_FIRST, AFTER)


def _value_done(stack: str, ws: bool = False) -> State:
    return (DONE, "", None, False) if not stack else (AFTER, stack, None, ws)


def _start_value(stack: str, ch: str) -> Optional[State]:
    if ch == '"':
        return (STR, stack, (False, 0), False)
    if ch in "{[":
        if len(stack) >= MAX_DEPTH:
            return None
        return (OBJ_FIRST if ch == "{" else ARR_FIRST, stack + ch, None, False)
    if ch == "-":
        return (NUM_SIGN, stack, None, False)
    if ch == "0":
        return (NUM_ZERO, stack, None, False)
    if ch in "123456789":
        return (NUM_INT, stack, None, False)
    if ch == "t":
        return (LIT, stack, "rue", False)
    if ch == "f":
        return (LIT, stack, "alse", False)
    if ch == "n":
        return (LIT, stack, "ull", False)
    return None


def _close(stack: str, ch: str) -> Optional[State]:
    if not stack or stack[-1] != ("{" if ch == "}" else "["):
        return None
    return _value_done(stack[:-1])


def step(state: State, ch: str) -> Optional[State]:
    """The state after ``ch``, or None if ``ch`` cannot come next."""
    mode, stack, extra, ws = state
    if mode == STR:
        is_key = extra[0]  # type: ignore[index]
        if ch == '"':
            return (COLON, stack, None, False) if is_key else _value_done(stack)
        if ch == "\\":
            return (ESC, stack, (is_key, 0), False)
        if ord(ch) < 0x20:
            return None
        return state
    if mode == ESC:
        is_key = extra[0]  # type: ignore[index]
        if ch in '"\\/bfnrt':
            return (STR, stack, (is_key, 0), False)
        if ch == "u":
            return (UHEX, stack, (is_key, 4), False)
        return None
    if mode == UHEX:
        is_key, left = extra  # type: ignore[misc]
        if ch not in _HEX:
            return None
        return (STR, stack, (is_key, 0), False) if left == 1 else (UHEX, stack, (is_key, left - 1), False)
    if mode == LIT:
        rest = str(extra)
        if ch != rest[0]:
            return None
        return _value_done(stack) if len(rest) == 1 else (LIT, stack, rest[1:], False)
    if mode >= NUM_SIGN and mode <= NUM_EXP:
        nxt = _number_step(mode, ch)
        if nxt is not None:
            return (nxt, stack, None, False)
        if mode in _NUM_END_OK:  # the number ended; the character belongs to what follows
            return step(_value_done(stack), ch)
        return None
    if ch in _WS:
        if mode in _WS_OK and not ws:
            return (mode, stack, extra, True)
        return None
    if mode == TOP:
        return (OBJ_FIRST, "{", None, False) if ch == "{" else None
    if mode == OBJ_FIRST:
        if ch == '"':
            return (STR, stack, (True, 0), False)
        return _close(stack, ch) if ch == "}" else None
    if mode == OBJ_KEY:
        return (STR, stack, (True, 0), False) if ch == '"' else None
    if mode == COLON:
        return (VALUE, stack, None, False) if ch == ":" else None
    if mode == VALUE:
        return _start_value(stack, ch)
    if mode == ARR_FIRST:
        if ch == "]":
            return _close(stack, ch)
        return _start_value(stack, ch)
    if mode == AFTER:
        if ch == ",":
            return (OBJ_KEY if stack[-1] == "{" else VALUE, stack, None, False)
        if ch in "}]":
            return _close(stack, ch)
        return None
    return None  # DONE: nothing may follow


def _number_step(mode: int, ch: str) -> Optional[int]:
    digit = ch in _DIGITS
    if mode == NUM_SIGN:
        return NUM_ZERO if ch == "0" else (NUM_INT if digit else None)
    if mode == NUM_ZERO:
        return NUM_DOT if ch == "." else (NUM_E if ch in "eE" else None)
    if mode == NUM_INT:
        return NUM_INT if digit else (NUM_DOT if ch == "." else (NUM_E if ch in "eE" else None))
    if mode == NUM_DOT:
        return NUM_FRAC if digit else None
    if mode == NUM_FRAC:
        return NUM_FRAC if digit else (NUM_E if ch in "eE" else None)
    if mode == NUM_E:
        return NUM_ESIGN if ch in "+-" else (NUM_EXP if digit else None)
    if mode in (NUM_ESIGN, NUM_EXP):
        return NUM_EXP if digit else None
    return None


def feed(state: State, text: str) -> Optional[State]:
    for ch in text:
        nxt = step(state, ch)
        if nxt is None:
            return None
        state = nxt
    return state


def _closing_char(state: State) -> str:
    mode, stack, extra, _ = state
    if mode == TOP:
        return "{"
    if mode == STR:
        return '"'
    if mode == ESC:
        return "n"
    if mode == UHEX:
        return "0"
    if mode == LIT:
        return str(extra)[0]
    if mode in (NUM_SIGN, NUM_DOT):
        return "0"
    if mode in (NUM_E, NUM_ESIGN):
        return "1"
    if mode == OBJ_FIRST:
        return "}"
    if mode == OBJ_KEY:
        return '"'
    if mode == COLON:
        return ":"
    if mode == VALUE:
        return "0"
    if mode == ARR_FIRST:
        return "]"
    # AFTER, or a number that may end here
    return "}" if stack[-1] == "{" else "]"


def closing(state: State) -> str:
    """The shortest text that completes the document from ``state``."""
    out = []
    while state[0] != DONE:
        ch = _closing_char(state)
        nxt = step(state, ch)
        assert nxt is not None, (state, ch)
        state = nxt
        out.append(ch)
    return "".join(out)


def is_done(state: State) -> bool:
    return state[0] == DONE

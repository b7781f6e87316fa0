"""The JSON automaton behind json_object mode: it accepts exactly JSON objects (checked
against the standard library's parser) and can close any valid prefix."""

from __future__ import annotations

import json
import random

from freetoken.server import json_grammar as g


def _random_value(rng: random.Random, depth: int) -> object:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e6, 1e6) * rng.choice([1, 1e-9, 1e12])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\\n\t/é€\u0001') for _ in range(rng.randrange(6)))
    if kind in (5, 6):
        return {"k" + str(i) + rng.choice(["", '"', "é"]): _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _accepts(text: str) -> bool:
    state = g.feed(g.START, text)
    return state is not None and g.is_done(state)


def test_accepts_serialized_objects_and_closes_every_prefix() -> None:
    rng = random.Random(0)
    for i in range(300):
        obj = {"root": _random_value(rng, 0), "n": i}
        for text in (json.dumps(obj), json.dumps(obj, separators=(",", ":")), json.dumps(obj, ensure_ascii=False)):
            assert _accepts(text), text
            # every prefix can be completed into JSON that parses to an object
            for cut in range(0, len(text), max(1, len(text) // 7)):
                state = g.feed(g.START, text[:cut])
                assert state is not None
                completed = text[:cut] + g.closing(state)
                assert isinstance(json.loads(completed), dict), completed


def test_rejects_what_the_standard_parser_rejects() -> None:
    for text in ['[1]', '"s"', '1', ' {}', '{,}', '{"a"}', '{"a":}', '{"a":1,}', '{"a":01}', '{"a":1.}',
                 '{"a":-}', '{"a":tru}', '{"a":"\x01"}', '{"a":"\\x"}', '{"a":[1,]}', '{"a":1}}', '{}x',
                 '{"a":1]', '{"a":"\\u12g4"}', '{  "a":1}', '{"a":1e}']:
        state = g.feed(g.START, text)
        assert state is None or not g.is_done(state), text
        try:
            ok = isinstance(json.loads(text), dict) and not text.startswith(" ") and "  " not in text
        except ValueError:
            ok = False
        assert not ok, text
    assert _accepts('{"a": [1, -0.5e+3, true, null, {"b": "\\u00e9"}], "c": {}}')

"""Helpers shared by the server tests: SSE framing, metrics parsing, error bodies."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_sse(body: str) -> list[Any]:
    """Strict SSE framing: events separated by a blank line, each a single ``data:`` line.
    Returns the decoded JSON payloads; the final ``[DONE]`` is returned as the string."""
    assert body.endswith("\n\n"), f"stream does not end with a blank line: {body[-80:]!r}"
    events = body.split("\n\n")[:-1]
    out: list[Any] = []
    for raw in events:
        assert raw.startswith("data: "), f"bad SSE event {raw!r}"
        assert "\n" not in raw, f"multi-line SSE event {raw!r}"
        data = raw[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out and out[-1] == "[DONE]", "stream must end with data: [DONE]"
    assert "[DONE]" not in out[:-1]
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object with the given status (and ``param`` when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def scrape(base_url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET /metrics parsed by prometheus_client: {sample name: {sorted labels: value}}."""
    resp = httpx.get(base_url + "/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def metric(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    key = tuple(sorted(labels.items()))
    return metrics.get(name, {}).get(key, 0.0)

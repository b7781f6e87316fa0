"""The HTTP server on a GPU backend, end to end (run on the GPU machine).

A real ``freetoken serve --backend cuda`` process (uvicorn) serves the built-in demo model
(random weights) for two expert placements: every MoE layer's experts on the CPU
(``--moe-cpu-layers all``: the hand-off on its qualified IO path) and every layer's on the
GPU (``0``: no hand-off). Through the official ``openai`` client: a chat completion, a
streamed one equal to it (greedy), a completion, 4 concurrent requests, a 400 after which
the server still answers; /health and /metrics show the backend's startup decision.

The backend comes from ``FREETOKEN_TEST_GPU_BACKEND`` (default ``cuda``). For ``cuda`` and
``rocm`` the module is marked ``gpu`` and skipped without a GPU; any other backend name
(``fakegpu``, the simulated GPU plugin) runs it on this machine, to check the test itself:
``FREETOKEN_TEST_GPU_BACKEND=fakegpu pytest tests/gpu/test_gpu_server.py``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import httpx
import pytest

BACKEND = os.environ.get("FREETOKEN_TEST_GPU_BACKEND", "cuda")
GPU_BACKENDS = ("cuda", "rocm")
HANDOFF_PATHS = ("kernel_io", "copy", "host_callback")
#: The first start compiles the Triton kernels and captures the decode graphs.
STARTUP_TIMEOUT_S = float(os.environ.get("FREETOKEN_TEST_SERVER_STARTUP_S", "600"))
_LISTEN_RE = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")

pytestmark = [pytest.mark.timeout(STARTUP_TIMEOUT_S + 300)]
if BACKEND in GPU_BACKENDS:
    pytestmark.append(pytest.mark.gpu)

openai = pytest.importorskip("openai")


class Server:
    """One ``freetoken serve`` subprocess on loopback, its log collected."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "freetoken.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.port: Optional[int] = None
        self._port_found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _LISTEN_RE.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_found.set()
        self._port_found.set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return "\n".join(list(self.lines))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        if not self._port_found.wait(STARTUP_TIMEOUT_S) or self.port is None:
            self.stop()
            raise RuntimeError(f"the server did not report its port; log:\n{self.log()}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; log:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {STARTUP_TIMEOUT_S} s; log:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return int(self.proc.returncode)


@pytest.fixture(scope="module", params=["all", "0"], ids=["experts-on-cpu", "experts-on-gpu"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Server, str]]:
    installed = {ep.name for ep in importlib.metadata.entry_points(group="freetoken.backends")}
    if BACKEND not in installed:
        pytest.skip(f"backend plugin {BACKEND!r} is not installed (installed: {', '.join(sorted(installed))})")
    placement = request.param
    srv = Server(["--backend", BACKEND, "--moe-cpu-layers", placement])
    srv.wait_ready()
    yield srv, placement
    code = srv.stop()
    assert code == 0, f"the server exited with {code} on SIGINT; log tail:\n{srv.log()[-3000:]}"
    assert "server stopped" in srv.log()


@pytest.fixture(scope="module")
def client(server: tuple[Server, str]) -> Any:
    return openai.OpenAI(base_url=server[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return client.models.list().data[0].id


def _scrape(base_url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(base_url + "/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _greedy_chat(client: Any, model: str, content: str, max_tokens: int = 16, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}, **kw,
    )


def test_health_shows_backend_and_decision(server: tuple[Server, str]) -> None:
    srv, placement = server
    body = httpx.get(srv.base_url + "/health", timeout=30).json()
    assert body["status"] == "ok" and body["backend"] == BACKEND
    assert isinstance(body["graphs"], bool) and body["reason"]
    assert isinstance(body["warnings"], list) and isinstance(body["act_dtype"], str)
    if placement == "all":
        assert body["io_path"] in HANDOFF_PATHS and body["sync_mode"]
        assert body["moe_gpu_layers"] == 0 and body["moe_cpu_layers"] != "none"
    else:
        assert body["io_path"] == "none" and body["moe_cpu_layers"] == "none" and body["moe_gpu_layers"] > 0
        assert "no hand-off" in body["reason"]
    if body["graphs"]:
        assert body["graph_batch_sizes"] and 1 in body["graph_batch_sizes"]
    else:
        assert "graph_batch_sizes" not in body
    if BACKEND in GPU_BACKENDS:
        # decode graphs run wherever the startup check allows them; turning them off always warns
        assert body["graphs"] or body["warnings"], body
    log = srv.log()
    assert f"backend {BACKEND}, IO path {body['io_path']}" in log
    for warning in body["warnings"]:
        assert f"startup check: {warning}" in log


def test_chat_stream_equals_greedy_chat(client: Any, model: str) -> None:
    full = _greedy_chat(client, model, "Count from one to five.")
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 16
    assert isinstance(choice.message.content, str) and choice.message.content
    stream = _greedy_chat(client, model, "Count from one to five.", stream=True,
                          stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_completion(client: Any, model: str) -> None:
    outs = [client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    for out in outs:
        assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 8 and isinstance(out.choices[0].text, str)
    assert outs[0].choices[0].text == outs[1].choices[0].text  # greedy, alone: the same text


def test_four_concurrent_requests(server: tuple[Server, str], client: Any, model: str) -> None:
    before = _scrape(server[0].base_url).get("freetoken_engine_requests_total", {}).get((), 0.0)
    prompts = [f"Tell me a story about the number {i}." for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: _greedy_chat(client, model, p, max_tokens=24), prompts))
    for out in outs:
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 24
        assert out.choices[0].message.content
    after = _scrape(server[0].base_url)["freetoken_engine_requests_total"][()]
    assert after - before == 4


def test_bad_request_is_400_and_the_server_still_answers(client: Any, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    assert bad.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as too_long:
        _greedy_chat(client, model, "hello", max_tokens=10**7)
    assert too_long.value.status_code == 400
    after = _greedy_chat(client, model, "Still there?", max_tokens=4)
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 4


def test_metrics_show_backend_info(server: tuple[Server, str], client: Any, model: str) -> None:
    srv, placement = server
    _greedy_chat(client, model, "Warm the step timings up.", max_tokens=8)
    health = httpx.get(srv.base_url + "/health", timeout=30).json()
    metrics = _scrape(srv.base_url)
    (labels,) = [dict(key) for key in metrics["freetoken_backend_info"]]
    assert metrics["freetoken_backend_info"][tuple(sorted(labels.items()))] == 1.0
    assert labels["backend"] == BACKEND and labels["io_path"] == health["io_path"]
    assert labels["graphs"] == ("true" if health["graphs"] else "false")
    assert labels["sync_mode"] == (health["sync_mode"] or "none")
    assert labels["act_dtype"] == health["act_dtype"] and labels["moe_cpu_layers"] == health["moe_cpu_layers"]
    assert metrics["freetoken_moe_gpu_layers"][()] == health["moe_gpu_layers"]
    if placement == "all":
        assert 0.0 <= metrics["freetoken_cpu_wait_share"][()] <= 1.0
        assert metrics["freetoken_step_breakdown_decode_step_seconds"][()] > 0
    if BACKEND in GPU_BACKENDS:
        allocated = metrics["freetoken_gpu_memory_allocated_bytes"][()]
        assert 0 < allocated <= metrics["freetoken_gpu_memory_reserved_bytes"][()]
        assert metrics["freetoken_gpu_memory_budget_bytes"][()] >= allocated

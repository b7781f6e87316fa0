"""A real ``freetoken serve`` process on loopback, serving the built-in demo model.

Each test module starts its own server (module-scoped fixture) with the options it
needs; the process is asked for a free port (``--port 0``) and the test reads the
port from the startup log. The server's log is collected so tests can check what
it says (startup lines, logged tracebacks, clean shutdown).
"""

from __future__ import annotations

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

STARTUP_TIMEOUT_S = float(os.environ.get("FREETOKEN_TEST_SERVER_STARTUP_S", "240"))
_LISTEN_RE = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    """One running ``freetoken serve`` subprocess."""

    def __init__(self, args: list[str], env_extra: Optional[dict[str, str]] = None) -> None:
        env = dict(os.environ)
        env.update(env_extra or {})
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.cmd = [sys.executable, "-m", "freetoken.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._port_found = threading.Event()
        self.port: Optional[int] = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.health_seen: list[int] = []
        self.loading_answers: list[tuple[int, Any]] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
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
        with self._lock:
            return "\n".join(self.lines)

    def wait_log(self, *needles: str, timeout: float = 10.0) -> str:
        """The log once it contains every one of ``needles`` (a reader thread collects the
        server's output, so a line written just now may not be there yet)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        if not self._port_found.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError(f"server did not report its port; log:\n{self.log()}")
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{self.log()}")
                try:
                    status = client.get(self.base_url + "/health").status_code
                except httpx.TransportError:
                    status = -1
                self.health_seen.append(status)
                if status == 200:
                    return
                if status == 503 and len(self.loading_answers) < 5:  # what /v1 says meanwhile
                    try:
                        resp = client.get(self.base_url + "/v1/models")
                        self.loading_answers.append((resp.status_code, resp.json()))
                    except (httpx.TransportError, ValueError):
                        pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s; log:\n{self.log()}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        """Send ``sig`` (once) and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return int(self.proc.returncode)


def start_server(args: list[str] | None = None, env: Optional[dict[str, str]] = None) -> ServerProcess:
    server = ServerProcess(list(args or []), env)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server_factory() -> Iterator[object]:
    """Start servers with module-specific options; all are stopped (SIGINT) at module end."""
    started: list[ServerProcess] = []

    def factory(args: list[str] | None = None, env: Optional[dict[str, str]] = None) -> ServerProcess:
        srv = start_server(args, env)
        started.append(srv)
        return srv

    yield factory
    codes = [(srv.stop(), srv) for srv in started]
    for code, srv in codes:  # Ctrl-C (SIGINT) is a clean shutdown
        assert code == 0, f"server exited with {code} on SIGINT; log tail:\n{srv.log()[-3000:]}"
        assert "server stopped" in srv.wait_log("server stopped")


@pytest.fixture(scope="session")
def ref_tokenizer() -> Any:
    """An independent tokenizer for usage counts: HF transformers reading the demo model's
    tokenizer.json / tokenizer_config.json (chat template included)."""
    import transformers

    from freetoken.models.demo import ensure_demo_model

    return transformers.AutoTokenizer.from_pretrained(ensure_demo_model().hf_dir)

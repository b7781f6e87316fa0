"""response_format {"type": "json_object"} (placeholder while the engine hook is settled)."""

from __future__ import annotations

from typing import Any


class JsonModeChecker:
    @staticmethod
    def prepare(job: Any, engine: Any) -> Any:
        return job

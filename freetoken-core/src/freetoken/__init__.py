"""FreeToken: big Mixture-of-Experts models on one consumer GPU plus the host CPU.

``import freetoken`` is cheap and never fails because of a backend plugin: plugins
are discovered lazily on first use (see :mod:`freetoken.backends.registry`).
"""

from __future__ import annotations

import os
from typing import Any

from freetoken._version import __version__

__all__ = ["__version__", "get_include", "LLM", "SamplingParams"]


def get_include() -> str:
    """Directory holding ``freetoken/handoff.h`` (the shared C layouts).

    Native packages add it to their include path at build time, the way numpy's
    and pybind11's ``get_include()`` are used.
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def __getattr__(name: str) -> Any:
    # Lazy: the engine pulls in torch and the model code; keep `import freetoken` light.
    if name == "LLM":
        from freetoken.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from freetoken.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")

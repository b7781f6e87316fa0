"""What a step that ran out of memory does to its requests.

The step's largest request (the most tokens computed in the step, then the longest
context: the one whose activations, attention and KV the step's peak grows with) fails
with an ``out_of_memory`` error that names the sizes and the options bounding them. Every
other request of the step is preempted: its blocks go back and it is recomputed later from
its tokens, mostly out of the prefix cache. Requests outside the step are untouched. Each
such step takes one request out, so failures cannot repeat without end.
"""

from __future__ import annotations

from typing import Any, Sequence

from freetoken.backends.contract import on_gpu
from freetoken.engine.outputs import RequestError


def largest(batch: Sequence[Any]) -> Any:
    """The scheduled entry of ``batch`` that fails: most tokens in the step, then the
    longest context, then the first."""
    return max(batch, key=lambda s: (s.num_tokens, s.request.num_computed + s.num_tokens))


def out_of_memory_error(scheduled: Any, device: Any, reason: str, prefill_chunk: int, max_model_len: int) -> RequestError:
    """The error the failing request gets (``reason``: the allocator's message, first line)."""
    req = scheduled.request
    context = req.num_computed + scheduled.num_tokens
    where = "GPU" if on_gpu(device) else "host"
    return RequestError(
        code="out_of_memory",
        message=(
            f"The {where} ran out of memory in the step computing {scheduled.num_tokens} tokens of this request "
            f"(context {context} tokens): {reason}. Other requests are not affected. A shorter prompt may fit; "
            f"the server's operator can lower --prefill-chunk (now {prefill_chunk}) or --max-model-len (now "
            f"{max_model_len}), or give the model more memory (--gpu-memory-limit, --moe-cpu-layers)."
        ),
    )

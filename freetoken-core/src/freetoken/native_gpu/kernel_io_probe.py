"""The KernelIO startup probe: publish/combine round trips on random data.

A Python thread stands in for the CPU workers (it sees ``ready``, clears it, writes
``y = 2 * x`` in float32 and release-stores ``done``), so the probe needs no expert
kernels. Checked exactly against torch: the published x/ids/w, the combined
``out + 2x`` (one BF16 rounding, like the kernel), the empty-route skip (the CPU is
not woken and ``out`` is unchanged), and the same through a captured graph replayed
with new inputs (the flag must not move during capture).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from freetoken import handoff


class _FakeCpuSide(threading.Thread):
    """Serves one task's flag slot like the coordinator would, with y = 2 * x."""

    def __init__(self, task: Any) -> None:
        super().__init__(daemon=True, name="freetoken-kio-probe")
        self.task = task
        self.stop = threading.Event()
        self.served = 0
        self.seen: list[tuple[Any, Any]] = []

    def run(self) -> None:
        import torch

        ready = ctypes.c_uint64.from_address(self.task.flag_addr + handoff.FlagSlot.ready.offset)
        done = ctypes.c_uint64.from_address(self.task.flag_addr + handoff.FlagSlot.done.offset)
        while not self.stop.is_set():
            if ready.value != 1:
                time.sleep(0)
                continue
            ready.value = 0
            n = self.task.desc.num_tokens
            self.seen.append((self.task.ids[:n].clone(), self.task.w[:n].clone()))
            self.task.y[:n].copy_(self.task.x[:n].to(torch.float32) * 2.0)
            self.served += 1
            done.value = 1  # x86 stores are release-ordered; ctypes stores are plain


def run_kernel_io_probe(backend: Any, kio: Any, tokens: int = 3, hidden: int = 256, top_k: int = 4) -> tuple[bool, dict]:
    import torch

    details: dict[str, Any] = {}
    dev = backend.device()
    task = backend.staging().new_task(0, 0, tokens, top_k, hidden, torch.bfloat16, torch.float32, 0, mapped=True)
    if "x" not in task.device_ptrs or "flags" not in task.device_ptrs:
        return False, {"error": "mapped host memory unavailable"}
    cpu = _FakeCpuSide(task)
    cpu.start()
    gen = torch.Generator(device="cpu").manual_seed(int(time.time_ns() % (2**31)))

    def inputs(empty: bool = False) -> tuple[Any, Any, Any, Any]:
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, 8, (tokens, top_k), generator=gen, dtype=torch.int32)
        ids[torch.rand(tokens, top_k, generator=gen) < 0.5] = -1
        if empty:
            ids.fill_(-1)
        else:
            ids[0, 0] = 1
        w = torch.rand(tokens, top_k, generator=gen)
        out = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        return x.to(dev), ids.to(dev), w.to(dev), out.to(dev)

    def expect(x: Any, out: Any, empty: bool) -> Any:
        if empty:
            return out.clone()
        return (out.float() + 2.0 * x.float()).to(torch.bfloat16)

    def run_once(x: Any, ids: Any, w: Any, out: Any) -> None:
        stream = backend.current_stream()
        kio.publish(stream, task, x, ids, w)
        kio.combine(stream, task, out)

    try:
        checks = []
        for empty in (False, True, False):
            x, ids, w, out = inputs(empty)
            want = expect(x, out, empty)
            served_before = cpu.served
            run_once(x, ids, w, out)
            backend.synchronize()
            task.check_error()
            ok = torch.equal(out.cpu(), want.cpu())
            if empty:
                ok = ok and cpu.served == served_before
            else:
                got_ids, got_w = cpu.seen[-1]
                ok = ok and torch.equal(got_ids, ids.cpu()) and torch.equal(got_w, w.cpu())
            checks.append(("eager_empty" if empty else "eager", ok))
        # captured: static inputs, new values before every replay
        sx, sids, sw, sout = inputs()
        flags_before = (task.flags.ready, task.flags.done)
        graph = backend.graph_capture().capture(lambda: run_once(sx, sids, sw, sout))
        backend.synchronize()
        checks.append(("flag_unchanged_during_capture", (task.flags.ready, task.flags.done) == flags_before))
        for i in range(4):
            empty = i == 2
            x, ids, w, out = inputs(empty)
            sx.copy_(x), sids.copy_(ids), sw.copy_(w), sout.copy_(out)
            want = expect(x, out, empty)
            graph.replay()
            backend.synchronize()
            task.check_error()
            checks.append((f"replay{i}{'_empty' if empty else ''}", torch.equal(sout.cpu(), want.cpu())))
        details["checks"] = dict(checks)
        return all(ok for _, ok in checks), details
    except Exception as exc:  # noqa: BLE001 - a probe answers False with the reason
        details["error"] = f"{type(exc).__name__}: {exc}"
        return False, details
    finally:
        cpu.stop.set()
        cpu.join(timeout=5)

"""CopyQueue's thread start on a CUDA device, with torch.cuda's device calls replaced (no GPU here)."""

from __future__ import annotations

import time

import pytest
import torch

from freetoken.moe.experts import copy_queue
from freetoken.moe.experts.copy_queue import CopyQueue


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []

    def set_device(device):
        calls.append(device)
        if getattr(device, "index", 0) is None:  # torch's own rule: "cuda" names no device
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(copy_queue.torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(copy_queue.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(copy_queue.torch.cuda, "set_device", set_device)
    return calls


def test_device_without_index_is_resolved(fake_cuda):
    q = CopyQueue("cuda")
    try:
        assert q.device == torch.device("cuda", 3)
        q.close()
        assert fake_cuda == [torch.device("cuda", 3)]
    finally:
        q.close()


def test_thread_that_cannot_start_fails_tickets_at_once(fake_cuda, monkeypatch):
    def refuse(device):
        raise RuntimeError("no such device")

    monkeypatch.setattr(copy_queue.torch.cuda, "set_device", refuse)
    q = CopyQueue("cuda:1")
    try:
        t0 = time.monotonic()
        ticket = q.submit([])
        with pytest.raises(RuntimeError, match="cannot use cuda:1: no such device"):
            ticket.order_before(timeout_s=20)
        with pytest.raises(RuntimeError, match="no such device"):
            q.submit([]).order_before(timeout_s=20)  # every later ticket too
        assert time.monotonic() - t0 < 10  # not the stall timeout
    finally:
        q.close()

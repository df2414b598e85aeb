"""Stands in for Megatron-LM's megatron/training/dist_signal_handler.py, which
``--exit-signal-handler`` uses: written from its public source, with the interface
and the behaviour the launcher adapts. ``get_device()`` knows the nccl and gloo
backends only and raises RuntimeError for any other; ``DistributedSignalHandler``
records a signal and ``signals_received()`` all-gathers every rank's flag on that
device.
"""
from __future__ import annotations

import signal

import torch


def get_device(local_rank=None):
    backend = torch.distributed.get_backend()
    if backend == "nccl":
        return torch.device("cuda") if local_rank is None else torch.device(f"cuda:{local_rank}")
    if backend == "gloo":
        return torch.device("cpu")
    raise RuntimeError  # as Megatron: no message


def all_gather_item(item, dtype, group=None, local_rank=None):
    """Every rank's `item`, gathered through tensors on get_device()'s device."""
    tensor = torch.tensor([item], device=get_device(local_rank), dtype=dtype)
    gathered = [torch.zeros_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, tensor, group)
    return [t.item() for t in gathered]


class DistributedSignalHandler:
    def __init__(self, sig: signal.Signals = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous = None

    def signals_received(self):
        return all_gather_item(self._received, dtype=torch.int32)

    def __enter__(self):
        self._previous = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(self.sig, self._previous)

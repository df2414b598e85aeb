"""What the training examples share: the NIC drill schedule, deterministic batches,
a digest of the final parameters, and the end-of-job flush of job-wide events.

Kept next to the examples (not in the package) because it is example scaffolding.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

import torch_reccl

CPU_NICS = "127.0.0.1,127.0.0.2"
SHOWN_KINDS = ["failover", "failback", "nic_down", "nic_up", "connection_failed", "slowdown"]


def add_common_arguments(parser, steps: int = 600, fault_step: int = 150) -> None:
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--fault-step", type=int, default=fault_step, help="-1: no fault")
    parser.add_argument("--heal-after-s", type=float, default=2.5,
                        help="seconds on the backup NIC before the primary heals")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--events-jsonl", default=None, help="rank 0 writes every rank's events here")


def init_distributed(device_type: str) -> torch.device:
    """CPU: backend "reccl" on the loopback NICs unless RECCL_NICS says otherwise.
    CUDA: backend "nccl", whose traffic goes through torch_reccl's NCCL plugin ("reccl"
    would run CUDA tensors the same way, on torch's ProcessGroupNCCL)."""
    if device_type == "cpu":
        os.environ.setdefault("RECCL_NICS", CPU_NICS)
        dist.init_process_group("reccl")
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return torch.device("cuda", local_rank)


def show(event) -> None:
    from torch_reccl.integrations._sink import describe

    print(f"[reccl event] {describe(event)}", flush=True)


def watch_events(jsonl_path: Optional[str] = None):
    """Every rank calls this; rank 0 then prints (and logs) every rank's events."""
    torch_reccl.events.configure_slowdown(window_s=1.0, settle_s=0.5)
    torch_reccl.on_event(show, kinds=SHOWN_KINDS, job_wide=True)
    if jsonl_path:
        from torch_reccl.integrations import jsonl

        return jsonl.attach(jsonl_path)  # job-wide: only rank 0 writes
    return None


class NicDrill:
    """Rank 0's primary NIC goes down at ``fault_step`` and heals ``heal_after_s``
    seconds later (or at the end). Process-local: the other ranks see it through
    their peer, as with a real NIC failure on rank 0's host."""

    def __init__(self, fault_step: int, heal_after_s: float):
        self.fault_step = fault_step
        self.heal_after_s = heal_after_s
        self.nic = None
        self.failed_at = None

    def before_step(self, step: int) -> None:
        if dist.get_rank() == 0 and step == self.fault_step:
            self.nic = torch_reccl.nics()[0]["name"]
            print(f"step {step}: NIC {self.nic} of rank 0 goes DOWN", flush=True)
            torch_reccl.inject_fault(self.nic, "down")
            self.failed_at = time.time()
        if self.failed_at is not None and time.time() - self.failed_at >= self.heal_after_s:
            print(f"step {step}: NIC {self.nic} of rank 0 comes back UP", flush=True)
            self.heal()

    def heal(self) -> None:
        if self.failed_at is not None:
            torch_reccl.inject_fault(self.nic, "up")
            self.failed_at = None


def batch(step: int, rank: int, features: int, device, rows: int = 64):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(rows, features, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).tanh()
    return inputs.to(device), targets.to(device)


def digest(tensors: Iterable[torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def train(module, args, device, rows: int = 64) -> float:
    """SGD on deterministic batches for args.steps steps, the NIC drill running;
    returns the seconds it took. Rank 0 prints the loss now and then."""
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    drill = NicDrill(args.fault_step, args.heal_after_s)
    start = time.time()
    for step in range(args.steps):
        drill.before_step(step)
        inputs, targets = batch(step, rank, args.hidden, device, rows)
        loss = torch.nn.functional.mse_loss(module(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    drill.heal()
    return time.time() - start


def report(args, elapsed: float, parameters) -> None:
    if dist.get_rank() == 0:
        print(f"{args.steps} steps on {dist.get_world_size()} ranks in {elapsed:.1f} s; "
              f"parameters sha256 {digest(parameters)}", flush=True)


def finish_events(sink=None) -> None:
    """End of job: every rank publishes what is left, then rank 0 reads it."""
    torch_reccl.events.flush_events(job_wide=True)
    dist.barrier()
    torch_reccl.events.flush_events(job_wide=True)
    if sink is not None:
        sink.close()

"""DDP training that survives a NIC failure, with every rank's failover events on rank 0.

CPU (any machine; the two "NICs" are the loopback addresses 127.0.0.1 and 127.0.0.2):

    torchrun --nproc-per-node 2 examples/ddp_failover.py
    torchrun --nproc-per-node 2 examples/ddp_failover.py --fault-step -1      # no fault

At --fault-step rank 0's primary NIC goes down (``torch_reccl.inject_fault``, a
process-local drill); DDP's all-reduces fail over to the backup NIC and training goes
on. After --heal-after-s seconds on the backup the NIC comes back and traffic fails
back. Rank 0 prints every rank's events as they happen (``on_event(job_wide=True)``),
including the measured slowdown, and at the end a checksum of the final parameters:
it is the same with and without the fault (``--fault-step -1``), bit for bit.

GPUs (one process per GPU): ``--device cuda`` trains with backend "nccl", whose
inter-host traffic goes through torch_reccl's NCCL net plugin (``import torch_reccl``
sets NCCL_NET_PLUGIN before the group is made). Set RECCL_NICS to the host's NICs in
rail order, e.g. on two 8-GPU hosts::

    RECCL_NICS=eth0,eth1,eth2,eth3 torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/ddp_failover.py --device cuda

``--events-jsonl PATH`` also writes every rank's events to PATH on rank 0.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch_reccl  # first: registers "reccl" and points NCCL at the plugin

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

CPU_NICS = "127.0.0.1,127.0.0.2"
SHOWN_KINDS = ["failover", "failback", "nic_down", "nic_up", "connection_failed", "slowdown"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fault-step", type=int, default=150, help="-1: no fault")
    parser.add_argument("--heal-after-s", type=float, default=2.5,
                        help="seconds on the backup NIC before the primary heals")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--events-jsonl", default=None)
    return parser.parse_args(argv)


def show(event) -> None:
    from torch_reccl.integrations._sink import describe

    print(f"[reccl event] {describe(event)}", flush=True)


def batch(step: int, rank: int, hidden: int, device):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(64, hidden, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).tanh()
    return inputs.to(device), targets.to(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("RECCL_NICS", CPU_NICS)
        backend, device = "reccl", torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    # Every rank calls this; rank 0's callback then gets every rank's events.
    torch_reccl.events.configure_slowdown(window_s=1.0, settle_s=0.5)
    torch_reccl.on_event(show, kinds=SHOWN_KINDS, job_wide=True)
    sink = None
    if args.events_jsonl:
        from torch_reccl.integrations import jsonl

        sink = jsonl.attach(args.events_jsonl)  # job-wide: only rank 0 writes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    primary = None
    failed_at = None
    start = time.time()
    for step in range(args.steps):
        if rank == 0 and step == args.fault_step:
            primary = torch_reccl.nics()[0]["name"]
            print(f"step {step}: NIC {primary} of rank 0 goes DOWN", flush=True)
            torch_reccl.inject_fault(primary, "down")
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at >= args.heal_after_s:
            print(f"step {step}: NIC {primary} of rank 0 comes back UP", flush=True)
            torch_reccl.inject_fault(primary, "up")
            failed_at = None
        inputs, targets = batch(step, rank, args.hidden, device)
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    if failed_at is not None:
        torch_reccl.inject_fault(primary, "up")
    elapsed = time.time() - start

    # End of job: every rank publishes what is left, then rank 0 reads it.
    torch_reccl.events.flush_events(job_wide=True)
    dist.barrier()
    torch_reccl.events.flush_events(job_wide=True)
    if sink is not None:
        sink.close()
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"{args.steps} steps on {world} ranks in {elapsed:.1f} s; "
              f"parameters sha256 {digest.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

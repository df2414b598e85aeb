"""Stands in for Megatron-LM's pretrain_gpt.py in tests/test_examples.py (Megatron-LM
is not installable here); tests/megatron_checkout stands in for a Megatron-LM
checkout, run from its root as the launcher's README says. The script does what the
launcher relies on Megatron doing: it imports ``megatron`` from the checkout, finds
torch.distributed already initialised and keeps that group, reads its own arguments
from sys.argv, makes the W&B run on the last rank (as Megatron's _set_wandb_writer
does) and trains. Rank 0's NIC fails part way.

``--exit-signal-handler`` as in Megatron's train loop: every step all-gathers the
ranks' "signal received" flags through megatron.training.dist_signal_handler, and
all ranks stop at the step where any got SIGTERM; rank 0 sends itself one halfway.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from megatron.training.dist_signal_handler import DistributedSignalHandler
from torch.nn.parallel import DistributedDataParallel

import torch_reccl


def main() -> None:
    assert dist.is_initialized(), "the launcher must have made the process group"
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--wandb-project", required=True)
    parser.add_argument("--exit-signal-handler", action="store_true")
    args = parser.parse_args(sys.argv[1:])
    rank, world = dist.get_rank(), dist.get_world_size()
    run = None
    if rank == world - 1:
        import wandb

        run = wandb.init(project=args.wandb_project)
        print(f"wandb run dir {run.dir}", flush=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    nic = torch_reccl.nics()[0]["name"]
    with DistributedSignalHandler() as handler:
        for step in range(args.train_iters):
            if rank == 0 and step == args.train_iters // 3:
                torch_reccl.inject_fault(nic, "down")
            if rank == 0 and args.exit_signal_handler and step == args.train_iters // 2:
                os.kill(os.getpid(), signal.SIGTERM)
            loss = model(torch.randn(32, 256)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.exit_signal_handler and any(handler.signals_received()):
                print(f"rank {rank}: exit signal at step {step}", flush=True)
                break
    if rank == 0:
        torch_reccl.inject_fault(nic, "up")
    torch_reccl.events.flush_events(job_wide=True)
    dist.barrier()
    torch_reccl.events.flush_events(job_wide=True)
    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

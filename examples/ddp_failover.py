"""DDP training that survives a NIC failure, with every rank's failover events on rank 0.

CPU (any machine; the two "NICs" are the loopback addresses 127.0.0.1 and 127.0.0.2):

    torchrun --nproc-per-node 2 examples/ddp_failover.py
    torchrun --nproc-per-node 2 examples/ddp_failover.py --fault-step -1      # no fault

At --fault-step rank 0's primary NIC goes down (``torch_reccl.inject_fault``, a
process-local drill); DDP's all-reduces fail over to the backup NIC and training goes
on. After --heal-after-s seconds on the backup the NIC comes back and traffic fails
back. Rank 0 prints every rank's events as they happen (``on_event(job_wide=True)``),
including the measured slowdown, and at the end a digest of the final parameters:
it is the same with and without the fault (``--fault-step -1``), bit for bit.

GPUs (one process per GPU): ``--device cuda`` trains with backend "nccl", whose
inter-host traffic goes through torch_reccl's NCCL net plugin (``import torch_reccl``
sets NCCL_NET_PLUGIN before the group is made). Backend "reccl" would run these CUDA
tensors the same way, on torch's ProcessGroupNCCL through the plugin
(docs/collectives.md). Set RECCL_NICS to the host's NICs in rail order, e.g. two
8-GPU hosts::

    RECCL_NICS=eth0,eth1,eth2,eth3 torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/ddp_failover.py --device cuda

``--events-jsonl PATH`` also writes every rank's events to PATH on rank 0.
"""
from __future__ import annotations

import argparse
import sys

import torch_reccl  # noqa: F401 - first: registers "reccl" and points NCCL at the plugin

# isort: split
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from example_support import add_common_arguments, finish_events, init_distributed, report, train, watch_events


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--hidden", type=int, default=512)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed(args.device)
    sink = watch_events(args.events_jsonl)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    elapsed = train(DistributedDataParallel(model), args, device)
    finish_events(sink)
    report(args, elapsed, model.parameters())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

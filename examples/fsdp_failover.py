"""FSDP (fully_shard, FSDP2) training through a NIC failure on the "reccl" backend.

CPU (any machine; runs as it is, tested in tests/tools/test_examples.py):

    torchrun --nproc-per-node 2 examples/fsdp_failover.py
    torchrun --nproc-per-node 2 examples/fsdp_failover.py --fault-step -1     # no fault

FSDP shards every Linear's parameters over the ranks: each forward all-gathers them
(``all_gather_into_tensor``) and each backward reduce-scatters the gradients
(``reduce_scatter_tensor``), so the failure hits both collectives mid-step. Rank 0
prints every rank's failover events; the digest of the full parameters at the end
is the same with and without the fault, bit for bit.

GPUs: ``--device cuda`` uses backend "nccl" through torch_reccl's NCCL plugin
(backend "reccl" would run the CUDA tensors the same way, on torch's
ProcessGroupNCCL through the plugin)::

    RECCL_NICS=eth0,eth1,eth2,eth3 torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/fsdp_failover.py --device cuda
"""
from __future__ import annotations

import argparse
import sys

import torch_reccl  # noqa: F401 - first: registers "reccl" and points NCCL at the plugin

# isort: split
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from example_support import add_common_arguments, finish_events, init_distributed, report, train, watch_events


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed(args.device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    sink = watch_events(args.events_jsonl)

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 1)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    elapsed = train(model, args, device, rows=32)
    finish_events(sink)
    full = [p.full_tensor() for p in model.parameters()]  # a collective: every rank joins
    report(args, elapsed, full)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

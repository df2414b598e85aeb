"""W&B: DDP training through a NIC failure, with failovers in the run's charts,
its event table and one alert.

CPU, offline (no account, no network; the run lands in ./wandb/offline-run-*):

    WANDB_MODE=offline torchrun --nproc-per-node 2 examples/wandb_failover.py
    wandb sync wandb/offline-run-*        # later, to upload it

Online: ``wandb login`` once, then drop WANDB_MODE. The run is made on rank 0 only
(``wandb.init``), as usual; ``torch_reccl.integrations.wandb.attach()`` is called on
every rank: rank 0 logs every rank's events, the other ranks forward theirs to it.
Charts: ``reccl/failovers``, ``reccl/interruption_ms``, ``reccl/slowdown``, ... against
``reccl/step``; table ``reccl/events``; an alert "reccl: NIC failover" (at most one
per --alert-interval-s). GPUs: add ``--device cuda`` (see examples/ddp_failover.py).
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
    parser.add_argument("--project", default="reccl-failover-demo")
    parser.add_argument("--alert-interval-s", type=float, default=300.0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed(args.device)
    run = None
    if dist.get_rank() == 0:
        import wandb

        run = wandb.init(project=args.project, config=vars(args))
    from torch_reccl.integrations import wandb as reccl_wandb

    attachment = reccl_wandb.attach(alert_interval_s=args.alert_interval_s)
    sink = watch_events(args.events_jsonl)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    elapsed = train(DistributedDataParallel(model), args, device)
    finish_events(sink)
    attachment.close()  # logs the last table rows
    report(args, elapsed, model.parameters())
    if run is not None:
        run.summary["seconds"] = elapsed
        run.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

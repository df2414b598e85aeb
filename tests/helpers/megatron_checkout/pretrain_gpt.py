"""Stands in for Megatron-LM's pretrain_gpt.py in tests/tools/test_examples.py (Megatron-LM
is not installable here); tests/helpers/megatron_checkout stands in for a Megatron-LM
checkout, run from its root as the launcher's README says. The script does what the
launcher relies on Megatron doing: it imports ``megatron`` from the checkout, finds
torch.distributed already initialised and keeps that group, reads its own arguments
from sys.argv, makes the W&B run on the last rank (as Megatron's _set_wandb_writer
does) and trains through megatron.training.training.train(), whose train_step the
launcher hooks (its fault schedule and step times); like Megatron it leaves without
destroying the process group. At the end each rank prints its parameters' SHA-256.

``--exit-signal-handler`` as in Megatron's train loop: every step all-gathers the
ranks' "signal received" flags through megatron.training.dist_signal_handler, and
all ranks stop at the step where any got SIGTERM; rank 0 sends itself one halfway
(unless ``--no-self-sigterm``). ``--save DIR`` / ``--load DIR`` / ``--save-interval N``
as Megatron's: rank 0 saves the parameters and the iteration every N iterations and
at an exit signal, and a run finding a checkpoint in ``--load`` resumes from it.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from megatron.training import training
from megatron.training.dist_signal_handler import DistributedSignalHandler
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    assert dist.is_initialized(), "the launcher must have made the process group"
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--wandb-project", default=None)
    parser.add_argument("--exit-signal-handler", action="store_true")
    # paces the iterations like a real model's compute, so that asynchronous
    # recovery (failback re-dials a healed NIC with a backoff) fits in the run
    parser.add_argument("--iteration-ms", type=float, default=0.0)
    parser.add_argument("--no-self-sigterm", action="store_true")
    # from this iteration on, the first attempt's iterations take --slow-iteration-ms:
    # the slowdown a failed-over job measures (loopback NICs share one link)
    parser.add_argument("--slow-from", type=int, default=-1)
    parser.add_argument("--slow-iteration-ms", type=float, default=0.0)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=0)
    args = parser.parse_args(sys.argv[1:])
    rank, world = dist.get_rank(), dist.get_world_size()
    run = None
    if rank == world - 1 and args.wandb_project:
        import wandb

        run = wandb.init(project=args.wandb_project)
        print(f"wandb run dir {run.dir}", flush=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    checkpoint = os.path.join(args.load, "checkpoint.pt") if args.load else None
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.module.load_state_dict(state["model"])
        start = state["iteration"]
        print(f"rank {rank}: loaded checkpoint at iteration {start}", flush=True)

    def save(iteration: int) -> None:
        if rank == 0:
            os.makedirs(args.save, exist_ok=True)
            path = os.path.join(args.save, "checkpoint.pt")
            torch.save({"model": model.module.state_dict(), "iteration": iteration}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()

    def on_iteration(iteration: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and 0 <= args.slow_from <= iteration:
            time.sleep(args.slow_iteration_ms / 1e3)
        elif args.iteration_ms:
            time.sleep(args.iteration_ms / 1e3)
        if (rank == 0 and args.exit_signal_handler and not args.no_self_sigterm
                and iteration == args.train_iters // 2):
            os.kill(os.getpid(), signal.SIGTERM)

    with DistributedSignalHandler() if args.exit_signal_handler else contextlib.nullcontext() as handler:
        training.train(model, optimizer, args.train_iters, handler, on_iteration, start,
                       save if args.save else None, args.save_interval)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(f"rank {rank}: parameters sha256 {digest.hexdigest()}", flush=True)
    if run is not None:
        run.finish()
    # As Megatron: no destroy_process_group; the process group outlives the script.


if __name__ == "__main__":
    main()

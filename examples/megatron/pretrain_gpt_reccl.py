"""Megatron-LM pretraining with torch_reccl: start the process group ourselves, then
run Megatron's own pretrain script unchanged.

What was and was not run: Megatron-LM itself NOT run. Megatron's training entry
points (megatron/training/: pretrain, arguments.py, initialize_megatron) ship in the
Megatron-LM repository, not in the megatron-core wheel (0.16.1 from our mirror holds
megatron/core only). Written from Megatron-LM's public source: its
``_initialize_distributed`` skips ``init_process_group`` when torch.distributed is
already initialised and adopts that group's rank and world size; otherwise it calls
``init_process_group(backend=args.distributed_backend, ...)`` with
``--distributed-backend`` limited to ``choices=['nccl', 'gloo']``. Run on CPU
(tests/test_examples.py): this launcher under torchrun, from
tests/megatron_checkout/ (a stand-in for a Megatron-LM checkout: pretrain_gpt.py and
megatron/training/dist_signal_handler.py behave as Megatron's do at the points used
here), with ``--exit-signal-handler`` and ``--reccl-wandb`` with an offline run.

Run on GPU hosts, from a Megatron-LM checkout, with torch_reccl installed:

    export RECCL_NICS=eth0,eth1,eth2,eth3          # this host's NICs, in rail order
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        /path/to/torch_reccl/examples/megatron/pretrain_gpt_reccl.py \\
        --reccl-script pretrain_gpt.py --reccl-events-jsonl reccl_events.jsonl \\
        <the usual pretrain_gpt.py arguments>

Our options start with ``--reccl-`` and are taken out of argv before Megatron parses
it. ``--reccl-backend`` (default ``reccl``): the "reccl" backend runs CUDA tensors on
torch's own ProcessGroupNCCL, whose inter-host traffic torch_reccl's NCCL net plugin
carries with NIC failover (``import torch_reccl`` sets NCCL_NET_PLUGIN before NCCL
starts), and CPU tensors on the reccl engine. Megatron's extra gloo groups
(``backend="gloo"`` in its parallel_state) are unaffected. The script runs as
``python SCRIPT`` would run it: its directory first on sys.path, so a checkout's
``megatron`` package imports.

``--exit-signal-handler``: Megatron all-gathers a "signal received" flag on the
device that ``megatron/training/dist_signal_handler.py``'s ``get_device()`` names,
which knows only nccl (cuda) and gloo (cpu) and raises RuntimeError for any other
backend. The launcher wraps it (when Megatron imports that module) so that a
"reccl" group's device is cuda where CUDA is available, else cpu; other backends
keep Megatron's answer.

Events: every rank's events go to one collecting rank (``on_event(job_wide=True)``),
which prints them and, with ``--reccl-events-jsonl``, writes them as JSON lines.
``--reccl-wandb``: Megatron's W&B run (``--wandb-project``) lives on the last rank and
is made inside pretrain, so the launcher collects on the last rank
(``join_job(collector_rank=world_size - 1)``) and attaches the W&B integration with
``wait_for_run=True``: events wait until Megatron has called ``wandb.init``.

Two other routes, documented in examples/megatron/README.md: a patch to Megatron's
arguments.py and dist_signal_handler.py (``--distributed-backend reccl``) and the
zero-code route ``NCCL_NET_PLUGIN=$(python -m torch_reccl --plugin-path)``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import runpy
import sys

import torch_reccl  # first: registers "reccl" and points NCCL at the plugin
from torch_reccl.import_hook import after_import

SHOWN_KINDS = ["failover", "failback", "nic_down", "nic_up", "connection_failed", "slowdown"]
SIGNAL_HANDLER_MODULE = "megatron.training.dist_signal_handler"


def split_argv(argv):
    """(our --reccl-* options, Megatron's arguments)."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_reccl.py", add_help=True,
        description="Megatron-LM pretraining over torch_reccl; other arguments go to Megatron.")
    parser.add_argument("--reccl-script", default="pretrain_gpt.py",
                        help="Megatron's training script to run (default: pretrain_gpt.py)")
    parser.add_argument("--reccl-backend", default="reccl",
                        help='process group backend (default "reccl": CUDA tensors through NCCL '
                             'and our plugin, CPU tensors on the reccl engine)')
    parser.add_argument("--reccl-timeout-minutes", type=float, default=10.0,
                        help="process group timeout, as Megatron's --distributed-timeout-minutes")
    parser.add_argument("--reccl-events-jsonl", default=None,
                        help="the collecting rank appends every rank's events to this file")
    parser.add_argument("--reccl-wandb", action="store_true",
                        help="log every rank's events to Megatron's W&B run (on the last rank)")
    return parser.parse_known_args(argv)


def init_distributed(backend: str, timeout_minutes: float) -> None:
    """What Megatron's _initialize_distributed would do, with our backend: bind this
    process to its GPU, then make the default group from torchrun's env://."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def reccl_aware_get_device(original):
    """Megatron's dist_signal_handler.get_device(local_rank), which raises for any
    backend but nccl and gloo, answering for "reccl" too: the device its tensors are
    on, cuda where CUDA is available (NCCL carries them), else cpu (the reccl engine)."""
    def get_device(local_rank=None):
        import torch

        if torch_reccl.backend.BACKEND_NAME not in str(torch.distributed.get_backend()):
            return original(local_rank)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda") if local_rank is None else torch.device("cuda", local_rank)

    return get_device


def adapt_signal_handler(module) -> None:
    module.get_device = reccl_aware_get_device(module.get_device)


def run_script(script: str, argv) -> None:
    """Runs `script` as ``python script argv...`` would: as __main__, with its own
    directory (a Megatron-LM checkout's root, holding megatron/) first on sys.path
    in place of this launcher's."""
    sys.argv = [script] + list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def show(event) -> None:
    from torch_reccl.integrations._sink import describe

    print(f"[reccl event] {describe(event)}", flush=True)


def main(argv=None) -> None:
    ours, megatron_args = split_argv(sys.argv[1:] if argv is None else argv)
    init_distributed(ours.reccl_backend, ours.reccl_timeout_minutes)
    import torch.distributed as dist

    # Megatron logs to W&B from the last rank; collect the job's events there.
    collector = dist.get_world_size() - 1 if ours.reccl_wandb else 0
    torch_reccl.events.join_job(collector_rank=collector)
    torch_reccl.on_event(show, kinds=SHOWN_KINDS, job_wide=True)
    if ours.reccl_events_jsonl:
        from torch_reccl.integrations import jsonl

        jsonl.attach(ours.reccl_events_jsonl)
    if ours.reccl_wandb:
        from torch_reccl.integrations import wandb as reccl_wandb

        reccl_wandb.attach(wait_for_run=True)  # Megatron calls wandb.init inside pretrain
    after_import(SIGNAL_HANDLER_MODULE, adapt_signal_handler)  # --exit-signal-handler
    # Megatron sees an initialised torch.distributed and keeps it (its
    # _initialize_distributed prints "torch distributed is already initialized").
    run_script(ours.reccl_script, megatron_args)


if __name__ == "__main__":
    main()

"""``reccl qualify`` / ``python -m torch_reccl.qualify``: the command line.

    torchrun --nnodes N --nproc-per-node G -m torch_reccl.qualify [--json PATH] [--report PATH]
    reccl qualify --local 2 [--rails 2] [--json PATH] [--report PATH]

Under torchrun every process is a rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
with ``--local N`` this command starts N ranks on this machine, each its own
emulated host over loopback NICs (RECCL_NICS, when set, instead), and prints rank
0's summary. Exit code 0: every check that ran passed; 1: one failed (the summary
says which and why); 2: bad arguments.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

from torch_reccl.qualify.steps import CHECKS


def parse_checks(text: str) -> List[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {unknown or text!r}; valid: {', '.join(CHECKS)} "
                                         f"(comma list; inventory always runs)")
    return ["inventory"] + [c for c in CHECKS[1:] if c in names]


def positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", type=positive(int), metavar="N",
                        help="start N ranks on this machine, each its own emulated host over loopback NICs")
    parser.add_argument("--rails", type=positive(int), default=2,
                        help="with --local: loopback NICs per host, 127.0.0.1.. (default 2; RECCL_NICS wins)")
    parser.add_argument("--json", metavar="PATH", help="write the whole record as JSON (rank 0)")
    parser.add_argument("--report", metavar="PATH", help="write a Markdown report to attach to an issue (rank 0)")
    parser.add_argument("--checks", type=parse_checks, default=list(CHECKS),
                        help=f"comma list of checks to run (default all: {','.join(CHECKS)})")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (default): cuda where every rank sees a GPU; cpu: the reccl process group "
                             "against Gloo; cuda: NCCL through torch_reccl's plugin against NCCL's own network")
    parser.add_argument("--sizes-mib", type=positive(float), nargs="+", default=None,
                        help="busbw sizes in MiB (default 1 16 on CPUs, 16 64 256 on GPUs)")
    parser.add_argument("--perf-budget", type=positive(float), default=1.0,
                        help="seconds of collectives per measured size (default 1)")
    parser.add_argument("--reach-timeout", type=positive(float), default=15.0,
                        help="deadline of every dial of the reachability check, in seconds (default 15)")
    parser.add_argument("--failover-mib", type=positive(float), default=None,
                        help="size of each all_reduce of the failover stream (default 4 on CPUs, 64 on GPUs)")
    parser.add_argument("--failover-base", type=positive(float), default=2.0,
                        help="seconds of fault-free stream before each rail goes down (default 2)")
    parser.add_argument("--failover-hold", type=positive(float), default=3.0,
                        help="seconds each rail stays down (default 3)")
    parser.add_argument("--failover-settle", type=positive(float), default=15.0,
                        help="after a rail is back: the longest wait for every failback (default 15 s)")
    parser.add_argument("--collective-timeout", type=positive(float), default=60.0,
                        help="the process groups' timeout: bound on every collective (default 60 s)")
    parser.add_argument("--step-timeout", type=positive(float), default=120.0,
                        help="bound on waiting for the other ranks at each step (default 120 s)")
    parser.add_argument("--timeout", type=positive(float), default=600.0,
                        help="with --local: bound on the whole run; its ranks are stopped after it (default 600 s)")
    # set by --local for its ranks
    parser.add_argument("--progress-markers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--command-line", default=None, help=argparse.SUPPRESS)


def run(args) -> int:
    if args.command_line is None:
        args.command_line = "reccl " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.local is not None:
        from torch_reccl.qualify.local import run_local

        return run_local(args)
    from torch_reccl.qualify.job import QualifyError
    from torch_reccl.qualify.rank import run as run_rank

    try:
        return run_rank(args)
    except QualifyError as error:  # not under torchrun, or the store never answered
        print(f"reccl qualify: error: {error}", file=sys.stderr)
        return 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "qualify", help="check a cluster for reccl: NIC inventory, every rail reachable, busbw against "
        "the baseline, failover of every rail (under torchrun, or --local N)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.qualify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.command_line is None:
        args.command_line = "python -m torch_reccl.qualify " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    return run(args)

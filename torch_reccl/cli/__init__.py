"""The ``reccl`` command line, and what only its subcommands share: launch (start a
job's ranks and talk to them), progress (the terminal progress bar); topo is the
``reccl topo`` subcommand.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)``;
the parser it adds sets ``func`` to a callable taking the parsed arguments and
returning an exit code. A subcommand whose module fails to import is still listed
and reports the import error when used, so it never breaks the others.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that implements it
SUBCOMMANDS = {
    "bench": "torch_reccl.bench.cli",
    "drill": "torch_reccl.drill.cli",
    "fabric": "torch_reccl.fabric.cli",
    "qualify": "torch_reccl.qualify.cli",
    "sim": "torch_reccl.sim.simulator",
    "soak": "torch_reccl.soak.cli",
    "topo": "torch_reccl.cli.topo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reccl",
        description="torch_reccl: NIC failover for torch.distributed",
    )
    parser.add_argument(
        "--plugin-path", action="store_true",
        help="print the path of the NCCL net plugin library (for NCCL_NET_PLUGIN) and exit",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            broken = subparsers.add_parser(name, help=f"(unavailable: {error})")
            broken.set_defaults(func=_unavailable(name, error))
            continue
        module.add_parser(subparsers)
    return parser


def _unavailable(name: str, error: ImportError):
    def report(_args) -> int:
        print(f"reccl {name} is unavailable: {error}", file=sys.stderr)
        return 2

    return report


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plugin_path:
        from torch_reccl._native import plugin_path

        print(plugin_path())
        return 0
    if args.command is None:
        parser.error("a command is required")
    try:
        return int(args.func(args) or 0)
    except ValueError as error:  # bad settings (ConfigError is a ValueError): no traceback
        print(f"reccl {args.command}: error: {error}", file=sys.stderr)
        return 2

"""``reccl topo``: the local NIC table with each NIC's backup and distance cost."""
from __future__ import annotations

import json

from torch_reccl._native import nics


def format_table(rows) -> str:
    header = ("#", "NIC", "address", "up", "health", "backup", "cost", "NUMA", "PCI path")
    lines = [header]
    for nic in rows:
        cost = nic["backup_cost"]
        lines.append((
            str(nic["index"]), nic["name"], nic["address"], "yes" if nic["up"] else "NO",
            # a grey failure: up, but far slower than its peers (docs/grey_failures.md)
            "DEGRADED" if nic.get("grey") == "degraded" else
            "trial" if nic.get("grey") == "probation" else "ok",
            nic["backup"] or "-", "next-in-order" if cost < 0 and nic["backup"] else str(cost),
            str(nic["numa_node"]), nic["pci_path"] or "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def run(args) -> int:
    rows = nics()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "topo", help="local NICs (RECCL_NICS) with their backup NIC and distance cost"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)

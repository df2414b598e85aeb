"""``reccl topo``: the local NIC table with each NIC's backup and distance cost,
then the GPUs: their distances to each other and to the NICs in ``nvidia-smi topo
-m``'s terms, NVLink peers, and NVL's transit GPUs, from NVML where pynvml and the
driver answer, else from sysfs (the report's first GPU line says which, and why)."""
from __future__ import annotations

import json
import sys

from torch_reccl import gpu_topo
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
    return _grid(lines)


def _grid(lines) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def gpu_report(topology: gpu_topo.GpuTopology, rows) -> dict:
    """The GPU part of ``reccl topo --json``."""
    out = {
        "source": topology.source,
        "detail": topology.detail,
        "gpus": [{"index": g.index, "bus_id": g.bus_id, "name": g.name, "pci_path": g.pci_path,
                  "numa_node": g.numa_node} for g in topology.gpus],
        "gpu_links": topology.links,
        "nvlinks": topology.nvlinks,
        "nic_links": gpu_topo.nic_links(topology, rows),
        "nvlink_peers_setting": topology.nvlink_setting(),
    }
    if topology.gpus and rows:
        out["nvl"] = gpu_topo.transit(topology, rows)
    return out


def format_gpus(topology: gpu_topo.GpuTopology, rows, report: dict) -> str:
    lines = [topology.describe_source()]
    if not topology.gpus:
        return lines[0] + "\nno NVIDIA GPUs found"
    names = [f"GPU{g.index}" for g in topology.gpus] + [n["name"] for n in rows]
    grid = [[""] + names]
    nic_links = report["nic_links"]
    for g in topology.gpus:
        grid.append([names[g.index]] + topology.links[g.index] + nic_links[g.index])
    for n, nic in enumerate(rows):
        to_nics = [gpu_topo.pci_link((nic["pci_path"], nic["numa_node"]), (o["pci_path"], o["numa_node"]))
                   if o is not nic else "X" for o in rows]
        grid.append([nic["name"]] + [nic_links[g.index][n] for g in topology.gpus] + to_nics)
    lines.append(_grid(grid))
    lines.append("Legend: " + gpu_topo.LEGEND)
    lines.append("bus ids: " + ", ".join(f"GPU{g.index} {g.bus_id} ({g.name})" for g in topology.gpus))
    nvl = report.get("nvl")
    if nvl:
        lines.append(f"NVL transit (RECCL_NVL=on; transit GPUs: {nvl['peers_from']}):")
        for n, nic in enumerate(rows):
            near = nvl["nic_gpus"][n]
            via = [f"GPU{g} via GPU{nvl['transit'][g][n]}" for g in range(len(topology.gpus))
                   if nvl["transit"][g][n] >= 0]
            lines.append(f"  {nic['name']}: next to " + (f"GPU{near}" if near >= 0 else "no known GPU") +
                         "; " + (", ".join(via) if via else "every GPU direct"))
    setting = topology.nvlink_setting()
    if setting is not None:
        lines.append(f"RECCL_NVLINK_PEERS={setting} (what `import torch_reccl` sets for the plugin "
                     "when RECCL_NVL=on)")
    return "\n".join(lines)


def run(args) -> int:
    if args.nvlink_peers:
        topology = gpu_topo.discover()
        setting = topology.nvlink_setting()
        if setting is None:
            print(f"reccl topo: no NVLink answer: {topology.detail}", file=sys.stderr)
            return 1
        print(setting)
        return 0
    rows = nics()
    topology = gpu_topo.discover()
    report = gpu_report(topology, rows)
    if args.json:
        print(json.dumps({"nics": rows, "gpu_topology": report}, indent=2))
    else:
        print(format_table(rows) + "\n\n" + format_gpus(topology, rows, report))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "topo", help="local NICs (RECCL_NICS) with their backup NIC and distance cost; GPUs, "
        "NVLink and GPU-NIC distances from NVML (pynvml) or sysfs"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--nvlink-peers", action="store_true",
        help="print only NVML's NVLink pairs as a RECCL_NVLINK_PEERS value (for NCCL jobs that load "
        "the plugin without importing torch_reccl); exit 1 without NVML",
    )
    parser.set_defaults(func=run)

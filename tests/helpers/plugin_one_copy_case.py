"""One process, the plugin library loaded two ways: by ctypes as NCCL loads it
(dlopen RTLD_LOCAL) and as the dependency of torch_reccl._C. Run by
tests/plugin/test_plugin_library.py in a fresh process, with the order as argument:

  plugin-first  the plugin is loaded, initialised and carries traffic before
                torch or torch_reccl._C is loaded;
  python-first  torch_reccl._C (and with it the library) is loaded first.

Then a fault injected through the Python API must steer the plugin's traffic,
and the Python view (stats, events) must show the plugin's NICs and bytes: one
NIC health table. Prints a JSON report.
"""
from __future__ import annotations

import json
import sys

from torch_reccl.bench.nccl_net import run_pair

NIC0, NIC1 = "lo:127.0.0.1", "lo:127.0.0.2"
SIZES = [1 << 16] * 16 + [3, 1 << 20]


def mapped(fragment: str) -> list:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if fragment in line})


def nic_bytes(stats: dict) -> dict:
    return {name: stats["nics"][name]["bytes_sent"] for name in (NIC0, NIC1)}


def main() -> None:
    order = sys.argv[1]
    report = {"order": order}
    if order == "python-first":
        from torch_reccl._native import native

        native()
    elif order != "plugin-first":
        raise SystemExit(f"order {order!r} is not valid; valid: plugin-first, python-first")
    errors, good = run_pair(11, SIZES)
    report["first"] = {"errors": errors, "intact": sum(good)}
    report["torch_mapped_before_import"] = mapped("libc10") + mapped("libtorch")

    import torch_reccl
    from torch_reccl._native import native

    before = torch_reccl.stats()
    report["nics_seen_by_python"] = sorted(before["nics"])
    report["bytes_before"] = nic_bytes(before)
    torch_reccl.inject_fault(NIC0, "down")
    errors, good = run_pair(11, SIZES)
    report["second"] = {"errors": errors, "intact": sum(good)}
    after = torch_reccl.stats()
    report["bytes_after"] = nic_bytes(after)
    report["nic0_up_after"] = after["nics"][NIC0]["up"]
    report["events"] = [(e["kind"], e["nic"], e["reason"]) for e in native().drain_events()]
    report["library_copies"] = mapped("libnccl-net-reccl")
    report["sent_per_exchange"] = sum(SIZES)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""DCR and spreading in the emulated fabric: busbw with one NIC down, s-Bond alone,
spreading and DCR.

Two emulated hosts with 4 rails each, every NIC capped (default 1000 Mbit/s), one
rank per host, one channel per NIC. `reccl bench --nic-down` measures fault-free
busbw and then busbw with rank 0's first NIC down (a real veth down); it runs
twice in this invocation, with RECCL_DCR=0 (s-Bond alone: the failed channel's
traffic doubles up on the backup NIC) and RECCL_DCR=1 (the failed channel
carries nothing). Prints each NIC-down busbw as a ratio to the fault-free busbw
of the same run. A third run has RECCL_DCR=0 and RECCL_SPREAD=on (the failed
channel's connections stripe over the surviving NICs, docs/transport.md,
"Spreading"). Needs root.

    python bench/dcr_fabric.py [--rails 4] [--rate-mbit 1000] [--sizes 16M 64M 128M]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from reccl_bench_runs import run_bench, write_json


def bench(dcr: int, args, path: str, spread: str = "off") -> dict:
    argv = ["--fabric", f"2x{args.rails}", "--rate-mbit", str(args.rate_mbit), "--nic-down",
            "--ops", "all_reduce", "--min-bytes", args.sizes[0], "--max-bytes", args.sizes[-1],
            "--factor", "2", "--warmup", str(args.warmup), "--iters", str(args.iters)]
    return run_bench(argv, {"RECCL_DCR": str(dcr), "RECCL_SPREAD": spread}, path, args.timeout)


def busbw_by_size(record: dict) -> dict:
    """{size: (fault-free busbw, nic-down busbw)}."""
    out = {}
    for row in record["rows"]:
        variants = row["variants"]
        free = next(v["busbw"] for k, v in variants.items() if "down" not in k.lower())
        down = next(v["busbw"] for k, v in variants.items() if "down" in k.lower())
        out[row["bytes"]] = (free, down)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rails", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--sizes", nargs="+", default=["16M", "128M"],
                        help="smallest and largest all_reduce size (factor 2 between)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=540)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sbond = busbw_by_size(bench(0, args, os.path.join(tmp, "sbond.json")))
        spread = busbw_by_size(bench(0, args, os.path.join(tmp, "spread.json"), "on"))
        dcr = busbw_by_size(bench(1, args, os.path.join(tmp, "dcr.json")))
    print(f"all_reduce busbw (GB/s), 2 hosts x {args.rails} rails at {args.rate_mbit:g} Mbit/s, "
          f"rank 0's NIC 0 down; each ratio against the fault-free busbw of its own run")
    print(f"{'size(B)':>12} {'s-Bond':>8} {'ratio':>6} {'spread':>8} {'ratio':>6} {'DCR':>8} {'ratio':>6}")
    result = []
    nan = (float("nan"), float("nan"))
    for size in sorted(sbond):
        (f0, d0), (f1, d1), (f2, d2) = sbond[size], spread.get(size, nan), dcr.get(size, nan)
        print(f"{size:>12} {d0:8.3f} {d0 / f0:6.2f} {d1:8.3f} {d1 / f1:6.2f} {d2:8.3f} {d2 / f2:6.2f}")
        result.append({"size": size, "sbond_ratio": d0 / f0, "spread_ratio": d1 / f1,
                       "dcr_ratio": d2 / f2, "fault_free": [f0, f1, f2], "sbond": d0,
                       "spread": d1, "dcr": d2})
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

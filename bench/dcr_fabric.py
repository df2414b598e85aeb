"""DCR and spreading in the emulated fabric: the CPU engine's busbw through NIC
faults, with s-Bond alone, spreading and DCR.

Two emulated hosts with 4 rails each, every NIC capped (default 1000 Mbit/s), one
rank per host, one channel per NIC. Each configuration is one `reccl bench` run
measuring four variants in turn: fault-free; rank 0's NIC 0 down; its NICs 0 and 1
down; its NIC 1 slowed to 10% of the rate (tbf; the link stays up). Faults are
real (veth down, tbf) and made before the first measured op. Configurations:
s-Bond (RECCL_DCR=0, RECCL_SPREAD=off: a failed channel's traffic doubles up on
its backup NIC), spreading (RECCL_DCR=0, RECCL_SPREAD=on: it stripes over the
surviving NICs, docs/transport.md "Spreading"), DCR (RECCL_DCR=1: the failed
channel carries nothing) and spreading without grey-failure detection
(RECCL_GREY=0: a slow NIC is not noticed). Prints each faulted busbw as a ratio
to the fault-free busbw of the same run (bounds: 1 of 4 down 0.75, 2 of 4 down
0.5, a slow NIC once detected about 0.75; undetected, every channel waits for the
slow one: about 0.10).
Needs root.

    python bench/dcr_fabric.py [--rails 4] [--rate-mbit 1000] [--sizes 16M 128M]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

from reccl_bench_runs import run_bench, write_json

FAULTS = {"1 down": "h0nic0:down", "2 down": "h0nic0:down,h0nic1:down", "slow": "h0nic1:slow=10%"}
CONFIGS = {"s-Bond": {"RECCL_DCR": "0", "RECCL_SPREAD": "off"},
           "spreading": {"RECCL_DCR": "0", "RECCL_SPREAD": "on"},
           "DCR": {"RECCL_DCR": "1", "RECCL_SPREAD": "off"},
           "spreading, grey off": {"RECCL_DCR": "0", "RECCL_SPREAD": "on", "RECCL_GREY": "0"}}


def bench(env: dict, args, path: str) -> dict:
    argv = ["--fabric", f"2x{args.rails}", "--rate-mbit", str(args.rate_mbit),
            "--ops", "all_reduce", "--min-bytes", args.sizes[0], "--max-bytes", args.sizes[-1],
            "--factor", "2", "--warmup", str(args.warmup), "--iters", str(args.iters)]
    for faults in FAULTS.values():
        argv += ["--fault", faults]
    return run_bench(argv, env, path, args.timeout)


def busbw_by_size(record: dict) -> dict:
    """{size: {"fault-free" or a FAULTS key: busbw}}."""
    names = {f"reccl,{spec.replace(',', '+')}": key for key, spec in FAULTS.items()}
    names["reccl"] = "fault-free"
    return {row["bytes"]: {names[label]: m["busbw"] for label, m in row["variants"].items() if label in names}
            for row in record["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rails", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--sizes", nargs="+", default=["16M", "128M"],
                        help="smallest and largest all_reduce size (factor 2 between)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed ops per size (the first size's also give the grey detector "
                             "the load it needs, RECCL_GREY_MS)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.configs):
            results[name] = busbw_by_size(bench(CONFIGS[name], args, os.path.join(tmp, f"{i}.json")))
    print(f"all_reduce busbw (GB/s), 2 hosts x {args.rails} rails at {args.rate_mbit:g} Mbit/s, faults on "
          f"host 0; each ratio against the fault-free busbw of its own run")
    print(f"{'config':20s} {'size(B)':>10} {'fault-free':>10} " + " ".join(f"{k:>15s}" for k in FAULTS))
    rows = []
    for name, by_size in results.items():
        for size, busbw in sorted(by_size.items()):
            free = busbw.get("fault-free", math.nan)
            cells = {k: busbw.get(k, math.nan) for k in FAULTS}
            print(f"{name:20s} {size:>10} {free:10.3f} "
                  + " ".join(f"{v:8.3f} ({v / free:4.2f})" for v in cells.values()))
            rows.append({"config": name, "size": size, "fault_free": free, "busbw": cells,
                         "ratio": {k: v / free for k, v in cells.items()}})
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grey failures in the emulated fabric: a NIC slowed to a fraction of its rate.

Two emulated hosts with K rails (default 4 at 1000 Mbit/s), one rank per host,
the CPU engine (one channel per NIC) running all_reduce back to back, every
element of every result checked. After --fault-at seconds host 0's NIC 1 is
slowed to --slow-pct of the fabric rate (tbf, both directions; the link stays
up). The run is made twice in this invocation: with grey-failure detection
(RECCL_GREY=1) and without (RECCL_GREY=0). For each it prints the fault-free
busbw (before the fault), the time from the fault to the first `degraded`
event, and the busbw from --settle seconds after the fault to the end, as a
ratio to the same run's fault-free busbw. Needs root.

    python bench/grey_fabric.py [--rails 4] [--rate-mbit 1000] [--slow-pct 10] [--json PATH]

Every element of every --check-every'th result is checked (a wrong one fails
the run). The rank program and the scenario driver are torch_reccl/bench/grey_fabric.py's,
which tests/fabric/test_grey_fabric.py runs too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.grey_fabric import run_scenario  # noqa: E402


def busbw(ticks: List[dict], start: float, end: float, world: int = 2) -> float:
    """all_reduce busbw (GB/s) of rank 0 between two wall times, from its ticks."""
    inside = [t for t in ticks if start <= t["t"] <= end]
    if len(inside) < 2:
        return float("nan")
    algbw = (inside[-1]["bytes"] - inside[0]["bytes"]) / (inside[-1]["t"] - inside[0]["t"])
    return algbw * 2.0 * (world - 1) / world / 1e9


def slow_then_run(pct: float, fault_at: float, run_for: float) -> Callable:
    """A plan: slow host 0's NIC 1 at fault_at s, stop run_for s after that."""
    def plan(fabric, state) -> bool:
        now = time.time() - state["t0"]
        if not state["faults"] and now >= fault_at:
            fabric.slow(0, 1, pct)
            state["faults"].append(("slow", time.time()))
        return bool(state["faults"]) and now >= fault_at + run_for
    return plan


def measure(grey: bool, args) -> dict:
    env = {"RECCL_GREY": "1" if grey else "0"}
    state = run_scenario(args.rails, args.rate_mbit, env,
                         slow_then_run(args.slow_pct, args.fault_at, args.run_after),
                         size_bytes=args.bytes, max_seconds=args.fault_at + args.run_after + 30,
                         check_every=args.check_every)
    ticks = state["ticks"][0]
    t0, t_fault = state["t0"], state["faults"][0][1]
    end = ticks[-1]["t"]
    free = busbw(ticks, t0 + args.warmup, t_fault)
    after = busbw(ticks, t_fault + args.settle, end)
    degraded = [e for e in state["events"] if e["ev"] == "degraded"]
    detect = min(e["t"] for e in degraded) - t_fault if degraded else None
    wrong = sum(t["wrong"] for r in (0, 1) for t in state["ticks"][r][-1:])
    # what moved the traffic, if anything did: events after the fault by kind and reason
    moved: Dict[str, int] = {}
    for e in state["events"]:
        if e["t"] >= t_fault:
            key = f"{e['ev']}({e['reason']})" if e["reason"] else e["ev"]
            moved[key] = moved.get(key, 0) + 1
    return {"grey": grey, "fault_free_busbw": free, "after_busbw": after, "ratio": after / free,
            "detect_s": detect, "degraded_events": len(degraded), "wrong": wrong,
            "events_after_fault": moved, "exit_codes": state["exit_codes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rails", type=int, default=4)
    ap.add_argument("--rate-mbit", type=float, default=1000)
    ap.add_argument("--slow-pct", type=float, default=10, help="what the slow NIC keeps (%%)")
    ap.add_argument("--check-every", type=int, default=8,
                    help="check every element of every Nth result (default 8: the check costs "
                         "CPU time that would cap the fault-free busbw; the tests check every one)")
    ap.add_argument("--bytes", type=int, default=16 << 20, help="all_reduce size (default 16 MiB)")
    ap.add_argument("--fault-at", type=float, default=6.0, help="seconds of fault-free load first")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds not counted as fault-free")
    ap.add_argument("--run-after", type=float, default=14.0, help="seconds of load after the fault")
    ap.add_argument("--settle", type=float, default=4.0,
                    help="busbw after the fault is measured from this many seconds after it")
    ap.add_argument("--json", metavar="PATH", help="also write the records here")
    args = ap.parse_args(argv)
    import torch  # noqa: F401 - loads the libraries the extension links

    import torch_reccl._C as native

    command = f"python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}"
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"{command}\n{date}, load average {os.getloadavg()[0]:.1f}, {native.__file__}")
    records = [measure(True, args), measure(False, args)]
    print(f"all_reduce {args.bytes >> 20} MiB, 2 hosts x {args.rails} rails at {args.rate_mbit:g} "
          f"Mbit/s, host 0's NIC 1 slowed to {args.slow_pct:g}% at {args.fault_at:g} s")
    print(f"{'RECCL_GREY':>10} {'fault-free':>11} {'after':>8} {'ratio':>6} {'detected':>9} "
          f"{'wrong':>6}  events after the fault")
    for r in records:
        det = f"{r['detect_s']:.2f} s" if r["detect_s"] is not None else "never"
        print(f"{int(r['grey']):>10} {r['fault_free_busbw']:11.3f} {r['after_busbw']:8.3f} "
              f"{r['ratio']:6.2f} {det:>9} {r['wrong']:>6}  {r['events_after_fault']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"command": command, "date": date, "rails": args.rails,
                                "load_average": os.getloadavg()[0],
                                "rate_mbit": args.rate_mbit, "slow_pct": args.slow_pct,
                                "bytes": args.bytes, "settle_s": args.settle,
                                "check_every": args.check_every},
                       "results": records}, f, indent=1)
    return 0 if all(r["wrong"] == 0 and not any(r["exit_codes"]) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shares sized by usable bandwidth: one degraded host in the emulated fabric, each
fault phase against the fault-free phase of the same run.

H emulated hosts (default 4) with R rails each at --rate-mbit, one rank per host,
the CPU engine running one collective back to back (torch_reccl/bench/grey_fabric.py's
rank program and driver, on values whose float sums change with the summation order,
every --check-every'th result compared bit for bit with the run's first, fault-free
one). After --warmup untimed ops and a fault-free phase (--ops-free ops and at least
--seconds s), host 0 is degraded; after a settling phase (--settle-ops ops and at
least --settle s) the fault phase is timed (--ops-fault ops and at least --seconds
s). Faults (--faults): downK = host 0's NICs 0..K-1 down; greyP = host 0's NIC 1
slowed to P% of the rate (a grey failure: once detected it carries nothing, like a
down NIC); hostP = every NIC of host 0 slowed to P%.

Per row: the mean op time of each phase (rank 0's), ratio = fault-free / fault
phase time, the fault-free busbw as a share of the line rate (R x rate), and two
model figures for that degradation: the equal-share bound (every rank an equal
share: the degraded host's usable fraction c) and the proportional optimum (all_reduce:
shares minimising max_i (S + (N-2) s_i) / c_i of a direct reduce-scatter + all-gather,
engine/shares.h; all_gather and reduce_scatter: c as well, since each rank's block is
fixed by the API and the degraded host must receive or send (N-1)/N of the buffer).
The degraded fraction c is taken as the host's usable NICs over its NICs (downK:
(R-K)/R; greyP: (R-1)/R once detected; hostP: P/100).

    python bench/shares_fabric.py [--hosts 4] [--rails 4] [--rate-mbit 300]
        [--ops all_reduce all_gather reduce_scatter] [--sizes 16M 64M 256M]
        [--faults down1 down2 host50] [--env RECCL_SHARES=proportional] [--json PATH]

Needs root. --env sets RECCL_* variables of the ranks: RECCL_SHARES=proportional for
the proportional shares (the default, equal, measures equal shares on the same fabric).
--values exact uses small integers checked against their exact sums, for an engine
that does not keep the fault-free bits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.cli import parse_size  # noqa: E402
from torch_reccl.bench.grey_fabric import OPS, run_scenario  # noqa: E402

FAULT_RE = re.compile(r"^(down)(\d+)$|^(grey)(\d+)$|^(host)(\d+)$")


def parse_fault(text: str):
    match = FAULT_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"fault {text!r} is not valid: downK (K NICs of host 0 down), "
                                         f"greyP (its NIC 1 at P%%) or hostP (every NIC of it at P%%)")
    kind, value = next((match.group(i), int(match.group(i + 1))) for i in (1, 3, 5) if match.group(i))
    if kind != "down" and not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"fault {text!r}: the percentage must be 1..99")
    return kind, value


def usable_fraction(fault, rails: int) -> float:
    kind, value = fault
    if kind == "down":
        return (rails - value) / rails
    if kind == "grey":
        return (rails - 1) / rails
    return value / 100.0


def proportional_time(hosts: int, capacities: List[float]) -> float:
    """max_i (1 + (N-2) s_i) / c_i at the optimal shares (water-filling, as engine/shares.cc)."""
    active = list(range(hosts))
    while True:
        total = sum(capacities[i] for i in active)
        t = (hosts - 2 + len(active)) / total
        keep = [i for i in active if t * capacities[i] > 1]
        if len(keep) == len(active):
            break
        active = keep
    shares = [max(0.0, (t * c - 1) / (hosts - 2)) if i in active else 0.0 for i, c in enumerate(capacities)]
    return max((1 + (hosts - 2) * s) / c for s, c in zip(shares, capacities))


def model(op: str, hosts: int, c: float) -> Dict[str, float]:
    if op != "all_reduce" or hosts <= 2:
        return {"equal_bound": c, "optimum": c}
    free = proportional_time(hosts, [1.0] * hosts)
    return {"equal_bound": c, "optimum": free / proportional_time(hosts, [c] + [1.0] * (hosts - 1))}


def make_fault(fabric, fault, rails: int) -> None:
    kind, value = fault
    if kind == "down":
        for rail in range(value):
            fabric.nic_down(0, rail)
    elif kind == "grey":
        fabric.slow(0, 1, value)
    else:
        for rail in range(rails):
            fabric.slow(0, rail, value)


def phase_plan(args, fault, rails: int) -> Callable:
    """Counts rank 0's ops: fault after the fault-free phase, stop after the fault phase."""
    marks: Dict[str, float] = {}

    def plan(fabric, state) -> bool:
        ticks = state["ticks"][0]
        if not ticks:
            return False
        ops, now = ticks[-1]["ops"], time.time()
        if "free" not in marks and ops >= args.warmup:
            marks["free"], marks["free_ops"] = now, ops
        if "free" in marks and "fault" not in marks and ops >= marks["free_ops"] + args.ops_free \
                and now >= marks["free"] + args.seconds:
            make_fault(fabric, fault, rails)
            marks["fault"], marks["fault_ops"] = time.time(), ops
            state["faults"].append((fault, marks["fault"]))
        if "fault" in marks and "timed" not in marks and ops >= marks["fault_ops"] + args.settle_ops \
                and now >= marks["fault"] + args.settle:
            marks["timed"], marks["timed_ops"] = now, ops
        state["marks"] = marks
        return "timed" in marks and ops >= marks["timed_ops"] + args.ops_fault \
            and now >= marks["timed"] + args.seconds

    return plan


def mean_op_s(ticks: List[dict], start: float, end: float) -> float:
    """Mean length of rank 0's ops that began at or after `start` and ended by `end`."""
    lengths = [s for t in ticks for (ended, s) in t.get("op_times", []) if ended - s >= start and ended <= end]
    return sum(lengths) / len(lengths) if lengths else float("nan")


def measure(args, hosts: int, op: str, size: int, fault) -> dict:
    env = dict(item.split("=", 1) for item in args.env)
    seconds_guess = 600.0
    state = run_scenario(args.rails, args.rate_mbit, env, phase_plan(args, fault, args.rails),
                         size_bytes=size, max_seconds=seconds_guess, name_prefix="s",
                         check_every=args.check_every, hosts=hosts, op=op,
                         order_sensitive=args.values == "order-sensitive")
    marks = state.get("marks", {})
    ticks = state["ticks"][0]
    end = ticks[-1]["t"]
    free = mean_op_s(ticks, marks.get("free", 0), marks.get("fault", 0))
    faulted = mean_op_s(ticks, marks.get("timed", end), end)
    wrong = sum(state["ticks"][r][-1]["wrong"] for r in range(hosts) if state["ticks"][r])
    c = usable_fraction(fault, args.rails)
    factor = 2 * (hosts - 1) / hosts if op == "all_reduce" else (hosts - 1) / hosts
    line = args.rails * args.rate_mbit * 1e6 / 8
    shares = [e["detail"] for e in state["events"] if e["ev"] == "rebalance" and e["rank"] == 0]
    return {"hosts": hosts, "op": op, "bytes": size, "fault": f"{fault[0]}{fault[1]}",
            "free_ms": free * 1e3, "fault_ms": faulted * 1e3, "ratio": free / faulted,
            "free_fill": size * factor / free / line, **model(op, hosts, c), "wrong": wrong,
            "rebalance_events_rank0": shares, "exit_codes": state["exit_codes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[4])
    ap.add_argument("--rails", type=int, default=4)
    ap.add_argument("--rate-mbit", type=float, default=300)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[16 << 20, 64 << 20, 256 << 20])
    ap.add_argument("--faults", nargs="+", type=parse_fault, default=[("down", 1), ("down", 2), ("host", 50)])
    ap.add_argument("--warmup", type=int, default=2, help="untimed ops first")
    ap.add_argument("--ops-free", type=int, default=4, help="fault-free ops timed (at least)")
    ap.add_argument("--ops-fault", type=int, default=4, help="fault-phase ops timed (at least)")
    ap.add_argument("--settle-ops", type=int, default=2, help="ops after the fault before timing")
    ap.add_argument("--settle", type=float, default=4.0, help="seconds after the fault before timing (at least)")
    ap.add_argument("--seconds", type=float, default=4.0, help="each timed phase lasts at least this long")
    ap.add_argument("--check-every", type=int, default=1, help="check every Nth result bit for bit")
    ap.add_argument("--values", choices=("order-sensitive", "exact"), default="order-sensitive",
                    help="floats whose sums depend on the order, checked against the first result "
                         "(default), or small integers checked against their exact sums (any order)")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="RECCL_* settings of the ranks")
    ap.add_argument("--json", metavar="PATH", help="also write the records here")
    args = ap.parse_args(argv)
    for item in args.env:
        if "=" not in item or not item.startswith("RECCL_"):
            ap.error(f"--env {item!r}: give RECCL_NAME=VALUE")
    import torch  # noqa: F401 - loads the libraries the extension links

    import torch_reccl._C as native

    command = f"python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}"
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"{command}\n{date}, load average {os.getloadavg()[0]:.1f}, {native.__file__}", flush=True)
    print(f"{'hosts':>5} {'fault':>6} {'op':>14} {'MiB':>4} {'free ms':>8} {'fault ms':>9} {'ratio':>6} "
          f"{'equal':>6} {'optimum':>7} {'fill':>5} {'wrong':>5}", flush=True)
    records = []
    for hosts in args.hosts:
        for fault in args.faults:
            for op in args.ops:
                for size in args.sizes:
                    r = measure(args, hosts, op, size, fault)
                    records.append(r)
                    print(f"{hosts:>5} {r['fault']:>6} {op:>14} {size >> 20:>4} {r['free_ms']:8.0f} "
                          f"{r['fault_ms']:9.0f} {r['ratio']:6.3f} {r['equal_bound']:6.3f} "
                          f"{r['optimum']:7.3f} {r['free_fill']:5.2f} {r['wrong']:>5}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"command": command, "date": date, "load_average": os.getloadavg()[0],
                                "rails": args.rails, "rate_mbit": args.rate_mbit, "env": args.env},
                       "results": records}, f, indent=1)
    return 0 if all(r["wrong"] == 0 and not any(r["exit_codes"]) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Faults in the emulated fabric under a steady collective load: the rank program
and the scenario driver that bench/grey_fabric.py, bench/shares_fabric.py and
tests/fabric/test_grey_fabric.py and test_shares_fabric.py share.

H emulated hosts (default 2) with K rails, one rank per host, the CPU engine
(one channel per NIC) running one collective back to back (all_reduce by
default; all_gather or reduce_scatter with --op). Every element of every
--check-every'th result is checked: against the closed form of small integers
(exact in any order), or with --order-sensitive against the bits of the run's
first result, on values of mixed sign and magnitude whose float sums change
with the summation order (a fault that changed any element's reduction order
would show). Each rank reports its NIC counters and the end time and length
of every op every TICK_S, and the grey-failure, failover and rebalance events
it sees; ``run_scenario`` hands them to a plan that makes the faults and says
when to stop. Needs root (network namespaces).

The rank program is this module: ``python -m torch_reccl.bench.grey_fabric --bytes N ...``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, Optional

EVENT_KINDS = ("degraded", "recovered", "failover", "failback", "rebalance", "nic_down", "nic_up")
TICK_S = 0.25  # how often a rank reports its counters


# ------------------------------------------------------------------ rank side


OPS = ("all_reduce", "all_gather", "reduce_scatter")


def rank_main(args) -> int:
    import random
    import threading

    import torch
    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.cli.launch import listen_for_commands, report

    stop = threading.Event()
    listen_for_commands(lambda m: stop.set() if m.get("cmd") == "stop" else None)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("reccl")
    torch_reccl.on_event(lambda e: report("event", rank=rank, ev=e.kind, nic=e.nic, t=e.time,
                                          reason=e.reason, detail=e.detail),
                         kinds=EVENT_KINDS)
    count = args.bytes // 4 // world * world  # the largest buffer, whole blocks per rank
    block = count // world

    def values(r: int, n: int):
        if args.order_sensitive:
            g = torch.Generator().manual_seed(1000 + r)
            return ((torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1)
                    * 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2)).float()
        # Small integers: every sum is exact in float32, so the check is bit for bit.
        return (torch.arange(n, dtype=torch.float32) % 1000) * (r + 1)

    if args.op == "all_reduce":
        base = values(rank, count)
        want = None if args.order_sensitive else (
            (torch.arange(count, dtype=torch.float32) % 1000) * (world * (world + 1) // 2))
        buf = torch.empty(count + 1, dtype=torch.float32)  # the last element: the stop vote
    elif args.op == "all_gather":
        base = values(rank, block)
        want = None if args.order_sensitive else torch.cat([values(r, block) for r in range(world)])
        out = torch.empty(count, dtype=torch.float32)
    else:
        base = values(rank, count)
        want = None if args.order_sensitive else (
            (torch.arange(count, dtype=torch.float32) % 1000)[rank * block:(rank + 1) * block]
            * (world * (world + 1) // 2))
        out = torch.empty(block, dtype=torch.float32)
    vote = torch.zeros(1)
    rng = random.Random(1234)  # the same sizes on every rank
    ops = wrong = 0
    done_bytes = 0
    op_times = []  # (end wall time, seconds) of the ops since the last tick
    next_tick = 0.0
    deadline = time.monotonic() + args.max_seconds

    def tick(final: bool = False) -> None:
        stats = torch_reccl.stats()
        report("tick", rank=rank, t=time.time(), ops=ops, bytes=done_bytes, wrong=wrong,
               final=final, op_times=list(op_times),
               nics={n: {"sent": s["bytes_sent"], "busy_bytes": s["busy_bytes"],
                         "grey": s["grey"]} for n, s in stats["nics"].items()},
               spreading=sorted(sorted(c["nics"]) for c in stats["spreading"]))
        op_times.clear()

    while True:
        voting = rank == 0 and (stop.is_set() or time.monotonic() > deadline)
        started = time.perf_counter()
        if args.op == "all_reduce":
            n = count
            if args.bursty:  # a lighter, irregular load: random sizes and pauses
                n = max(1024, int(count * rng.choice((0.01, 0.05, 0.25, 1.0))))
                time.sleep(rng.choice((0.0, 0.0, 0.01, 0.05)))
                started = time.perf_counter()
            buf[:n].copy_(base[:n])
            buf[n] = 1.0 if voting else 0.0
            view = torch.cat([buf[:n], buf[count:]]) if n < count else buf
            dist.all_reduce(view)
            result, stopping = view[:n], view[-1].item() > 0
        else:
            n = count
            if args.op == "all_gather":
                dist.all_gather_into_tensor(out, base)
            else:
                dist.reduce_scatter_tensor(out, base)
            result = out
            vote[0] = 1.0 if voting else 0.0
            dist.all_reduce(vote)  # the stop vote: one small op (recursive doubling)
            stopping = vote[0].item() > 0
        op_times.append((time.time(), time.perf_counter() - started))
        ops += 1
        done_bytes += n * 4
        if want is None and ops == 1:
            want = result.clone()  # the fault-free bits every later result must equal
        elif ops % args.check_every == 0 and not torch.equal(result, want[:len(result)]):
            wrong += int((result != want[:len(result)]).sum())
        if stopping:
            break  # only the final tick follows the stop: the other ranks may be tearing down
        if time.monotonic() >= next_tick:
            tick()
            next_tick = time.monotonic() + TICK_S
    tick(final=True)
    dist.destroy_process_group()
    return 1 if wrong else 0


# ------------------------------------------------------------------ driver


def run_scenario(rails: int, rate_mbit: float, env: Dict[str, str], plan: Callable,
                 size_bytes: int = 16 << 20, bursty: bool = False, max_seconds: float = 60.0,
                 name_prefix: str = "g", check_every: int = 1,
                 before: Optional[Callable] = None, hosts: int = 2, op: str = "all_reduce",
                 order_sensitive: bool = False) -> dict:
    """Builds a fabric of `hosts` hosts, runs the rank program under `env`, and
    calls ``plan(fabric, state) -> bool`` every tick (state: "t0" the first
    tick's wall time, "ticks" per rank, "events"); the run ends when it returns
    True (or after max_seconds). ``before(fabric)``, if given, makes faults
    before the ranks start (their time in state["faults"]). Returns the ticks,
    events and exit codes."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not valid; valid ops: {', '.join(OPS)}")
    if bursty and op != "all_reduce":
        raise ValueError("bursty load is all_reduce's only")
    from torch_reccl.cli.launch import FabricPlacement, Job, LaunchError, unique_fabric_name
    from torch_reccl.fabric import Fabric

    fabric = Fabric(hosts=hosts, rails=rails, rate_mbit=rate_mbit, name=unique_fabric_name(name_prefix))
    argv = [sys.executable, "-m", "torch_reccl.bench.grey_fabric", "--bytes", str(size_bytes),
            "--max-seconds", str(max_seconds), "--check-every", str(check_every), "--op", op] + (
                ["--bursty"] if bursty else []) + (["--order-sensitive"] if order_sensitive else [])
    state = {"t0": None, "ticks": {r: [] for r in range(hosts)}, "events": [], "faults": []}
    with fabric:
        if before is not None:
            before(fabric)
            state["faults"].append(("before", time.time()))
        with Job(FabricPlacement(fabric), argv, env=env, commands=True) as job:
            deadline = time.monotonic() + max_seconds + 60
            stopped = False
            while time.monotonic() < deadline:
                got = job.next_message(0.1)
                if got is not None:
                    rank, msg = got
                    if msg["kind"] == "tick":
                        state["ticks"][rank].append(msg)
                        if state["t0"] is None:
                            state["t0"] = msg["t"]
                    elif msg["kind"] == "event":
                        state["events"].append(msg)
                if not stopped and state["t0"] is not None and plan(fabric, state):
                    job.send(0, {"cmd": "stop"})
                    stopped = True
                if job.failed_ranks():
                    raise LaunchError(f"rank(s) {job.failed_ranks()} failed\n{job.logs()}")
                if job.all_exited():
                    job.wait(5.0)
                    while (got := job.next_message(0)) is not None:
                        rank, msg = got
                        if msg["kind"] == "tick":
                            state["ticks"][rank].append(msg)
                        elif msg["kind"] == "event":
                            state["events"].append(msg)
                    break
            else:
                raise LaunchError(f"no end within {max_seconds + 60:.0f} s\n{job.logs()}")
            state["exit_codes"] = job.exit_codes()
            state["logs"] = job.logs()
    return state


def rank_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="one rank of run_scenario's job (run_scenario starts it)")
    ap.add_argument("--bytes", type=int, required=True, help="all_reduce size")
    ap.add_argument("--max-seconds", type=float, required=True, help="rank 0 stops the job after this")
    ap.add_argument("--check-every", type=int, required=True, help="check every element of every Nth result")
    ap.add_argument("--bursty", action="store_true", help="random sizes and pauses (all_reduce)")
    ap.add_argument("--op", choices=OPS, default="all_reduce", help="the collective run back to back")
    ap.add_argument("--order-sensitive", action="store_true",
                    help="floats whose sums depend on the order, checked against the first result")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(rank_main(rank_args()))

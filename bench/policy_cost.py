"""What a FaultPolicy costs a fault-free training step: ``policy.step()`` against a
bare broadcast of the same 9 float64 values, both timed on rank 0.

Two (--ranks) processes over the "reccl" backend on loopback NICs 127.0.0.1 and
127.0.0.2, no training: --steps calls of ``policy.step()`` (listening to the
job-wide events, as in a job), each followed by one bare ``broadcast``. Reports the
median and p90 of each, in microseconds; with ``--decide-every N`` the policy
decides (and broadcasts) only every N steps and at checkpoint steps.

    python bench/policy_cost.py [--steps 1000] [--ranks 2] [--decide-every 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torch_reccl.cli.launch import free_port, spawn_bounded  # noqa: E402

WARMUP = 50


def rank_main(rank: int, world: int, port: int, steps: int, decide_every: int, out: str) -> None:
    os.environ["RECCL_NICS"] = "127.0.0.1,127.0.0.2"
    import time

    import torch
    import torch.distributed as dist

    import torch_reccl  # noqa: F401 - registers "reccl"
    from torch_reccl.policy import FaultPolicy

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("reccl", store=store, rank=rank, world_size=world)
    policy = FaultPolicy(10 ** 6, decide_every=decide_every)
    values = torch.zeros(9, dtype=torch.float64)
    policy_s, broadcast_s = [], []
    for step in range(1, WARMUP + steps + 1):
        begin = time.perf_counter()
        policy.step(step)
        middle = time.perf_counter()
        dist.broadcast(values, 0)
        end = time.perf_counter()
        if step > WARMUP:
            policy_s.append(middle - begin)
            broadcast_s.append(end - middle)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"policy_step_s": policy_s, "broadcast_s": broadcast_s}, f)
    policy.close()
    dist.destroy_process_group()


def summary(samples: list) -> dict:
    ordered = sorted(samples)
    return {"median_us": 1e6 * statistics.median(ordered),
            "p90_us": 1e6 * ordered[int(0.9 * (len(ordered) - 1))]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--decide-every", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.ranks < 2 or args.decide_every < 1:
        parser.error("need --steps >= 1, --ranks >= 2, --decide-every >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        spawn_bounded(rank_main, (args.ranks, free_port(), args.steps, args.decide_every, out),
                      args.ranks, timeout_s=120 + args.steps * 0.05)
        with open(out) as f:
            raw = json.load(f)
    result = {"policy_step": summary(raw["policy_step_s"]), "broadcast": summary(raw["broadcast_s"]),
              "args": vars(args)}
    print(f"policy.step(): median {result['policy_step']['median_us']:.0f} us, "
          f"p90 {result['policy_step']['p90_us']:.0f} us; bare broadcast of 9 doubles: median "
          f"{result['broadcast']['median_us']:.0f} us, p90 {result['broadcast']['p90_us']:.0f} us "
          f"({args.ranks} ranks, {args.steps} steps, decide_every {args.decide_every})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

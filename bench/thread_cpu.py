"""Where a large collective's CPU goes: the CPU time of each thread of a rank,
by thread name, per op, for reccl and Gloo in the same invocation.

N processes on this machine (one per rank, one torch thread each) run
--warmup untimed then --iters back-to-back all_reduces of --mib MiB (float32)
on the world group; each rank reads its threads' utime and stime
(/proc/self/task/*/stat) before and after the timed loop. Printed per backend:
the time per op (the slowest rank), busbw (nccl-tests' 2(N-1)/N factor) and
rank 0's CPU ms per op by thread name, user and system. E.g. reccl's
"reccl-io" (the event loops: socket and same-host read system calls) against
"reccl-worker" (the engine: reductions), and Gloo's caller thread against its
loop thread. CPU times come in clock ticks (10 ms): use enough --iters that
each thread's share is many ticks.

    python bench/thread_cpu.py --ranks 8 --mib 16 --iters 30
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import List

from reccl_bench_runs import load_standalone, write_json  # beside this file

# The repository, for the reccl ranks' `import torch_reccl` (spawned ranks inherit sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# by path: the package torch_reccl stays unimported (Gloo's ranks must not import it)
procstat = load_standalone("bench.procstat")


def rank_main(rank: int, size: int, port: int, backend: str, mib: int, warmup: int, iters: int,
              timeout_s: float, results) -> None:
    import torch
    import torch.distributed as dist

    if backend == "reccl":
        import torch_reccl  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    x = torch.ones(mib << 18)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    before, t0 = procstat.threads(), time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    per_op = (time.perf_counter() - t0) / iters
    after = procstat.threads()
    dist.destroy_process_group()
    results.put((rank, per_op, procstat.cpu_ms_by_name(before, after, iters)))


def run(backend: str, size: int, mib: int, warmup: int, iters: int, timeout_s: float) -> dict:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:  # a free port for the job's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, backend, mib, warmup, iters, timeout_s, results))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        replies = sorted(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    slowest = max(per_op for _, per_op, _ in replies)
    return {"backend": backend, "ranks": size, "mib": mib, "iters": iters, "ms_per_op": slowest * 1e3,
            "busbw_GBps": 2 * (size - 1) / size * (mib << 20) / slowest / 1e9,
            "rank0_cpu_ms_per_op": replies[0][2]}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8])
    p.add_argument("--backends", nargs="+", choices=("reccl", "gloo"), default=["reccl", "gloo"])
    p.add_argument("--mib", type=int, default=16, help="all_reduce size, MiB")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=240.0, help="bound on each job (s)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.ranks) or args.mib < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--ranks must be at least 2, --mib and --iters at least 1, --warmup at least 0")
    runs = []
    for size in args.ranks:
        for backend in args.backends:
            r = run(backend, size, args.mib, args.warmup, args.iters, args.timeout)
            runs.append(r)
            print(f"{backend} N={size} {args.mib} MiB all_reduce: {r['ms_per_op']:.2f} ms/op, "
                  f"busbw {r['busbw_GBps']:.2f} GB/s; rank 0 CPU per op by thread:")
            for name, (user, system) in sorted(r["rank0_cpu_ms_per_op"].items(), key=lambda kv: -sum(kv[1])):
                if user + system > 0:
                    print(f"    {name:20s} {user + system:7.2f} ms (user {user:.2f}, system {system:.2f})")
    write_json(args.json, {"cores": os.cpu_count(), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""An all_reduce among the processes of one host with no collective library
at all: every rank's data goes through one shared mapping, so no byte is read
from another process by a syscall and no message is sent. A reference for
what a same-host all_reduce without library, sockets or engine reaches on
this machine; not an upper bound (at 8 ranks on 16 cores reccl's ring beats
it: it moves less memory there). docs/scale.md, "Where the machine is the
limit".

P processes each hold a float32 buffer. The buffer is cut into pieces of at
most --piece-mib MiB; per piece, each rank copies its piece into its slot of
the shared mapping, all meet at a barrier, each rank sums its 1/P of the
piece over every slot (in rank order) into a shared result, all meet again,
and each rank copies the whole result out. Two slot sets take turns, so the
copy-in of one piece overlaps no read of the one before (2 barriers per
piece). Per rank that moves about 5x the buffer through memory (copy in and
out: 2 each; the sum reads a buffer's worth and writes 1/P), against ~7x
(N-1)/N for a ring by process_vm_readv.

busbw as nccl-tests: algbw x 2(P-1)/P from the slowest rank's mean time.
Results are checked bit for bit (inputs are small integers). The mapping
takes 2 x P x piece bytes.

    python bench/shared_allreduce.py --procs 8 16 32 --mib 16 64
    python bench/allreduce_algos.py --ranks 16 32 --shm   (beside reccl and Gloo)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import List

from reccl_bench_runs import run_forked_ranks, write_runs  # beside this file

BARRIER_S = 60.0  # one barrier; a rank that died breaks it for the others


def _rank(rank: int, procs: int, count: int, piece: int, warmup: int, iters: int, slots, sums, barrier,
          results) -> None:
    import torch

    torch.set_num_threads(1)
    data = torch.full((count,), float(rank + 1), dtype=torch.float32)
    out = torch.empty(count, dtype=torch.float32)

    def all_reduce() -> None:
        for turn, start in enumerate(range(0, count, piece)):
            n = min(piece, count - start)
            share = n // procs
            lo, hi = rank * share, (n if rank == procs - 1 else (rank + 1) * share)
            slot, total = slots[turn % 2], sums[turn % 2]
            slot[rank, :n].copy_(data[start:start + n])
            barrier.wait(BARRIER_S)
            torch.sum(slot[:, lo:hi], dim=0, out=total[lo:hi])
            barrier.wait(BARRIER_S)
            out[start:start + n].copy_(total[:n])

    try:
        for _ in range(max(1, warmup)):
            all_reduce()
        wrong = int((out != float(procs * (procs + 1) // 2)).sum())
        barrier.wait(BARRIER_S)
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce()
        elapsed = (time.perf_counter() - start) / iters
        results.put((rank, elapsed, wrong, None))
    except Exception as e:  # reported, not hung on: the parent bounds every wait
        barrier.abort()
        results.put((rank, 0.0, 0, f"{type(e).__name__}: {e}"))


def measure(procs: int, nbytes: int, piece_bytes: int, warmup: int = 2, iters: int = 10) -> dict:
    """One shared-memory all_reduce of `nbytes` of float32 per rank among `procs`
    processes, `iters` timed after `warmup`."""
    import torch

    if procs < 2:
        raise ValueError(f"procs must be 2 or more, got {procs}")
    count = max(procs, nbytes // 4)
    piece = max(procs, min(count, piece_bytes // 4))
    slots = [torch.empty((procs, piece), dtype=torch.float32).share_memory_() for _ in range(2)]
    sums = [torch.empty(piece, dtype=torch.float32).share_memory_() for _ in range(2)]
    barrier = mp.get_context("fork").Barrier(procs)
    t, wrong = run_forked_ranks(f"shared all_reduce with {procs} processes", procs, _rank,
                                (procs, count, piece, warmup, iters, slots, sums, barrier), BARRIER_S + 5,
                                timeout_s=120 + 2.0 * (warmup + iters) * procs)
    size = count * 4
    return {"kind": "result", "op": "all_reduce", "bytes": size, "count": count, "dtype": "float32",
            "procs": procs, "piece_bytes": piece * 4, "iters": iters, "time_us": t * 1e6,
            "algbw": size / t / 1e9, "busbw": size * 2 * (procs - 1) / procs / t / 1e9,
            "wrong": wrong}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 8, 16], help="processes (2 or more)")
    p.add_argument("--mib", type=float, nargs="+", default=[16.0], help="float32 buffer per rank, MiB")
    p.add_argument("--piece-mib", type=float, default=16.0,
                   help="MiB of each rank's buffer through the mapping at a time (default 16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="timed all_reduces")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.procs):
        p.error(f"--procs: every value must be 2 or more, got {args.procs}")
    if any(m <= 0 for m in args.mib) or args.piece_mib <= 0 or args.iters < 1 or args.warmup < 0:
        p.error(f"--mib and --piece-mib must be > 0, --iters >= 1 and --warmup >= 0; got --mib {args.mib} "
                f"--piece-mib {args.piece_mib} --iters {args.iters} --warmup {args.warmup}")
    runs = []
    print(f"{os.cpu_count()} cores; shared-memory all_reduce, float32, {args.iters} timed")
    for procs in args.procs:
        for mib in args.mib:
            run = measure(procs, int(mib * (1 << 20)), int(args.piece_mib * (1 << 20)), args.warmup, args.iters)
            runs.append(run)
            print(f"  P={procs:3d} {mib:g} MiB: {run['time_us'] / 1e3:8.2f} ms, busbw {run['busbw']:6.2f} GB/s, "
                  f"wrong {run['wrong']}", flush=True)
    write_runs(args.json, args, runs)
    return 1 if any(r["wrong"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

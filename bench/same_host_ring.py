"""What a reduce-scatter among the processes of one host costs when a rank
reads its peers' chunks with process_vm_readv (reccl's same-host reads today),
whole or piece by piece, ring or direct, against reading them straight from
memory the processes share, with no collective library, no sockets and no
engine around it.

P processes each hold --mib MiB of float32 cut into P segments. In the ring
modes, at step s every rank adds the segment its predecessor just finished
into its own copy of that segment, and all ranks meet at a barrier; after
P - 1 steps each holds the sum of one segment over all ranks. The direct mode
has no steps (below). Results are checked bit for bit (inputs are small
integers).

* ``read``: a rank's buffer is private; the predecessor's segment is copied
  into a slot with ``process_vm_readv`` and the slot is added into ours (one
  kernel copy, pinning the peer's pages, then a reduction).
* ``fused``: as ``read``, but the segment is read and added piece by piece
  (--piece-kib) through a slot small enough to stay in the core's cache, so
  the copy is never written out to memory and read back (reducing while
  reading).
* ``direct``: not a ring: each rank adds every other rank's copy of its own
  segment into its own, read piece by piece as in ``fused``; one barrier at
  the end instead of one per step, and no partial sum is ever written out.
* ``shared``: every rank's buffer lies in one shared mapping; the
  predecessor's segment is added straight into ours (a reduction only).

shared/read bounds what a same-host path through shared memory could gain in
the reduce-scatter half of an all_reduce over reccl's same-host reads on this
machine (docs/design.md §14). The ring modes pay a barrier
per step (a semaphore handshake), which direct does not: direct/read is not
what the engine's pipelined ring would gain (docs/design.md §14).

    python bench/same_host_ring.py --procs 2 8 16 --json ring.json
    python bench/same_host_ring.py --procs 16 32 --modes read fused direct --piece-kib 64
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import sys
import time
from typing import List

from reccl_bench_runs import run_forked_ranks, write_runs  # beside this file

BARRIER_S = 60.0  # one barrier; a rank that died breaks it for the others

MODES = ("read", "fused", "direct", "shared")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                      ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _rank(rank: int, procs: int, mode: str, count: int, piece_bytes: int, reps: int, shared, addresses, pids,
          barrier, results) -> None:
    import torch

    torch.set_num_threads(1)
    seg = count // procs
    if mode == "shared":
        buffer = shared[rank]
    else:
        buffer = torch.empty(count, dtype=torch.float32)
    piece = min(seg, max(1, piece_bytes // 4)) if mode in ("fused", "direct") else seg  # elements per read
    slot = torch.empty(piece, dtype=torch.float32)
    addresses[rank] = buffer.data_ptr()
    pids[rank] = os.getpid()
    libc = _libc()
    prev = (rank - 1) % procs

    def fill() -> None:
        buffer.fill_(float(rank + 1))

    def add_read(mine, peer: int, first: int) -> None:
        """mine += the peer's elements [first, first + len(mine)), read piece by piece."""
        for start in range(0, mine.numel(), piece):
            n = min(piece, mine.numel() - start)
            local = _IoVec(slot.data_ptr(), n * 4)
            remote = _IoVec(addresses[peer] + (first + start) * 4, n * 4)
            got = libc.process_vm_readv(pids[peer], ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got != n * 4:
                raise OSError(ctypes.get_errno(),
                              f"process_vm_readv from rank {peer}: {os.strerror(ctypes.get_errno())}")
            mine[start:start + n].add_(slot[:n])

    def step(s: int) -> None:
        j = (rank - 1 - s) % procs  # the segment the predecessor finished at step s - 1
        mine = buffer[j * seg:(j + 1) * seg]
        if mode == "shared":
            mine.add_(shared[prev][j * seg:(j + 1) * seg])
        else:
            add_read(mine, prev, j * seg)
        barrier.wait(BARRIER_S)

    def reduce_scatter() -> None:
        if mode != "direct":
            for s in range(procs - 1):
                step(s)
            return
        # Our own segment, every other rank's copy of it added in, piece by
        # piece (peers in rotation so that no rank is read by all at once);
        # peers only write their own segments meanwhile.
        for shift in range(1, procs):
            add_read(buffer[rank * seg:(rank + 1) * seg], (rank + shift) % procs, rank * seg)
        barrier.wait(BARRIER_S)

    try:
        barrier.wait(BARRIER_S)  # every address and pid published
        fill()
        barrier.wait(BARRIER_S)
        reduce_scatter()  # warm-up pass, then checked
        # Every rank's sum: the ring's last step adds into segment rank + 1.
        final = rank if mode == "direct" else (rank + 1) % procs
        expected = float(procs * (procs + 1) // 2)
        wrong = int((buffer[final * seg:(final + 1) * seg] != expected).sum())
        elapsed = 0.0
        for _ in range(reps):
            fill()
            barrier.wait(BARRIER_S)
            start = time.perf_counter()
            reduce_scatter()
            elapsed += time.perf_counter() - start
        results.put((rank, elapsed / reps, wrong, None))
    except Exception as e:  # reported, not hung on: the parent bounds every wait
        barrier.abort()
        results.put((rank, 0.0, 0, f"{type(e).__name__}: {e}"))


def measure(procs: int, mode: str, mib: int, reps: int, piece_bytes: int = 64 << 10) -> dict:
    """One reduce-scatter (``mode``) of ``mib`` MiB per rank among ``procs`` processes, ``reps`` times."""
    import torch

    ctx = mp.get_context("fork")
    count = (mib << 20) // 4 // procs * procs
    shared = [torch.empty(count, dtype=torch.float32).share_memory_() for _ in range(procs)] \
        if mode == "shared" else None
    addresses, pids = ctx.Array(ctypes.c_uint64, procs, lock=False), ctx.Array(ctypes.c_int, procs, lock=False)
    t, wrong = run_forked_ranks(f"{mode} with {procs} processes", procs, _rank,
                                (procs, mode, count, piece_bytes, reps, shared, addresses, pids, ctx.Barrier(procs)),
                                BARRIER_S + 5, timeout_s=120 + 2.0 * reps * procs)
    nbytes = count * 4
    return {"procs": procs, "mode": mode, "bytes_per_rank": nbytes, "reps": reps, "t_s": t,
            "piece_bytes": piece_bytes if mode in ("fused", "direct") else None,
            "busbw_GBps": nbytes * (procs - 1) / procs / t / 1e9,
            "wrong": wrong}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 8, 16], help="processes in the ring (2 or more)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--mib", type=int, default=16, help="float32 buffer per rank, MiB")
    p.add_argument("--reps", type=int, default=10, help="timed reduce-scatters")
    p.add_argument("--piece-kib", type=int, default=64, help="fused and direct modes: KiB read and added at a time")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.procs):
        p.error(f"--procs: every value must be 2 or more, got {args.procs}")
    if args.mib < 1 or args.reps < 1 or args.piece_kib < 1:
        p.error(f"--mib, --reps and --piece-kib must be 1 or more, got --mib {args.mib} --reps {args.reps} "
                f"--piece-kib {args.piece_kib}")
    runs = []
    print(f"{os.cpu_count()} cores; reduce-scatter of {args.mib} MiB float32 per rank, {args.reps} timed")
    for procs in args.procs:
        row = {}
        for mode in args.modes:
            run = measure(procs, mode, args.mib, args.reps, args.piece_kib << 10)
            runs.append(run)
            row[mode] = run
            print(f"  P={procs:3d} {mode:6s}: {run['t_s'] * 1e3:8.2f} ms, busbw {run['busbw_GBps']:6.2f} GB/s, "
                  f"wrong {run['wrong']}")
        for faster in ("fused", "direct", "shared"):
            if faster in row and "read" in row:
                print(f"  P={procs:3d} {faster}/read: {row[faster]['busbw_GBps'] / row['read']['busbw_GBps']:.2f}x")
    write_runs(args.json, args, runs)
    return 1 if any(r["wrong"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The machine's memory ceiling: how many bytes per second P processes of this
machine can copy at once (memmove between two buffers larger than the caches),
with no collective library and no sockets.

Every byte a same-host collective moves is copied at least once (reccl's
same-host reads: one process_vm_readv per byte received; TCP on loopback: two
kernel copies) and a reduction reads two operands and writes one. When the
memory traffic a library's op needs, at the busbw it reaches, is near this
ceiling, the machine's memory is the limit, not the library (docs/benchmarks.md
reads it beside bench/scale.py's busbw).

    python bench/memory_ceiling.py --procs 1 4 8 16 --json memory.json
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import platform
import sys
import time
from typing import List

from reccl_bench_runs import write_json  # beside this file


def _copier(mib: int, seconds: float, ready, go, results) -> None:
    src = bytearray(os.urandom(1 << 20)) * mib
    dst = bytearray(len(src))
    s = (ctypes.c_char * len(src)).from_buffer(src)
    d = (ctypes.c_char * len(dst)).from_buffer(dst)
    ctypes.memmove(d, s, len(src))  # touch every page before timing
    ready.release()
    go.wait(60)
    copied, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        ctypes.memmove(d, s, len(src))
        copied += len(src)
    results.put((copied, time.perf_counter() - start))


def measure(procs: int, mib: int, seconds: float) -> dict:
    """Aggregate memmove rate of ``procs`` processes copying ``mib`` MiB buffers at once."""
    ctx = mp.get_context("fork")
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_copier, args=(mib, seconds, ready, go, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            if not ready.acquire(timeout=120):
                raise TimeoutError("a copier did not start within 120 s")
        go.set()
        per = [results.get(timeout=seconds + 60) for _ in workers]
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    rate = sum(c / t for c, t in per)
    return {"procs": procs, "mib": mib, "copy_GBps": rate / 1e9,
            "traffic_GBps": 2 * rate / 1e9,  # each copied byte is read once and written once
            "per_proc_copy_GBps": [c / t / 1e9 for c, t in per]}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 4, 8, 16], help="processes copying at once")
    p.add_argument("--mib", type=int, default=64, help="buffer size per process (MiB), above the caches")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.procs) or args.mib < 1 or args.seconds <= 0:
        p.error("--procs and --mib must be at least 1 and --seconds positive")
    runs = [measure(n, args.mib, args.seconds) for n in args.procs]
    print(f"memory ceiling on {platform.node()} ({os.cpu_count()} cores), {args.mib} MiB buffers:")
    for r in runs:
        print(f"  {r['procs']:3d} processes: copy {r['copy_GBps']:6.1f} GB/s "
              f"(memory traffic {r['traffic_GBps']:6.1f} GB/s)")
    write_json(args.json, {"cores": os.cpu_count(), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The loopback ring's ceiling: how fast N processes on this machine can move
bytes around a ring of plain TCP sockets, with no collective library at all.

Every rank sends to the next rank and receives from the previous one over
--socks sockets each (a sender and a receiver thread per socket, 1 MiB
writes, recv_into a reused buffer), all ranks at once, for --seconds. A ring
all_reduce (reduce-scatter, then all-gather) makes each rank send and receive
exactly its busbw in bytes per second, and reduces as well, so its busbw over
TCP on this machine cannot exceed the slowest rank's rate here: when a library
gets close to it, the machine (the kernels' copies, the cores) is the limit,
not the library. bench/scale.py runs it for each N beside reccl and Gloo.

    python bench/wire_ceiling.py --ranks 2 8 16 --json ceiling.json
"""
from __future__ import annotations

import argparse
import os
import sys

from reccl_bench_runs import write_json  # beside this file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.scaling.ceiling import ring_ceiling  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--socks", type=int, default=4, help="sockets from each rank to the next")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = []
    for n in args.ranks:
        result = ring_ceiling(n, args.socks, args.seconds)
        results.append(result)
        print(f"{n:4d} ranks, {args.socks} sockets each way: {result['min_GBps']:.3f} GB/s per rank "
              f"(slowest), {result['median_GBps']:.3f} (median)")
    if args.json:
        write_json(args.json, {"argv": sys.argv, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What failover support costs when nothing fails: reccl against itself.

Runs `reccl bench` (loopback NICs, CPU, all_reduce) alternately with the default
settings and with failover support off (RECCL_BACKUP=0: no backup paths;
RECCL_HEARTBEAT_MS=60000: heartbeats effectively off; RECCL_DCR=0: no control
plane decisions), --rounds times each, and prints per size the median busbw of
each and their ratio. Alternating rounds in one invocation spreads machine noise
over both sides.

    python bench/failover_overhead.py [--ranks 2] [--rounds 3] [--sizes 1M 256M]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from reccl_bench_runs import run_bench, write_json

WITHOUT = {"RECCL_BACKUP": "0", "RECCL_HEARTBEAT_MS": "60000", "RECCL_DCR": "0"}


def bench(extra_env: dict, args, path: str) -> dict:
    argv = ["--ranks", str(args.ranks), "--ops", "all_reduce", "--min-bytes", args.sizes[0],
            "--max-bytes", args.sizes[-1], "--warmup", str(args.warmup), "--iters", str(args.iters)]
    record = run_bench(argv, extra_env, path, args.timeout)
    return {row["bytes"]: next(iter(row["variants"].values()))["busbw"] for row in record["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=["1M", "256M"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json")
    args = parser.parse_args()
    on, off = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, env, sink in (("on", {}, on), ("off", WITHOUT, off)):
                for size, bw in bench(env, args, os.path.join(tmp, f"{name}{r}.json")).items():
                    sink.setdefault(size, []).append(bw)
    print(f"all_reduce busbw (GB/s), {args.ranks} ranks, loopback NICs, median of {args.rounds} "
          f"alternating rounds")
    print(f"{'size(B)':>12} {'failover on':>12} {'off':>8} {'on/off':>7}")
    result = []
    for size in sorted(on):
        a, b = statistics.median(on[size]), statistics.median(off[size])
        print(f"{size:>12} {a:12.3f} {b:8.3f} {a / b:7.3f}")
        result.append({"size": size, "on": on[size], "off": off[size], "ratio": a / b})
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

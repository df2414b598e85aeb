"""Scale: what groups, rendezvous and an idle job cost, reccl against Gloo in the same run.

For each N in --ranks and each backend (reccl, gloo; same invocation, same harness)
the launcher starts N rank processes on 127.0.0.1 (one process per rank, started
with subprocess, torch.set_num_threads(1) in each) and hosts the rendezvous store
itself: the real c10d TCPStore server (is_master=True, wait_for_workers=False)
behind a counting TCP proxy (one thread, one epoll selector for every connection)
that the ranks connect to. Every store request of every rank (also those of
cloned stores, which connect to the same address) passes the proxy, which counts
them per phase. The phases are driven by the launcher over each rank's stdin
(commands) and a private pipe (replies), never through the store:

    start        ranks import torch (and torch_reccl), report their pid
    init         TCPStore client through the proxy, init_process_group
    create       Megatron-like group set: world, tensor-parallel pairs (2k, 2k+1),
                 data-parallel groups (ranks with equal r % 2), 4 more world-sized
                 groups (dist.new_group(list(range(N))) x 4): 1 + N/2 + 2 + 4
                 groups in the job, 7 per rank
    first_use    one small all_reduce on every group the rank is in (exact check)
    settle       --settle-s of quiet before the window
    idle         --idle-s window: store requests (proxy), CPU seconds of all ranks
                 (/proc/<pid>/stat utime+stime); around it, context switches of every
                 thread (/proc/<pid>/task/*/status); then threads per rank
                 (/proc/<pid>/task, broken down by /proc/<pid>/task/*/comm) and open
                 fds (/proc/<pid>/fd)
    collectives  world group: 4-byte all_reduce latency (per rank: median of
                 --small-iters timed ops after --warmup; reported: the max over ranks
                 of the per-rank medians)
    busbw        one phase per (op, size) of --busbw-ops x --busbw-sizes-mib (default:
                 all_reduce of 16 MiB), on the world group: per rank, the untimed
                 ops, each checked, a barrier, the timed ops back to back (as
                 nccl-tests), then one more checked op; per rank the loop's time
                 per op; t = the max over ranks of those; busbw as nccl-tests:
                 algbw = bytes / t, busbw = algbw x 2(N-1)/N (all_reduce) or
                 (N-1)/N (all_gather, reduce_scatter).
                 "bytes" is the size given, as in nccl-tests the largest buffer of
                 the op (rounded down to a multiple of 4N for the last two):
                   all_reduce      the buffer each rank reduces (input = output)
                   all_gather      the gathered output; each rank sends bytes/N
                   reduce_scatter  each rank's input; each rank gets bytes/N
                 so a rank holds about 1.25 x bytes whatever N (the buffers plus a
                 uint8 copy of the input pattern). Op counts per size: at 16 MiB
                 max(1, --warmup/2) untimed and --busbw-iters timed; other sizes
                 scale both by 16 MiB/size (timed: min(2, iters) .. 4 x iters;
                 untimed: 1 .. warmup/2), the same for reccl and Gloo.
                 Also the CPU time of every thread of every rank during the
                 timed ops, per op, and "cores kept busy" = that / t: when it
                 is near the machine's cores, the CPUs are the limit.

Every result of every checked op is compared bit for bit (the 4-byte all_reduces
and, per busbw phase, the untimed ops and one after the timed loop; inputs are
integer-valued floats: (element index % 251) + rank, so every sum is exact in
float32; all_gather and reduce_scatter outputs are set to -1 before each checked
op, so an unwritten output fails).
The shapes, bus factors and collective calls are those of torch_reccl/bench/rank.py
(``reccl bench``), loaded by path.

Every phase is bounded by --phase-timeout; a job that does not finish in its bound
is reported as "did not finish (<phase>)" and its ranks are killed.

    python bench/scale.py                      # N = 4 8 16 ... up to 8 x cores
    python bench/scale.py --ranks 4 8 --idle-s 10 --json scale.json
    python bench/scale.py --ranks 2 4 8 --busbw-sizes-mib 1 4 16 64 256 \\
        --busbw-ops all_reduce all_gather reduce_scatter

Output: a Markdown table per machine on stdout (reccl, gloo, reccl/gloo; one
"<size> <op> busbw (GB/s)" row per measured (op, size)), and the full record
(per-phase store counts with samples of the requests seen, per-rank numbers,
thread names; per (op, size): bytes, op counts, t, every rank's mean, algbw and
busbw) with --json. docs/scale.md explains every column.

Store requests are counted two ways by the proxy, "reads" and parsed "requests"
(torch_reccl/bench/scaling/store.py).

The code is the package torch_reccl.bench.scaling (its __init__.py lists its modules, one
per thing measured, around one runner; tests/tools/test_scale.py imports them); this
script is its command line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.scaling.busbw import OPS  # noqa: E402
from torch_reccl.bench.scaling.ceiling import ring_ceiling  # noqa: E402
from torch_reccl.bench.scaling.report import BACKENDS, format_ceilings, format_table, machine_info  # noqa: E402
from torch_reccl.bench.scaling.runner import rank_env, run_job  # noqa: E402

DEFAULT_RANKS = (4, 8, 16, 32, 64, 128)


def main(argv: Optional[List[str]] = None) -> int:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+",
                        help=f"job sizes (even); default: those of {DEFAULT_RANKS} up to 8 x cores")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle window (s)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="quiet time before the window (s)")
    parser.add_argument("--phase-timeout", type=float, default=180.0, help="bound on every phase (s)")
    parser.add_argument("--op-timeout", type=float, default=120.0, help="the process groups' timeout (s)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--small-iters", type=int, default=50, help="timed 4-byte all_reduces")
    parser.add_argument("--busbw-sizes-mib", type=float, nargs="+", default=[16.0], metavar="MIB",
                        help="busbw sizes, MiB (2^20 bytes), as nccl-tests: the largest buffer, the "
                             "all_gather output, the reduce_scatter input (default: 16)")
    parser.add_argument("--busbw-ops", nargs="+", choices=OPS, default=["all_reduce"],
                        help="collectives whose busbw is measured at every size (default: all_reduce)")
    parser.add_argument("--busbw-iters", "--large-iters", dest="busbw_iters", type=int, default=5,
                        help="timed ops at 16 MiB; other sizes scale by 16 MiB / size, within "
                             "min(2, this) .. 4 x this (busbw_counts)")
    parser.add_argument("--ceiling-s", type=float, default=2.0,
                        help="seconds of the loopback ring ceiling (bench/wire_ceiling.py) run for each N "
                             "before its jobs: the busbw plain TCP reaches on this machine; 0 skips it")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="fork: one zygote imports torch and forks the ranks (fast start); "
                             "spawn: one fresh interpreter per rank")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the ranks (repeatable)")
    parser.add_argument("--force", action="store_true", help="run N > 8 x cores too")
    parser.add_argument("--json", help="write the full record here")
    parser.add_argument("--log-dir", help="rank logs (default: a temporary directory)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    sizes = args.ranks or [n for n in DEFAULT_RANKS if n <= 8 * cores]
    if any(mib <= 0 for mib in args.busbw_sizes_mib):
        parser.error("--busbw-sizes-mib: sizes must be > 0")
    busbw = [(op, int(round(mib * (1 << 20)))) for op in args.busbw_ops for mib in args.busbw_sizes_mib]
    notes = []
    runnable = []
    for n in sizes:
        if n < 2 or n % 2:
            parser.error(f"--ranks {n}: must be even and >= 2")
        if n > 8 * cores and not args.force:
            notes.append(f"note: N={n} > 8 x {cores} cores: skipped (--force runs it anyway)")
        else:
            if n > 8 * cores:
                notes.append(f"note: N={n} > 8 x {cores} cores: numbers are limited by the machine")
            runnable.append(n)
    for note in notes:
        print(note, file=sys.stderr)
    extra = dict(kv.split("=", 1) for kv in args.env)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="reccl-scale-")
    os.makedirs(log_dir, exist_ok=True)
    machine = machine_info()
    progress = None if args.quiet else (lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr,
                                                        flush=True))
    runs = []
    ceilings = {}
    record = {"machine": machine, "args": vars(args), "notes": notes, "runs": runs, "ring_ceilings": ceilings}
    for n in runnable:
        if args.ceiling_s > 0 and busbw:
            if progress:
                progress(f"loopback ring ceiling, N={n}")
            ceilings[n] = ring_ceiling(n, seconds=args.ceiling_s, timeout=args.phase_timeout)
        for backend in args.backends:
            run = run_job(backend, n, idle_s=args.idle_s, settle_s=args.settle_s,
                          phase_timeout=args.phase_timeout, op_timeout=args.op_timeout, warmup=args.warmup,
                          small_iters=args.small_iters, busbw_iters=args.busbw_iters, busbw=busbw,
                          env=rank_env(backend, extra), log_dir=log_dir,
                          start_method=args.start, progress=progress)
            runs.append(run)
            if progress:
                progress(f"{backend} N={n}: {run['status']}" + (f": {run['detail'][:300]}" if run.get("detail")
                                                                  else ""))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=1)
    print(format_table(runs, machine, args.idle_s))
    if ceilings:
        print()
        print(format_ceilings(runs, ceilings))
    for note in notes:
        print(f"\n{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

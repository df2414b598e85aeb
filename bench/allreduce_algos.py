"""Large all_reduce, reduce_scatter and all_gather by each reccl algorithm
against Gloo, in one invocation.

For each N in --ranks, runs the same ``reccl bench`` ranks (torch_reccl/bench/rank.py:
N processes on this machine over loopback NICs 127.0.0.1..127.0.0.K, every
output checked element by element after timing) three times: reccl with
RECCL_ALGO=ring, reccl with RECCL_ALGO=halving (recursive halving and/or
doubling, csrc/engine/halving_doubling.h), and Gloo, over the collectives of
--ops (default all_reduce). RECCL_SMALL_BYTES is left as it is, so sizes above
it take the forced algorithm; a size is the all_reduce's tensor, the
reduce_scatter's input and the all_gather's output. busbw as nccl-tests:
algbw x 2(N-1)/N (all_reduce) or x (N-1)/N from the slowest rank's mean time.
Prints one table per N with halving/ring and each algorithm's ratio to Gloo in
the same run. With --repeat R the three take turns R times and each cell is
the median run. With --shm, a library-free shared-memory all_reduce
(bench/shared_allreduce.py) takes its turn too, as a reference for what
this machine gives an all_reduce with no library around it.

    python bench/allreduce_algos.py --ranks 8 16 --sizes-mib 4 16 64 --repeat 3 --json algos.json
    python bench/allreduce_algos.py --ops all_reduce reduce_scatter all_gather --ranks 4 8
    python bench/allreduce_algos.py --ranks 16 32 --sizes-mib 16 64 --repeat 3 --shm
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_reccl.bench.cli import Variant, build_rows, run_variant  # noqa: E402
from torch_reccl.bench.rank import OPS  # noqa: E402
from torch_reccl.cli.launch import LaunchError, LoopbackPlacement  # noqa: E402

import shared_allreduce  # noqa: E402  (beside this file)

VARIANTS = (("ring", "reccl", {"RECCL_ALGO": "ring"}),
            ("halving", "reccl", {"RECCL_ALGO": "halving"}),
            ("gloo", "gloo", {}))


def medians(results: List[dict]) -> List[dict]:
    """Per op and size, the run with the median busbw (the lower middle one of
    an even count), its wrong elements replaced by those of every run."""
    by_size: Dict[tuple, List[dict]] = {}
    for r in results:
        if r["kind"] == "result":
            by_size.setdefault((r["op"], r["bytes"]), []).append(r)
    out = []
    for same in by_size.values():
        ordered = sorted(same, key=lambda r: r["busbw"])
        out.append({**ordered[(len(ordered) - 1) // 2], "wrong": sum(r["wrong"] for r in same),
                    "runs": len(same)})
    return out


def measure(ranks: int, args) -> Dict[str, object]:
    sizes = [int(mib * (1 << 20)) for mib in args.sizes_mib]
    bench_args = argparse.Namespace(device="cpu", ops=args.ops, dtype="float32",
                                    warmup=args.warmup, iters=args.iters, timeout=args.timeout)
    runs: Dict[str, List[dict]] = {}
    errors = {}
    for _ in range(args.repeat):  # the variants take turns, so a load change hits all alike
        for label, backend, env in VARIANTS:
            try:
                runs.setdefault(label, []).extend(
                    run_variant(Variant(label, backend, env), LoopbackPlacement(ranks, args.rails),
                                bench_args, sizes, None))
            except LaunchError as error:
                errors[label] = str(error)
                print(f"allreduce_algos: N={ranks} {label} failed: {error}", file=sys.stderr)
        if args.shm:
            try:
                runs.setdefault("shm", []).extend(
                    shared_allreduce.measure(ranks, size, args.shm_piece_mib << 20, args.warmup, args.iters)
                    for size in sizes)
            except RuntimeError as error:
                errors["shm"] = str(error)
                print(f"allreduce_algos: N={ranks} shm failed: {error}", file=sys.stderr)
    labels = [v[0] for v in VARIANTS] + (["shm"] if args.shm else [])
    rows = build_rows(labels, {label: medians(rs) for label, rs in runs.items()}, "gloo")
    for row in rows:
        busbw = {label: m["busbw"] for label, m in row["variants"].items()}
        row["ratios"] = {
            "halving/ring": busbw["halving"] / busbw["ring"] if busbw.get("ring") and "halving" in busbw else None,
            "ring/gloo": busbw["ring"] / busbw["gloo"] if busbw.get("gloo") and "ring" in busbw else None,
            "halving/gloo": busbw["halving"] / busbw["gloo"] if busbw.get("gloo") and "halving" in busbw else None,
            "shm/gloo": busbw["shm"] / busbw["gloo"] if busbw.get("gloo") and "shm" in busbw else None,
            "best reccl/shm": (max(busbw.get("ring", 0), busbw.get("halving", 0)) / busbw["shm"]
                               if busbw.get("shm") and ("ring" in busbw or "halving" in busbw) else None),
        }
    return {"ranks": ranks, "rows": rows, "errors": errors}


def table(record: Dict[str, object]) -> str:
    lines = [f"## N = {record['ranks']}",
             "| op | size | ring busbw GB/s | halving busbw GB/s | gloo busbw GB/s | shm busbw GB/s | halving/ring | "
             "ring/gloo | halving/gloo | shm/gloo | best reccl/shm | wrong |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        v = row["variants"]

        def bw(label):
            return f"{v[label]['busbw']:.3f}" if label in v else "-"

        def ratio(key):
            r = row["ratios"][key]
            return f"{r:.2f}" if r is not None else "-"

        wrong = sum(m["wrong"] for m in v.values())
        lines.append(f"| {row['op']} | {row['bytes'] / (1 << 20):g} MiB | {bw('ring')} | {bw('halving')} | "
                     f"{bw('gloo')} | {bw('shm')} | {ratio('halving/ring')} | {ratio('ring/gloo')} | "
                     f"{ratio('halving/gloo')} | {ratio('shm/gloo')} | {ratio('best reccl/shm')} | {wrong} |")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[16.0])
    p.add_argument("--ops", nargs="+", choices=OPS, default=["all_reduce"],
                   help="collectives to measure (default all_reduce)")
    p.add_argument("--rails", type=int, default=2, help="loopback NICs per rank (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each variant, taking turns; the median busbw is shown (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without a result before a run fails")
    p.add_argument("--shm", action="store_true",
                   help="all_reduce only: also run a library-free shared-memory all_reduce "
                        "(bench/shared_allreduce.py) as a reference")
    p.add_argument("--shm-piece-mib", type=int, default=16,
                   help="--shm: MiB per rank through the shared mapping at a time (default 16)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.shm and args.ops != ["all_reduce"]:
        p.error(f"--shm measures all_reduce only; got --ops {' '.join(args.ops)}")
    if args.shm_piece_mib < 1:
        p.error(f"--shm-piece-mib must be 1 or more, got {args.shm_piece_mib}")
    if any(not 2 <= n <= 64 for n in args.ranks):
        p.error(f"--ranks must be 2..64; got {args.ranks}")
    if any(s <= 0 for s in args.sizes_mib) or args.iters < 1 or args.warmup < 0 or args.repeat < 1:
        p.error("--sizes-mib must be > 0, --iters and --repeat >= 1 and --warmup >= 0")
    records = []
    for n in args.ranks:
        records.append(measure(n, args))
        print(table(records[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "runs": records}, f, indent=1)
    wrong = sum(m["wrong"] for r in records for row in r["rows"] for m in row["variants"].values())
    return 1 if wrong or any(r["errors"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``reccl bench``: collective bandwidth, as a table like nccl-tests'.

    reccl bench [--ranks N] [--ops all_reduce,all_gather,reduce_scatter]
                [--min-bytes 1M] [--max-bytes 256M] [--factor 2] [--dtype float32]
                [--warmup 2] [--iters 5] [--device cpu|cuda]
                [--backend reccl] [--compare gloo|nccl] [--nic-down]
                [--fault TARGET:ACTION[,...]]... [--fabric HOSTSxRAILS [--rate-mbit M]
                [--tcp-congestion NAME]]
                [--json [PATH]]

Spawns N ranks (one process each) and times every op at every size from
--min-bytes to --max-bytes (x --factor), for the backend and, with --compare,
for a baseline backend in the same invocation (a separate set of ranks each).

Columns: size is the largest buffer in bytes (the input of all_reduce and
reduce_scatter, the output of all_gather), count its elements, time the slowest
rank's mean time per op, algbw = size / time, busbw = algbw x 2(n-1)/n for
all_reduce and x (n-1)/n for all_gather and reduce_scatter (nccl-tests'
convention), #wrong the output elements that differ from the expected result in
a checked run after timing, ratio = busbw / the baseline's busbw.

Where the ranks run: on this machine over loopback "NICs" 127.0.0.1..127.0.0.K
(--rails K), or, with --fabric HxK (root), one rank per host of an emulated
rail-optimized fabric (docs/fabric.md) with the store on the management network.
The baselines (gloo, NCCL's socket transport) use one NIC: 127.0.0.1 or eth0.
--nic-down adds a run of the backend with rank 0's first NIC down (a real veth
down in the fabric; torch_reccl.inject_fault on loopback). --fault adds a run
with the faults given, in the drill's target syntax without a time (they are made
once every rank has started, before the first measured op): e.g. --fault
h0nic0:down,h0nic1:down (two NICs of host 0) or --fault h0nic1:slow=10% (a NIC
at 10% of the fabric rate); actions down, blackhole, slow=P%, lossy=P% (slow and
lossy only in the fabric). --fault may repeat: one run per value.

--device cuda runs one rank per GPU with backend "nccl" through torch_reccl's
NCCL net plugin (NCCL_NET=ReCCL); the baseline "nccl" is NCCL's own socket
transport. NCCL's peer-to-peer and shared-memory transports are turned off and
every rank gets its own NCCL_HOSTID, so all traffic crosses the network layer.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Dict, List, Optional

from torch_reccl.bench.rank import DTYPES, OPS
from torch_reccl.cli.launch import (
    FabricPlacement,
    Job,
    LaunchError,
    LoopbackPlacement,
    cuda_net_env,
    cuda_problem,
    cuda_rank_env,
    terminated_by_signal,
    unique_fabric_name,
)
from torch_reccl.cli.progress import ProgressBar
from torch_reccl.drill.faults import FabricFaults, InjectedFaults
from torch_reccl.drill.schedule import Fault, ScheduleError, check_topology, parse_schedule
from torch_reccl.fabric.fabric import DEFAULT_TCP_CONGESTION, tcp_congestion_arg

BACKENDS = {"cpu": ("reccl", "gloo"), "cuda": ("reccl", "nccl")}
SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*$")
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MAX_BYTES = 16 << 30
DEFAULT_TIMEOUT_S = 300.0
# nccl-tests-style data columns of one variant
VARIANT_COLUMNS = ("time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong")


# faults a measured run can hold for its whole length (no time, no undoing)
BENCH_FAULT_ACTIONS = ("down", "blackhole", "slow", "lossy")


class Variant:
    """One set of ranks to measure: a backend, its environment, maybe faults made
    once every rank has started."""

    def __init__(self, label: str, backend: str, env: Dict[str, str], faults: Optional[List[Fault]] = None):
        self.label, self.backend, self.env, self.faults = label, backend, env, faults or []


def parse_bench_faults(text: str) -> List[Fault]:
    """``--fault``'s value: the drill's TARGET:ACTION items, comma-separated, no time."""
    items = [item.strip() for item in text.split(",")]
    if any("@" in item for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: a bench fault has no time (it holds for the whole "
                                         f"run); write e.g. h0nic0:down,h0nic1:slow=10%")
    try:
        faults = parse_schedule(",".join(f"{item}@0s" for item in items))
    except ScheduleError as error:
        raise argparse.ArgumentTypeError(str(error).replace("@0s", ""))
    for fault in faults:
        if fault.action not in BENCH_FAULT_ACTIONS:
            valid = ", ".join(a + "=P%" if a in ("slow", "lossy") else a for a in BENCH_FAULT_ACTIONS)
            raise argparse.ArgumentTypeError(f"{fault.target}:{fault.action}: a bench run holds a fault "
                                             f"for its whole length; valid actions: {valid}")
    return faults


def fault_label(faults: List[Fault]) -> str:
    return "+".join(f.text.rsplit("@", 1)[0] for f in faults)


# ---------------------------------------------------------------- arguments


def parse_size(text: str) -> int:
    """Bytes from '1048576', '1M', '64K', '1G' or '1MiB' (powers of 1024)."""
    match = SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, optionally with a K, M or G suffix "
            f"(powers of 1024), e.g. 1M or 262144")
    value = int(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
    if not 1 <= value <= MAX_BYTES:
        raise argparse.ArgumentTypeError(f"size {text!r} must be between 1 byte and 16G")
    return value


def parse_ops(text: str) -> List[str]:
    """'all_reduce,allgather' -> ['all_reduce', 'all_gather'] (underscores optional)."""
    by_key = {op.replace("_", ""): op for op in OPS}
    ops = []
    for item in str(text).split(","):
        key = item.strip().lower().replace("_", "").replace("-", "")
        if key not in by_key:
            raise argparse.ArgumentTypeError(
                f"unknown op {item.strip()!r}; valid ops: {', '.join(OPS)}")
        if by_key[key] not in ops:
            ops.append(by_key[key])
    return ops


def parse_fabric(text: str):
    match = re.match(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$", str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"--fabric {text!r} is not HOSTSxRAILS, e.g. 2x2 (2 hosts with 2 NICs each)")
    hosts, rails = int(match.group(1)), int(match.group(2))
    if hosts < 2 or rails < 1:
        raise argparse.ArgumentTypeError(
            f"--fabric {text!r}: needs at least 2 hosts and 1 rail")
    return hosts, rails


def sizes_between(low: int, high: int, factor: int) -> List[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def check_args(args) -> None:
    """Cross-argument checks; ValueError says what was wrong and what is valid."""
    if args.min_bytes > args.max_bytes:
        raise ValueError(f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})")
    if args.factor < 2:
        raise ValueError(f"--factor must be an integer >= 2; got {args.factor}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds; got {args.timeout}")
    if args.warmup < 0 or args.iters < 1:
        raise ValueError(f"--warmup must be >= 0 and --iters >= 1; got {args.warmup} and {args.iters}")
    if args.fabric is not None:
        hosts, rails = args.fabric
        if args.ranks is not None and args.ranks != hosts:
            raise ValueError(f"--ranks {args.ranks} disagrees with --fabric {hosts}x{rails} "
                             f"(one rank per host); leave --ranks out")
        if args.rails is not None and args.rails != rails:
            raise ValueError(f"--rails {args.rails} disagrees with --fabric {hosts}x{rails}")
        tcp_congestion_arg(args.tcp_congestion or DEFAULT_TCP_CONGESTION)
    elif args.rate_mbit is not None:
        raise ValueError("--rate-mbit needs --fabric HOSTSxRAILS (loopback NICs have no rate cap)")
    elif args.tcp_congestion is not None:
        raise ValueError("--tcp-congestion needs --fabric HOSTSxRAILS (loopback NICs use this "
                         "machine's TCP settings)")
    ranks = args.fabric[0] if args.fabric else (args.ranks or 2)
    if not 2 <= ranks <= 64:
        raise ValueError(f"--ranks must be 2..64 (busbw needs at least 2 ranks); got {ranks}")
    valid = BACKENDS[args.device]
    if args.backend not in valid:
        raise ValueError(f"--backend {args.backend!r} is not valid with --device {args.device}; "
                         f"valid: {', '.join(valid)}")
    if args.compare is not None and args.compare not in valid:
        raise ValueError(f"--compare {args.compare!r} is not valid with --device {args.device}; "
                         f"valid baselines: {', '.join(v for v in valid if v != args.backend)}")
    if args.compare == args.backend:
        raise ValueError(f"--compare {args.compare} is the backend itself; pick another baseline")
    if (args.nic_down or args.fault) and args.backend != "reccl":
        raise ValueError("--nic-down and --fault measure failover, which only the reccl backend has")
    for faults in args.fault or []:
        fabric_only = [f for f in faults if f.action in InjectedFaults.FABRIC_ONLY]
        if fabric_only and args.fabric is None:
            raise ValueError(f"--fault {fault_label(fabric_only).replace('+', ', ')}: a slow or lossy NIC is a "
                             f"kernel fault (tbf, nftables) and needs --fabric HOSTSxRAILS (root)")
        try:
            check_topology(faults, ranks, args.fabric[1] if args.fabric else (args.rails or 2))
        except ScheduleError as error:
            raise ValueError(f"--fault: {str(error).replace('@0s', '')}")


def variants(args) -> List[Variant]:
    if args.device == "cuda":
        env = cuda_net_env
    else:
        def env(_backend):
            return {}
    out = [Variant(args.backend, args.backend, env(args.backend))]
    if args.compare:
        out.append(Variant(args.compare, args.compare, env(args.compare)))
    if args.nic_down:
        out.append(Variant(f"{args.backend},NIC0-down", args.backend, env(args.backend),
                           parse_bench_faults("h0nic0:down")))
    for faults in args.fault or []:
        out.append(Variant(f"{args.backend},{fault_label(faults)}", args.backend, env(args.backend), faults))
    return out


# ---------------------------------------------------------------- running


def run_variant(variant: Variant, placement, args, sizes, bar, fabric=None) -> List[dict]:
    """Runs one set of ranks; the results rank 0 reported, in order (and, for
    reccl, a last entry {"kind": "failovers", "count": N} from rank 0's stats)."""
    argv = [sys.executable, "-m", "torch_reccl.bench.rank", "--backend", variant.backend,
            "--device", args.device, "--ops", *args.ops, "--sizes", *map(str, sizes),
            "--dtype", args.dtype, "--warmup", str(args.warmup), "--iters", str(args.iters),
            "--timeout", str(args.timeout)]
    if variant.faults:
        argv.append("--pause-before")

    def per_rank_env(rank: int) -> Dict[str, str]:
        return cuda_rank_env(rank, "reccl-bench") if args.device == "cuda" else {}

    results: List[dict] = []
    paused = set()
    with Job(placement, argv, env=variant.env, per_rank_env=per_rank_env,
             commands=bool(variant.faults)) as job:
        deadline = time.monotonic() + args.timeout
        while True:
            got = job.next_message(0.2)
            if got is not None:
                rank, message = got
                if message["kind"] == "failovers":
                    results.append(message)
                elif message["kind"] == "result":
                    results.append(message)
                    if bar is not None:
                        bar.advance(f"{variant.label} {message['op']} {_human(message['bytes'])}")
                    deadline = time.monotonic() + args.timeout
                elif message["kind"] == "paused":
                    paused.add(rank)
                    if len(paused) == job.ranks:
                        _make_faults(job, placement, fabric, variant.faults)
                continue
            failed = job.failed_ranks()
            if failed:
                raise LaunchError(f"{variant.label}: rank(s) {failed} failed\n{job.logs(failed)}")
            if job.all_exited():
                job.wait(5.0)
                while (got := job.next_message(0)) is not None:
                    if got[1]["kind"] in ("result", "failovers"):
                        results.append(got[1])
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"{variant.label}: no result for {args.timeout:.0f} s "
                                  f"(--timeout); the ranks' output:\n{job.logs()}")
    return results


def _make_faults(job: Job, placement, fabric, faults: List[Fault]) -> None:
    """The variant's faults, made while every rank waits; then every rank goes on.
    In the fabric they are real (the drill's FabricFaults); on loopback each rank
    of the target host injects them (torch_reccl.inject_fault) as it goes on."""
    inject: Dict[int, List[List[str]]] = {rank: [] for rank in range(job.ranks)}
    fabric_faults = FabricFaults(fabric, flap_period_s=1.0, flap_count=1) if fabric is not None else None
    for fault in faults:
        if fabric_faults is not None:
            fabric_faults.apply(fault)
        else:
            for rank in fault.hosts(job.ranks):
                inject[rank].append([placement.nic_names(rank)[fault.rail], InjectedFaults.KIND[fault.action]])
    for rank in range(job.ranks):
        job.send(rank, {"cmd": "go", "inject": inject[rank]})


def _human(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# ---------------------------------------------------------------- output


def build_rows(labels: List[str], results: Dict[str, List[dict]], baseline: Optional[str]) -> List[dict]:
    """One row per (op, size): the measurements of every variant, and busbw ratio
    of the first variant to the baseline."""
    rows: Dict[tuple, dict] = {}
    for label in labels:
        for r in results.get(label, []):
            if r["kind"] != "result":
                continue
            key = (r["op"], r["bytes"])
            row = rows.setdefault(key, {"op": r["op"], "bytes": r["bytes"], "count": r["count"],
                                        "dtype": r["dtype"], "variants": {}})
            row["variants"][label] = {k: r[k] for k in ("time_us", "algbw", "busbw", "wrong")}
    for row in rows.values():
        main = row["variants"].get(labels[0])
        base = row["variants"].get(baseline) if baseline else None
        row["ratio"] = (main["busbw"] / base["busbw"]) if main and base and base["busbw"] > 0 else None
    order = {op: i for i, op in enumerate(OPS)}
    return sorted(rows.values(), key=lambda r: (order[r["op"]], r["bytes"]))


def format_table(rows: List[dict], labels: List[str], baseline: Optional[str], header: List[str]) -> str:
    lead = ("op", "size(B)", "count", "type")
    widths = [14, 12, 11, 9]
    col_w = 12
    lines = [f"# {line}" for line in header]
    lines.append("#")
    group = " " * (sum(widths) + len(widths))
    for label in labels:
        group += label.center(col_w * len(VARIANT_COLUMNS) + len(VARIANT_COLUMNS))
    lines.append("#" + group[1:].rstrip())
    cols = "".join(name.rjust(w) + " " for name, w in zip(lead, widths))
    for _ in labels:
        cols += "".join(name.rjust(col_w) + " " for name in VARIANT_COLUMNS)
    if baseline:
        cols += "ratio".rjust(8)
    lines.append("#" + cols[1:].rstrip())
    for row in rows:
        line = "".join(str(v).rjust(w) + " " for v, w in
                       zip((row["op"], row["bytes"], row["count"], row["dtype"]), widths))
        for label in labels:
            m = row["variants"].get(label)
            if m is None:
                line += "".join("-".rjust(col_w) + " " for _ in VARIANT_COLUMNS)
            else:
                line += (f"{m['time_us']:{col_w}.1f} {m['algbw']:{col_w}.3f} "
                         f"{m['busbw']:{col_w}.3f} {m['wrong']:{col_w}d} ")
        if baseline:
            line += (f"{row['ratio']:8.2f}" if row["ratio"] is not None else "-".rjust(8))
        lines.append(line.rstrip())
    return "\n".join(lines)


def failover_counts(results: Dict[str, List[dict]]) -> Dict[str, int]:
    """Failovers rank 0 counted in each reccl run."""
    return {label: r["count"] for label, rs in results.items() for r in rs if r["kind"] == "failovers"}


def summary_lines(rows: List[dict], labels: List[str], failovers: Dict[str, int]) -> List[str]:
    out = []
    for label in labels:
        values = [r["variants"][label]["busbw"] for r in rows if label in r["variants"]]
        wrong = sum(r["variants"][label]["wrong"] for r in rows if label in r["variants"])
        if values:
            seen = f", failovers on rank 0: {failovers[label]}" if label in failovers else ""
            out.append(f"# {label}: avg busbw {sum(values) / len(values):.3f} GB/s over "
                       f"{len(values)} measurements, wrong elements: {wrong}{seen}")
    return out


# ---------------------------------------------------------------- command


def run(args) -> int:
    try:
        check_args(args)
    except ValueError as error:
        print(f"reccl bench: error: {error}", file=sys.stderr)
        return 2
    ranks = args.fabric[0] if args.fabric else (args.ranks or 2)
    rails = args.fabric[1] if args.fabric else (args.rails or 2)
    if args.device == "cuda":
        problem = cuda_problem(ranks)
        if problem:
            print(f"reccl bench: skipped: {problem}", file=sys.stderr)
            return 2
    sizes = sizes_between(args.min_bytes, args.max_bytes, args.factor)
    todo = variants(args)
    baseline = args.compare
    show_bar = (args.progress or sys.stderr.isatty()) and not args.no_progress
    bar = ProgressBar(len(todo) * len(args.ops) * len(sizes)) if show_bar else None
    results: Dict[str, List[dict]] = {}
    errors: Dict[str, str] = {}
    fabric = None
    with terminated_by_signal():
        try:
            if args.fabric:
                from torch_reccl.fabric import Fabric, FabricError
                from torch_reccl.fabric.fabric import is_root

                if not is_root():
                    print("reccl bench: error: --fabric needs root (network namespaces); "
                          "leave it out to use loopback NICs", file=sys.stderr)
                    return 2
                fabric = Fabric(hosts=ranks, rails=rails, rate_mbit=args.rate_mbit,
                                name=unique_fabric_name("b"),
                                tcp_congestion=tcp_congestion_arg(args.tcp_congestion or DEFAULT_TCP_CONGESTION))
                try:
                    fabric.up()
                except FabricError as error:
                    print(f"reccl bench: error: {error}", file=sys.stderr)
                    return 1
                placement = FabricPlacement(fabric)
            else:
                placement = None
            for variant in todo:
                if fabric is None:
                    placement = LoopbackPlacement(ranks, rails)
                try:
                    results[variant.label] = run_variant(variant, placement, args, sizes, bar, fabric)
                except LaunchError as error:
                    errors[variant.label] = str(error)
                    if bar is not None:
                        bar.close()
                    print(f"reccl bench: {variant.label} failed: {error}", file=sys.stderr)
                finally:
                    if fabric is not None:
                        fabric.heal()
        except KeyboardInterrupt:
            print("\nreccl bench: interrupted", file=sys.stderr)
            return 130
        finally:
            if bar is not None:
                bar.close()
            if fabric is not None:
                fabric.down()
        where = placement.describe()
    labels = [v.label for v in todo]
    rows = build_rows(labels, results, baseline)
    header = [f"reccl bench: {', '.join(args.ops)}; {where}",
              f"device {args.device}, {args.dtype}, warmup {args.warmup}, iters {args.iters}; "
              f"time = slowest rank's mean; busbw = algbw x 2(n-1)/n (all_reduce), "
              f"x (n-1)/n (all_gather, reduce_scatter)"]
    if baseline:
        header.append(f"ratio = {labels[0]} busbw / {baseline} busbw")
    record = {"ranks": ranks, "rails": rails, "device": args.device, "dtype": args.dtype,
              "where": where, "warmup": args.warmup, "iters": args.iters, "variants": labels,
              "baseline": baseline, "rows": rows, "errors": errors,
              "failovers": failover_counts(results)}
    if args.json == "-":
        print(json.dumps(record, indent=1))
    else:
        print(format_table(rows, labels, baseline, header))
        print("\n".join(summary_lines(rows, labels, failover_counts(results))))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    wrong = sum(m["wrong"] for r in rows for m in r["variants"].values())
    if wrong:
        print(f"reccl bench: {wrong} output elements were wrong", file=sys.stderr)
    return 1 if errors or wrong or not rows else 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="collective bandwidth table (busbw, like nccl-tests), reccl vs a baseline",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None, help="ranks (processes); default 2")
    parser.add_argument("--ops", type=parse_ops, default=list(OPS),
                        help=f"comma list of {', '.join(OPS)} (default: all)")
    parser.add_argument("--min-bytes", "-b", type=parse_size, default=1 << 20,
                        help="smallest size (default 1M)")
    parser.add_argument("--max-bytes", "-e", type=parse_size, default=256 << 20,
                        help="largest size (default 256M)")
    parser.add_argument("--factor", "-f", type=int, default=2, help="size multiplier (default 2)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="default float32")
    parser.add_argument("--warmup", "-w", type=int, default=2, help="untimed ops per size (default 2)")
    parser.add_argument("--iters", "-n", type=int, default=5, help="timed ops per size (default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default) or cuda (one GPU per rank, through NCCL)")
    parser.add_argument("--backend", default="reccl",
                        help="backend to measure: reccl (default), or the baseline alone")
    parser.add_argument("--compare", default=None, metavar="BASELINE",
                        help="also measure a baseline: gloo (cpu) or nccl (cuda)")
    parser.add_argument("--nic-down", action="store_true",
                        help="also measure the backend with rank 0's first NIC down (failover)")
    parser.add_argument("--fault", type=parse_bench_faults, action="append", default=None,
                        metavar="TARGET:ACTION[,...]",
                        help="also measure the backend with these faults, made before the first "
                             "measured op (the drill's targets: hHnicR, nicR, railR; actions down, "
                             "blackhole, slow=P%%, lossy=P%%), e.g. h0nic0:down,h0nic1:down; may repeat")
    parser.add_argument("--rails", type=int, default=None,
                        help="NICs per rank on loopback (127.0.0.1..); default 2")
    parser.add_argument("--fabric", type=parse_fabric, default=None, metavar="HOSTSxRAILS",
                        help="run one rank per host of an emulated fabric (root), e.g. 2x2")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="with --fabric: cap every NIC at this rate")
    parser.add_argument("--tcp-congestion", default=None,
                        metavar="NAME", help="with --fabric: the hosts' TCP congestion control (default "
                        "cubic, whatever this machine uses; 'inherit' keeps its default)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="give up when no result arrives for this many seconds (default 300)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="--json: print JSON instead of the table; --json PATH: also write it")
    parser.add_argument("--progress", action="store_true",
                        help="progress bar on stderr even when it is not a terminal")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
    return parser

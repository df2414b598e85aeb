"""``reccl soak``: hours of random, combined network faults under a checked job.

    reccl soak [--hosts 4] [--rails 2] [--rate-mbit 2000] [--duration 2h] [--seed S]
               [--mix KIND=W,...] [--gap 0.5:3] [--max-outage 60] [--max-bytes 64M]
               [--no-plugin] [--json FILE] [--plot FILE]

As root, builds an emulated rail-optimized fabric (docs/fabric.md) and runs one
rank per host: a training job interleaved with every collective and point-to-
point op of the "reccl" backend (world and subgroups, 0 bytes to --max-bytes,
every dtype), each result checked against values computed without the library.
Meanwhile a seeded random schedule (torch_reccl/soak/schedule.py) takes NICs,
rails and hosts down, flaps and blackholes NICs, slows them and makes them
lossy, one after another and overlapping, from the end of the warm-up until
--settle before the end. Beside the ranks, from the job's start, the plugin
stream (torch_reccl/soak/plugin_stream.py) carries checked messages from host 0
to host 1 through the NCCL net plugin library alone, driven as NCCL's proxy
drives it, through the same faults (--no-plugin leaves it out). Every 10 s it
samples every process's RSS, fds, threads and sockets. At the end the
training's parameters are compared bit for bit with a fault-free replay of the
same steps.

Exits 0 only with no wrong value or message, no error of the plugin stream, no
stall of the ranks or of the stream past the bound (--stall plus the time the
schedule left some pair of hosts without a path), no crash, the replay
bit-identical, RSS within --rss-growth of its warm-up level, and fds, threads and
sockets back to their warm-up counts once the faults healed (beyond the
engine's worker pool and the fault board's store connection: docs/soak.md). The same seed and
arguments replay the same schedule (--dry-run prints it). The fabric records what
it changes; `reccl fabric down NAME` removes it after a crash.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from torch_reccl.bench.cli import parse_size
from torch_reccl.drill.cli import fabric_problem, parse_duration
from torch_reccl.soak.schedule import DEFAULT_MIX, SoakScheduleError, make_schedule, outages, parse_mix

DEFAULT_PLOT = "reccl-soak.png"
MAX_MESSAGE_BYTES = 256 << 20


def mix_argument(text: str):
    try:
        return parse_mix(text)
    except SoakScheduleError as error:
        raise argparse.ArgumentTypeError(str(error))


def parse_gap(text: str):
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gap {text!r}: give MIN:MAX seconds, e.g. 0.5:3")
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"--gap {text!r}: need 0 < MIN <= MAX")
    return lo, hi


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "soak", help="hours of random combined faults under a checked job (emulated fabric, root)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4, help="hosts = ranks, 2..8 (default 4)")
    parser.add_argument("--rails", type=int, default=2, help="NICs per host (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=2000.0,
                        help="cap every NIC at this rate (default 2000; 0: no cap, no slow faults)")
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("3m"),
                        help="how long the job runs, e.g. 3m, 2h (default 3m)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule and the job")
    parser.add_argument("--mix", type=mix_argument, default=dict(DEFAULT_MIX),
                        help="fault kinds and weights, e.g. nic_down=3,flap=1 (default: "
                             + ",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()) + ")")
    parser.add_argument("--gap", type=parse_gap, default=(0.5, 3.0),
                        help="seconds between fault starts, MIN:MAX (default 0.5:3)")
    parser.add_argument("--max-outage", type=parse_duration, default=60.0,
                        help="longest host outage (default 60s)")
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20,
                        help="largest checked message per rank (default 64M)")
    parser.add_argument("--stall", type=parse_duration, default=30.0,
                        help="longest time without progress outside outages (default 30s)")
    parser.add_argument("--warmup", type=parse_duration, default=30.0,
                        help="fault-free start; resources are measured against its end (default 30s)")
    parser.add_argument("--settle", type=parse_duration, default=20.0,
                        help="fault-free end, for resources to return (default 20s)")
    parser.add_argument("--rss-growth", type=float, default=0.05,
                        help="largest RSS growth over the warm-up level (default 0.05)")
    parser.add_argument("--no-plugin", action="store_true",
                        help="leave out the plugin stream (the ranks alone)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep every process's whole output here (rank<R>.log, plugin-<role>.log)")
    parser.add_argument("--name", default=None, help="fabric name (default: a fresh one)")
    parser.add_argument("--json", metavar="PATH", help="write the whole run as JSON")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"PNG of throughput, faults and resources (default {DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the fault schedule and exit (no root needed)")
    parser.set_defaults(func=run)
    return parser


def plugin_problem() -> Optional[str]:
    """Why the plugin stream cannot run here (its library is not built), or None."""
    from torch_reccl._native import plugin_path

    try:
        plugin_path()
    except ImportError as error:
        return str(error)
    return None


def settings_of(args):
    from torch_reccl.soak.runner import SoakSettings

    return SoakSettings(duration_s=args.duration, seed=args.seed, max_bytes=args.max_bytes,
                        stall_s=args.stall, warmup_s=args.warmup, settle_s=args.settle,
                        rss_growth=args.rss_growth, log_dir=args.log_dir, plugin=not args.no_plugin)


def stream_line(summary: Optional[dict]) -> str:
    """The plugin stream's line of the report."""
    if summary is None:
        return "plugin stream: not run (--no-plugin)"
    gap = summary["longest_gap_s"]
    at = summary.get("longest_gap_end_s")
    return (f"plugin stream (host 0 -> host 1): {summary['messages']} messages, "
            f"{summary['bytes'] / (1 << 20):.0f} MiB, wrong {summary['wrong']}, errors "
            f"{summary['errors']}, longest gap "
            + (f"{gap:.2f} s" + (f" (ended at {at:.1f} s)" if at is not None else "")
               if gap is not None else "none reported"))


def run(args) -> int:
    settings = settings_of(args)
    try:
        if not 2 <= args.hosts <= 8:
            raise SoakScheduleError(f"--hosts must be in 2..8; got {args.hosts}")
        if not 1 <= args.rails <= 8:
            raise SoakScheduleError(f"--rails must be in 1..8; got {args.rails}")
        if args.max_bytes > MAX_MESSAGE_BYTES:
            raise SoakScheduleError(f"--max-bytes must be at most {MAX_MESSAGE_BYTES >> 20}M (every "
                                    f"rank holds a pool of that many random bytes); got "
                                    f"{args.max_bytes}")
        if args.rate_mbit < 0:
            raise SoakScheduleError(f"--rate-mbit must be >= 0; got {args.rate_mbit:g}")
        faults_end = args.duration - args.settle
        if faults_end <= args.warmup:
            raise SoakScheduleError(f"--duration {args.duration:g}s leaves no time for faults "
                                    f"after --warmup {args.warmup:g}s and before --settle "
                                    f"{args.settle:g}s")
        faults = make_schedule(args.seed, args.hosts, args.rails, args.warmup, faults_end, args.mix,
                               gap_s=args.gap, max_outage_s=args.max_outage,
                               rate_capped=args.rate_mbit > 0)
    except SoakScheduleError as error:
        print(f"reccl soak: error: {error}", file=sys.stderr)
        return 2
    spans = outages(faults, args.hosts, args.rails)
    print(f"reccl soak: {len(faults)} faults over {faults_end - args.warmup:.0f} s (seed "
          f"{args.seed}); some pair of hosts without a path for {sum(b - a for a, b in spans):.0f} s "
          f"in {len(spans)} outages", file=sys.stderr)
    if args.dry_run:
        for fault in faults:
            print(fault.describe())
        return 0
    if settings.plugin and (problem := plugin_problem()):
        print(f"reccl soak: error: the plugin stream needs the NCCL net plugin library: {problem}; "
              f"--no-plugin runs the soak without it", file=sys.stderr)
        return 2
    problem = fabric_problem()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    if problem:
        print(f"reccl soak: error: the soak needs the emulated fabric: {problem}", file=sys.stderr)
        return 2

    from torch_reccl.cli.launch import terminated_by_signal, unique_fabric_name
    from torch_reccl.fabric import Fabric, FabricError
    from torch_reccl.soak.probe import PERIOD_S as PROBE_PERIOD_S, summarize as scheduling_summary
    from torch_reccl.soak.runner import interruption_stats, process_name, resource_verdicts, run_soak

    fabric = Fabric(hosts=args.hosts, rails=args.rails, rate_mbit=args.rate_mbit or None,
                    name=args.name or unique_fabric_name("s"))
    started = time.time()
    with terminated_by_signal():
        try:
            fabric.up()
            print(f"reccl soak: fabric {fabric.name!r} up: {args.hosts} hosts x {args.rails} rails"
                  f"{f' at {args.rate_mbit:g} Mbit/s' if args.rate_mbit else ''}; running "
                  f"{args.duration:g} s", file=sys.stderr)
            result = run_soak(fabric, settings, faults, faults_end,
                              on_line=lambda line: print(line, file=sys.stderr, flush=True))
        except FabricError as error:
            print(f"reccl soak: error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\nreccl soak: interrupted; tearing down", file=sys.stderr)
            return 130
        finally:
            fabric.down()
    problems = list(result.errors)
    resources_problems, resources = resource_verdicts(
        result, settings, faults_end, setup_hosts={fabric.mgmt_ip(h) for h in range(args.hosts)})
    if not result.errors:
        problems += resources_problems
        if result.replay is None or not result.replay.get("identical"):
            problems.append(f"final parameters differ from the fault-free replay: {result.replay}")
    interruptions = interruption_stats(result, spans)
    scheduling = scheduling_summary(result.scheduling)
    applied = sum(1 for a in result.applied if a["what"] == "apply")
    done = result.done.get(0, {})
    stream = result.plugin.summary(result.t0) if result.plugin is not None else None
    report = {"command": " ".join(sys.argv), "started": started, "hosts": args.hosts,
              "rails": args.rails, "rate_mbit": args.rate_mbit, "duration_s": args.duration,
              "seed": args.seed, "schedule": [f.to_json() for f in faults], "outages": spans,
              "faults_applied": applied, "iterations": done.get("iterations"),
              "steps": done.get("steps"), "resources": resources, "interruptions": interruptions,
              "scheduling_gaps": scheduling,
              "plugin": stream, "problems": problems, "ok": not problems, "run": result.to_json()}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1, default=str)
    if not args.no_plot and result.ticks:
        from torch_reccl.soak.plot import plot_soak

        try:
            plot_soak(report, result, args.plot)
            print(f"reccl soak: plot {os.path.abspath(args.plot)}", file=sys.stderr)
        except ImportError as error:
            print(f"reccl soak: no plot: {error}", file=sys.stderr)
    print(f"faults applied: {applied} of {len(faults)}; iterations: {done.get('iterations')}; "
          f"training steps: {done.get('steps')}; wrong values: {len(result.wrong)}")
    for kind, stats in interruptions.items():
        if stats["count"]:
            print(f"{kind}: {stats['count']}, interruption p50 {stats['p50_ms']:.1f} ms, "
                  f"p99 {stats['p99_ms']:.1f} ms, max {stats['max_ms']:.1f} ms")
    if scheduling["count"]:
        print(f"the machine's scheduling gaps (a {PROBE_PERIOD_S * 1e3:g} ms sleeper's lateness): p50 "
              f"{scheduling['p50_ms']:.1f} ms, p99 {scheduling['p99_ms']:.1f} ms, max {scheduling['max_ms']:.1f} ms")
    print(stream_line(stream))
    for who, r in resources.items():
        print(f"{process_name(who)}: RSS {r['rss_kb_warm'] / 1024:.0f} -> {r['rss_kb_end'] / 1024:.0f} MiB "
              f"({r['rss_growth']:+.1%}), fds {r['fds'][0]} -> {r['fds'][1]}, threads "
              f"{r['threads'][0]} -> {r['threads'][1]}, sockets {r['sockets'][0]} -> {r['sockets'][1]}"
              f" (explained: {r['explained']['threads']} pooled workers, "
              f"{r['explained']['sockets']} fault-board store connections)")
    if result.replay:
        print(f"final parameters bit-identical to the fault-free replay: "
              f"{'YES' if result.replay.get('identical') else 'NO'}")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"verdict: {'OK' if not problems else 'FAILED'}")
    return 0 if not problems else 1

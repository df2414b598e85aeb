"""``reccl drill``: a training run loses a NIC (or a rail) and keeps going.

    reccl drill [--fault SCHEDULE] [--hosts 2] [--rails 2] [--rate-mbit 200]
                [--steps N | --duration 30s] [--verify] [--mode auto|fabric|inject]
                [--device cpu|cuda] [--compare gloo|nccl]
                [--plot reccl-drill.png | --no-plot] [--json PATH]

As root, builds an emulated rail-optimized fabric (docs/fabric.md), starts one
training rank per host (data-parallel over the "reccl" backend on CPU, a small
MLP with fixed seeds), applies the fault schedule as real kernel events, shows a live
progress line, prints a summary and writes a PNG of throughput over time and
loss per step (over the fault-free reference with --verify), faults marked. The fabric
is always torn down (also on Ctrl-C and SIGTERM).

Without root (or --mode inject) the ranks run on this machine over loopback
NICs 127.0.0.1, 127.0.0.2, ... and each fault is injected inside the ranks with
torch_reccl.inject_fault on the NIC the schedule names.

--verify then runs the same number of steps without faults and checks that the
final parameters are bit-identical.

--device cuda trains on CUDA tensors with NCCL through torch_reccl's net plugin,
the path GPU jobs run (ranks share the GPUs round-robin; each is its own NCCL
host, NCCL's peer-to-peer and shared-memory transports off, so every byte crosses
the plugin).

--compare gloo (CPU) or --compare nccl (--device cuda: NCCL's own socket
transport) first runs the same job over that baseline (on NIC 0 of each host, as
a job pinned to one rail) through the same fault schedule on the same fabric,
then over reccl, each with its own fault-free reference, and reports for each:
survived or died (when, with what error), steps completed, longest stall, final
parameters equal to its fault-free run or not; the plot shows both. Without
the emulated fabric there is no fault to give a baseline (inject_fault acts
inside reccl only): its run is then fault-free, and the report says so.

Fault schedule (--fault may repeat): TARGET:ACTION@WHEN[,...]
  TARGET  railR (NIC R of every host), hHnicR (NIC R of host H), nicR (host 0)
  ACTION  down, up, flap, blackhole, heal (undo every fault on the target)
  WHEN    20s, 1500ms (since training began) or "step 40" (after step 40)
Default: rail1:down@10s,rail1:up@20s with --duration 30s. "none": no faults.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import List, Optional

from torch_reccl.cli.launch import (
    FabricPlacement,
    LoopbackPlacement,
    cuda_problem,
    terminated_by_signal,
    unique_fabric_name,
)
from torch_reccl.cli.progress import isatty
from torch_reccl.drill.faults import FabricFaults, InjectedFaults
from torch_reccl.drill.runner import RunResult, Settings, interruptions, median, per_rank, run_training, step_times
from torch_reccl.drill.schedule import check_topology, fault_spans, parse_schedule

DEFAULT_SCHEDULE = "rail1:down@10s,rail1:up@20s"
DEFAULT_DURATION_S = 30.0
DEFAULT_RATE_MBIT = 200.0
DEFAULT_PLOT = "reccl-drill.png"
PLAIN_LINE_EVERY_S = 5.0   # progress lines when stderr is not a terminal
RUN_SLACK_S = 600.0        # a --duration run may take this much longer (start, faults, finish)
STEPS_RUN_TIMEOUT_S = 3600.0  # bound on a --steps run (each step is bounded by --stall-timeout too)


def parse_duration(text: str) -> float:
    match = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$", str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; use e.g. 30s, 90, 2m, 2h or 500ms")
    value = float(match.group(1))
    scale = {"ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}[match.group(2)]
    if value * scale <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return value * scale


# ---------------------------------------------------------------- mode


BASELINE_NAMES = {"gloo": "Gloo", "nccl": "NCCL's socket transport"}


def fabric_problem() -> Optional[str]:
    """Why the emulated fabric cannot be built here, or None."""
    import importlib.util

    if not sys.platform.startswith("linux"):
        return "not Linux (no network namespaces)"
    if os.geteuid() != 0:
        return "not root (network namespaces need root)"
    if importlib.util.find_spec("pyroute2") is None:
        return "pyroute2 is not installed (pip install pyroute2)"
    return None


# ---------------------------------------------------------------- live output


class LiveLine:
    """The progress line: redrawn in place on a terminal, else a line every few seconds."""

    def __init__(self, settings: Settings, total_faults: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.tty = isatty(self.stream)
        self.settings = settings
        self.total_faults = total_faults
        self._last_plain = 0.0
        self._width = 0
        self._reported = 0

    def update(self, run: RunResult, fault_applied: bool) -> None:
        while self._reported < len(run.applied):
            a = run.applied[self._reported]
            self._reported += 1
            self._permanent(f"  {a.t:7.1f} s  step {a.step:>5}  {a.fault.text:<24} {a.what}")
        if not run.steps and not fault_applied:
            text = f"[{run.label}] starting {run.world} ranks..."
        else:
            text = self.describe(run)
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
            self.stream.flush()
        elif time.monotonic() - self._last_plain >= PLAIN_LINE_EVERY_S:
            self._last_plain = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def describe(self, run: RunResult) -> str:
        s = run.steps[-1] if run.steps else {"step": 0, "t": 0.0, "loss": float("nan"),
                                             "step_s": float("nan"), "samples_per_s": 0.0}
        if self.settings.steps is not None:
            where = f"step {s['step']}/{self.settings.steps}"
        else:
            where = f"step {s['step']} {s['t']:.1f}/{self.settings.duration_s:g} s"
        return (f"[{run.label}] {where}  loss {s['loss']:.4f}  step {s['step_s'] * 1e3:.0f} ms  "
                f"{s['samples_per_s']:.0f} samples/s  faults {len(run.applied)}/{self.total_faults}  "
                f"failovers {run.count('failover')}  failbacks {run.count('failback')}")

    def _permanent(self, text: str) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self, run: RunResult) -> None:
        """The last state, on its own line."""
        self._last_plain = 0.0
        self.update(run, False)
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        self.stream.flush()


# ---------------------------------------------------------------- summary


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if not math.isnan(seconds) else "-"


def throughput_windows(run: RunResult, flap_s: float):
    """Median samples/s before the first fault, while a fault held, after the last."""
    spans = fault_spans([(a.fault, a.t) for a in run.applied], run.end_t, flap_s)
    inside = lambda t: any(start <= t <= end for start, end, _ in spans)  # noqa: E731
    first = min((a.t for a in run.applied), default=None)
    last_end = max((end for _, end, _ in spans), default=None)
    before = [s["samples_per_s"] for s in run.steps if first is None or s["t"] < first]
    during = [s["samples_per_s"] for s in run.steps if inside(s["t"])]
    after = [s["samples_per_s"] for s in run.steps
             if last_end is not None and s["t"] > last_end and not inside(s["t"])]
    return median(before), median(during), median(after)


def summary(run: RunResult, reference: Optional[RunResult], verify: Optional[dict], where: str,
            plot_path: Optional[str], flap_s: float) -> List[str]:
    lines = [f"reccl drill summary: {where}"]
    if run.steps:
        first, last = run.steps[0], run.steps[-1]
        med, worst, worst_step = step_times(run)
        lines.append(f"  training     {last['step']} steps in {last['t']:.1f} s; loss {first['loss']:.4f} "
                     f"-> {last['loss']:.4f}")
        if worst_step is not None:
            lines.append(f"  step time    median {_ms(med)}, max {_ms(worst)} ({worst / med:.1f}x median) "
                         f"at step {worst_step['step']} ({worst_step['t']:.1f} s); first step "
                         f"(connections made) {_ms(first['step_s'])}")
        before, during, after = throughput_windows(run, flap_s)
        first_label = "before faults" if run.applied else "all steps"
        parts = [f"{name} {value:.0f}" for name, value in
                 ((first_label, before), ("while a fault held", during), ("after", after))
                 if not math.isnan(value)]
        lines.append(f"  throughput   samples/s (median): {', '.join(parts)}")
    else:
        lines.append("  training     no step finished")
    for i, a in enumerate(run.applied):
        head = "  faults      " if i == 0 else "              "
        lines.append(f"{head} {a.fault.text} at {a.t:.1f} s (after step {a.step}): {a.what}")
    for fault in run.not_applied:
        lines.append(f"  NOT APPLIED  {fault.text}: training ended first (at {run.end_t:.1f} s, "
                     f"step {len(run.steps)})")
    if not run.applied and not run.not_applied:
        lines.append("  faults       none scheduled")
    for kind in ("failover", "failback"):
        count = run.count(kind)
        ranks = ", ".join(f"rank {r}: {n}" for r, n in sorted(per_rank(run, kind).items()))
        pause = interruptions(run, kind)
        timing = (f"; interruption (detection to traffic resumed) median {_ms(median(pause))}, "
                  f"max {_ms(max(pause))}") if pause else ""
        lines.append(f"  {kind + 's':<12} {count}{f' ({ranks})' if ranks else ''}{timing}")
    others = {k: run.count(k) for k in ("nic_down", "nic_up", "path_down", "rebalance",
                                        "degraded", "recovered", "stalled")}
    lines.append("  events       " + ", ".join(f"{k} {n}" for k, n in others.items()))
    if verify is not None:
        lines.append("  verify       " + verify["line"])
    if plot_path:
        lines.append(f"  plot         {plot_path}")
    if run.error:
        lines.append(f"  ERROR        {run.error}")
    elif reference is not None and reference.error:
        lines.append(f"  ERROR        reference run: {reference.error}")
    return lines


def longest_stall(run: RunResult) -> float:
    """The longest wait for a step: the slowest step, or from the last step to
    the end of a run that died (a hang the stall or collective timeout ended)."""
    longest = max((s["step_s"] for s in run.steps[1:]), default=0.0)
    if run.error is not None and run.failed_t is not None:
        longest = max(longest, run.failed_t - run.end_t)
    return longest


def outcome(run: RunResult, faulted: bool) -> dict:
    """Survived or died (when, with what error): one backend's row of --compare."""
    row = {"backend": run.label, "steps": len(run.steps), "longest_stall_s": round(longest_stall(run), 2),
           "faults_applied": len(run.applied) if faulted else 0, "survived": run.finished}
    if not run.finished:
        lines = [line for line in (run.error or "").splitlines() if line.strip()]
        # the rank's own last words name the cause: the exception line in its log
        cause = next((line.strip() for line in reversed(lines) if "Error" in line or "error" in line),
                     lines[0] if lines else "?")
        row["died_at_s"] = None if run.failed_t is None else round(run.failed_t, 1)
        row["error"] = cause[:240]
    return row


def comparison_lines(rows: List[dict]) -> List[str]:
    lines = ["comparison (same fault schedule, same fabric):",
             f"  {'backend':<8} {'outcome':<44} {'steps':>6} {'longest stall':>14}  final parameters"]
    for row in rows:
        if row["survived"]:
            what = "survived" + ("" if row["faults_applied"] else " (no fault applied)")
        else:
            at = f" at {row['died_at_s']:.1f} s" if row.get("died_at_s") is not None else ""
            what = f"DIED{at}"
        same = row.get("identical")
        verdict = ("bit-identical to its fault-free run" if same else
                   "DIFFER from its fault-free run" if same is False else "not compared")
        lines.append(f"  {row['backend']:<8} {what:<44} {row['steps']:>6} {row['longest_stall_s']:>12.1f} s  {verdict}")
        if not row["survived"]:
            lines.append(f"  {'':<8} error: {row['error']}")
        if row.get("note"):
            lines.append(f"  {'':<8} {row['note']}")
    return lines


def verify_runs(run: RunResult, reference: RunResult) -> dict:
    """Compares the final parameters (every rank) and the loss of every step."""
    if not run.finished or not reference.finished:
        return {"identical": False, "line": "not compared: a run did not finish"}
    digests = {d["params_sha256"] for d in run.done.values()}
    ref_digests = {d["params_sha256"] for d in reference.done.values()}
    losses_same = [s["loss"] for s in run.steps] == [s["loss"] for s in reference.steps]
    identical = len(digests) == 1 and digests == ref_digests
    digest = next(iter(digests))
    if identical:
        line = (f"final parameters bit-identical to the fault-free run: YES (sha256 {digest[:16]}..., "
                f"every rank); loss identical at all {len(run.steps)} steps: "
                f"{'yes' if losses_same else 'NO'}")
    else:
        line = (f"final parameters bit-identical to the fault-free run: NO (this run "
                f"{sorted(d[:16] for d in digests)}, reference {sorted(d[:16] for d in ref_digests)})")
    return {"identical": identical, "losses_identical": losses_same, "line": line,
            "params_sha256": sorted(digests), "reference_params_sha256": sorted(ref_digests)}


# ---------------------------------------------------------------- command


def run(args) -> int:
    try:
        faults = parse_schedule(args.fault if args.fault else [DEFAULT_SCHEDULE])
        if args.hosts < 2 or args.rails < 1:
            raise ValueError(f"a drill needs --hosts >= 2 and --rails >= 1; got {args.hosts} and {args.rails}")
        check_topology(faults, args.hosts, args.rails)
        if args.rails < 2 and any(f.action in ("down", "blackhole", "flap") for f in faults):
            raise ValueError("with --rails 1 a NIC fault leaves no backup NIC; use --rails 2 or more")
        if args.flap_period <= 0 or args.flap_count < 1:
            raise ValueError("--flap-period must be > 0 and --flap-count >= 1")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1; got {args.steps}")
        if args.batch < 1 or args.width < 1 or args.depth < 0:
            raise ValueError(f"--batch and --width must be >= 1 and --depth >= 0; got "
                             f"{args.batch}, {args.width}, {args.depth}")
        if args.stall_timeout <= 0 or args.collective_timeout <= 0:
            raise ValueError("--stall-timeout and --collective-timeout must be > 0 seconds")
        baselines = {"cpu": "gloo", "cuda": "nccl"}
        if args.compare and args.compare != baselines[args.device]:
            raise ValueError(f"--compare {args.compare} is the baseline of --device "
                             f"{'cpu' if args.compare == 'gloo' else 'cuda'}; with --device {args.device} "
                             f"compare {baselines[args.device]}")
        if args.device == "cuda":
            problem = cuda_problem()  # ranks share the GPUs: one is enough
            if problem:
                raise ValueError(problem)
    except ValueError as error:  # ScheduleError is a ValueError
        print(f"reccl drill: error: {error}", file=sys.stderr)
        return 2
    duration = None if args.steps is not None else (args.duration or DEFAULT_DURATION_S)
    settings = Settings(steps=args.steps, duration_s=duration, batch=args.batch, width=args.width,
                        depth=args.depth, seed=args.seed, stall_timeout_s=args.stall_timeout,
                        collective_timeout_s=args.collective_timeout, device=args.device,
                        run_timeout_s=(duration + RUN_SLACK_S) if duration else STEPS_RUN_TIMEOUT_S)
    mode = args.mode
    problem = fabric_problem() if mode in ("auto", "fabric") else None
    if problem and mode == "fabric":
        print(f"reccl drill: error: --mode fabric: {problem}; use --mode inject", file=sys.stderr)
        return 2
    if problem:
        print(f"reccl drill: {problem}: no emulated fabric; falling back to torch_reccl.inject_fault "
              f"on loopback NICs", file=sys.stderr)
        mode = "inject"
    elif mode == "auto":
        mode = "fabric"
    flap_s = args.flap_period * args.flap_count
    rate = None if args.rate_mbit == 0 else args.rate_mbit
    kernel_only = sorted(f.text for f in faults if f.action in InjectedFaults.FABRIC_ONLY)
    slow = sorted(f.text for f in faults if f.action == "slow")
    if kernel_only and mode == "inject":
        print(f"reccl drill: error: {', '.join(kernel_only)}: slow and lossy NICs are kernel "
              f"faults (tbf, nftables) with no inject_fault equivalent; they need the emulated "
              f"fabric (root)", file=sys.stderr)
        return 2
    if slow and rate is None:
        print(f"reccl drill: error: {', '.join(slow)}: a slow NIC needs a rate-capped fabric "
              f"to cut; give --rate-mbit > 0", file=sys.stderr)
        return 2

    fabric = None
    run_result: Optional[RunResult] = None
    reference: Optional[RunResult] = None
    baseline: Optional[RunResult] = None            # --compare: the Gloo run
    baseline_reference: Optional[RunResult] = None
    baseline_note = ""
    with terminated_by_signal():
        try:
            if mode == "fabric":
                from torch_reccl.fabric import Fabric, FabricError

                fabric = Fabric(hosts=args.hosts, rails=args.rails, rate_mbit=rate,
                                name=args.name or unique_fabric_name("d"))
                try:
                    fabric.up()
                except FabricError as error:
                    fabric = None
                    if args.mode == "fabric":
                        print(f"reccl drill: error: {error}", file=sys.stderr)
                        return 1
                    print(f"reccl drill: could not build the emulated fabric ({error}); falling back "
                          f"to torch_reccl.inject_fault on loopback NICs", file=sys.stderr)
                    mode = "inject"
            if fabric is not None:
                fabric_faults = FabricFaults(fabric, args.flap_period, args.flap_count)
                placement_for = lambda: FabricPlacement(fabric)  # noqa: E731
                make_applier = lambda job: fabric_faults  # noqa: E731
                where = placement_for().describe()
                how = fabric_faults.describe()
            else:
                placement_for = lambda: LoopbackPlacement(args.hosts, args.rails)  # noqa: E731
                make_applier = lambda job: InjectedFaults(job, job.placement, args.flap_period,  # noqa: E731
                                                          args.flap_count)
                where = placement_for().describe()
                how = InjectedFaults.describe() + (
                    " (NIC R is 127.0.0.{R+1}; no rate cap without the fabric)")
            length = f"{settings.steps} steps" if settings.steps else f"{settings.duration_s:g} s"
            tensors = ("CUDA tensors, NCCL through torch_reccl's plugin" if args.device == "cuda"
                       else "CPU tensors")
            print(f"reccl drill: {where}; training {length} on {tensors}; {how}", file=sys.stderr)
            print(f"reccl drill: fault schedule: {', '.join(f.text for f in faults) or 'none'}",
                  file=sys.stderr)

            def train(label: str, backend: str, run_faults, steps: Optional[int] = None) -> RunResult:
                run_settings = Settings(**{**settings.__dict__, "backend": backend})
                if steps is not None:  # a reference: as many steps as the run it checks
                    run_settings = Settings(**{**run_settings.__dict__, "steps": steps, "duration_s": None})
                live = LiveLine(run_settings, len(run_faults))
                result = run_training(label, placement_for(), run_settings, run_faults, make_applier,
                                      commands=fabric is None, on_update=live.update)
                live.finish(result)
                if fabric is not None:
                    fabric_faults.heal_all()
                return result

            def check_run(result: RunResult, backend: str) -> Optional[RunResult]:
                if not ((args.verify or args.compare) and result.finished):
                    return None
                return train(f"{backend} reference", backend, [], steps=len(result.steps))

            if args.compare:
                if fabric is None:
                    # inject_fault acts on reccl's own NICs: the baseline's sockets never see it
                    baseline_note = (f"no fault applied: without the emulated fabric there is no fault "
                                     f"to give {BASELINE_NAMES[args.compare]} (inject_fault acts inside "
                                     f"reccl only); its fault-free baseline")
                    print(f"reccl drill: {args.compare}: {baseline_note}", file=sys.stderr)
                baseline = train(args.compare, args.compare, faults if fabric is not None else [])
                baseline_reference = check_run(baseline, args.compare)
            run_result = train("reccl" if args.compare else "drill", "reccl", faults)
            reference = check_run(run_result, "reccl")
        except KeyboardInterrupt:
            print("\nreccl drill: interrupted; tearing down", file=sys.stderr)
            return 130
        finally:
            if fabric is not None:
                fabric.down()

    verify = verify_runs(run_result, reference) if reference is not None else None
    rows = []
    if baseline is not None:
        for result, ref in ((baseline, baseline_reference), (run_result, reference)):
            row = outcome(result, bool(result.applied))
            row["identical"] = verify_runs(result, ref)["identical"] if ref is not None else None
            if result is baseline and baseline_note:
                row["note"] = baseline_note
            rows.append(row)
    plot_path = None
    if not args.no_plot and run_result.steps:
        from torch_reccl.drill.plot import plot_drill

        title = (f"reccl drill: {where}\nfaults: {', '.join(f.text for f in faults) or 'none'}")
        try:
            plot_path = plot_drill(run_result, args.plot, title, reference, flap_s, baseline=baseline)
        except ImportError as error:
            print(f"reccl drill: no plot: {error}", file=sys.stderr)
    print("\n".join(summary(run_result, reference, verify, where, plot_path, flap_s)))
    if rows:
        print("\n".join(comparison_lines(rows)))
    ok = (run_result.finished and (verify is None or verify["identical"])
          and not run_result.not_applied)
    if run_result.finished:
        lost = ", ".join(sorted({a.fault.target for a in run_result.applied
                                 if a.fault.action in ("down", "blackhole", "flap")}))
        kept = f"lost {lost} and kept going" if lost else "ran without faults"
        missed = (f"; {len(run_result.not_applied)} scheduled fault(s) never fired because training "
                  f"ended first: train longer (--duration/--steps)" if run_result.not_applied else "")
        print(f"verdict: {'OK' if ok else 'FAILED'}: the training run {kept} "
              f"({len(run_result.steps)} steps, {run_result.count('failover')} failovers){missed}")
    else:
        print("verdict: FAILED: the training run did not finish")
    if args.json:
        record = {"mode": mode, "where": where, "schedule": [f.text for f in faults],
                  "settings": settings.__dict__, "run": run_result.to_json(),
                  "reference": reference.to_json() if reference else None, "verify": verify,
                  "plot": plot_path, "ok": ok}
        if baseline is not None:
            record["compare"] = {"rows": rows, "baseline": baseline.to_json(),
                                 "baseline_reference": baseline_reference.to_json()
                                 if baseline_reference else None}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "drill", help="a training run loses a NIC and keeps going (emulated fabric, or inject_fault)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", action="append", metavar="SCHEDULE",
                        help=f"fault schedule (repeatable); default {DEFAULT_SCHEDULE}")
    parser.add_argument("--hosts", type=int, default=2, help="hosts = ranks (default 2)")
    parser.add_argument("--rails", type=int, default=2, help="NICs per host (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=DEFAULT_RATE_MBIT,
                        help=f"fabric: cap every NIC at this rate, so NICs are the bottleneck as on a "
                             f"cluster (default {DEFAULT_RATE_MBIT:g}; 0: no cap)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help="train this many steps")
    length.add_argument("--duration", type=parse_duration, default=None,
                        help=f"train this long (default {DEFAULT_DURATION_S:g}s)")
    parser.add_argument("--verify", action="store_true",
                        help="then run the same steps fault-free and compare parameters bit for bit")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the reccl backend (default); cuda: NCCL through torch_reccl's plugin")
    parser.add_argument("--compare", choices=("gloo", "nccl"), default=None,
                        help="first run the same job and faults over this baseline (gloo for "
                             "--device cpu, NCCL's socket transport for cuda), each checked "
                             "against its own fault-free run")
    parser.add_argument("--mode", choices=("auto", "fabric", "inject"), default="auto",
                        help="fabric (root), inject (inject_fault on loopback), auto (default)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"PNG of throughput over time and loss per step (default {DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--json", metavar="PATH", help="also write every step and event as JSON")
    model = parser.add_argument_group("training job")
    model.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    model.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    model.add_argument("--depth", type=int, default=3, help="MLP hidden layers (default 3)")
    model.add_argument("--seed", type=int, default=0, help="seed of model and data (default 0)")
    faults = parser.add_argument_group("faults and bounds")
    faults.add_argument("--flap-period", type=float, default=0.5,
                        help="flap: seconds per down+up cycle (default 0.5)")
    faults.add_argument("--flap-count", type=int, default=6, help="flap: cycles (default 6)")
    faults.add_argument("--stall-timeout", type=float, default=60.0,
                        help="give up when no step finishes for this long (default 60 s)")
    faults.add_argument("--collective-timeout", type=float, default=60.0,
                        help="the process group's timeout (default 60 s)")
    faults.add_argument("--name", default=None, help="fabric name (default: d + pid digits)")
    parser.set_defaults(func=run)
    return parser

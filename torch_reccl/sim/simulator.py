"""``reccl sim``: GPU hours that last-hop network faults cost a large training job.

    reccl sim [--runs N] [--seed S] [--policies P ...] [--json PATH]
              [--plot PATH | --no-plot] [--progress] [model flags]
    reccl sim --analytic [--json PATH] [model flags]

A Monte-Carlo model of docs/design.md §10, vectorised over runs with numpy, comparing
these policies (--policies; all by default):

  fault_free                no faults
  restart                   every fault restarts the job from its last checkpoint
  restart_scaling           restart without a spare: fewer data-parallel replicas
                            until the node comes back
  degrade_until_checkpoint  ReCCL as the paper models it (eq. 2), the default
                            failover policy: fail over, run at slowdown k until the
                            next checkpoint, reload there onto healthy hardware;
                            restart at once where eq. 4 says that is cheaper
  advised                   as degrade_until_checkpoint, but reload at the next
                            checkpoint only if running on until the repair wastes
                            more than the reload (the online advisor's look-ahead)
  degrade_until_repair      fail over and run at slowdown k until the repair,
                            never restarting

and a closed-form model of the expected completion time under restart and under
failover against job size. Every model parameter is a flag; the defaults are the
paper's case study (Llama3-405B on 16,384 GPUs). docs/simulation.md describes the
model.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from torch_reccl.advisor import failover_threshold, reload_beats_degraded
from torch_reccl.cli.progress import ProgressBar

HOURS_PER_MONTH = 365 * 24 / 12
POLICIES = ("fault_free", "restart", "restart_scaling", "degrade_until_checkpoint", "advised",
            "degrade_until_repair")
BASELINES = ("restart", "restart_scaling")  # the policies savings are measured against
# the policies that choose per fault between restarting and failing over (eq. 4)
ADVISED = ("degrade_until_checkpoint", "advised")
ANALYTIC_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_PLOT = "reccl-sim-cdf.png"

# Runs are simulated in batches of this size: it sets the progress bar's steps and,
# with the seed, the random streams, so it is part of what makes results reproducible.
BATCH_RUNS = 1000
# A job that is still running after this many events per run cannot make progress.
MAX_EVENTS = 200_000


def _param(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class SimParams:
    """The model's parameters; durations in hours. Defaults: the paper's case study."""

    gpus: int = _param(16384, "GPUs in the job")
    gpus_per_host: int = _param(8, "GPUs per host")
    nics_per_host: int = _param(8, "NICs per host, one per rail")
    hosts_per_tor: int = _param(32, "hosts under one ToR (rail) switch")
    fault_free_hours: float = _param(1925.0, "wall-clock hours of the job without faults")
    link_failure_pct_per_month: float = _param(
        0.057, "NIC-ToR link failures, percent per link per month")
    switch_failure_pct_per_month: float = _param(
        0.051, "ToR switch failures, percent per switch per month")
    checkpoint_interval_h: float = _param(1.0, "hours of work between checkpoints")
    t_detect_h: float = _param(0.5, "T_detect: finding and excluding the faulty node")
    t_reload_h: float = _param(0.5, "T_reload: rescheduling and loading a checkpoint")
    t_timeout_h: float = _param(30 / 3600, "T_timeout: stall until a transport timeout fires")
    k_by_faults: tuple[float, ...] = _param(
        (1.03, 1.20, 1.50),
        "failover slowdown k with 1, 2, ... concurrent faults; the last holds for more")
    dp_degree: int = _param(16, "data-parallel degree (restart_scaling drops replicas)")
    node_replacement_h: float = _param(
        24.0, "hours until an excluded node rejoins (restart_scaling)")
    repair_h: float = _param(24.0, "hours until a failed link or switch is repaired (failover)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_by_faults", tuple(float(k) for k in self.k_by_faults))
        for name in ("gpus", "gpus_per_host", "nics_per_host", "hosts_per_tor", "dp_degree"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus % self.gpus_per_host:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of "
                             f"gpus_per_host ({self.gpus_per_host})")
        if self.dp_degree > self.hosts:
            raise ValueError(f"dp_degree ({self.dp_degree}) cannot exceed the hosts ({self.hosts})")
        for name in ("fault_free_hours", "checkpoint_interval_h"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("link_failure_pct_per_month", "switch_failure_pct_per_month", "t_detect_h",
                     "t_reload_h", "t_timeout_h", "node_replacement_h", "repair_h"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.k_by_faults or min(self.k_by_faults) < 1:
            raise ValueError(
                f"k_by_faults needs one or more values >= 1, got {list(self.k_by_faults)}")

    @property
    def hosts(self) -> int:
        return self.gpus // self.gpus_per_host

    @property
    def links(self) -> int:
        return self.hosts * self.nics_per_host

    @property
    def tor_switches(self) -> int:
        # rail-optimized: each rail has one switch per group of hosts_per_tor hosts
        return self.nics_per_host * math.ceil(self.hosts / self.hosts_per_tor)

    @property
    def link_fault_rate_per_h(self) -> float:
        return self.links * self.link_failure_pct_per_month / 100 / HOURS_PER_MONTH

    @property
    def switch_fault_rate_per_h(self) -> float:
        return self.tor_switches * self.switch_failure_pct_per_month / 100 / HOURS_PER_MONTH

    @property
    def fault_rate_per_h(self) -> float:
        return self.link_fault_rate_per_h + self.switch_fault_rate_per_h

    @property
    def restart_downtime_h(self) -> float:
        return self.t_timeout_h + self.t_detect_h + self.t_reload_h

    @property
    def replicas_per_switch_fault(self) -> int:
        """DP replicas a ToR failure takes out (replicas laid out on consecutive hosts)."""
        hosts_per_replica = self.hosts / self.dp_degree
        hosts_under_tor = min(self.hosts_per_tor, self.hosts)
        return min(self.dp_degree, math.ceil(hosts_under_tor / hosts_per_replica))

    def slowdown(self, concurrent_faults: np.ndarray) -> np.ndarray:
        """k for each count of concurrent faults (1 with none)."""
        table = np.array((1.0,) + self.k_by_faults)
        return table[np.minimum(concurrent_faults.astype(int), len(table) - 1)]


class _ActiveFaults:
    """Per run, the faults that still act on the job: when each ends (inf: only a
    reload or restart ends it), and its weight (1 per failed-over fault, DP replicas
    out under restart_scaling; 0: a free slot)."""

    def __init__(self, runs: int) -> None:
        self.ends = np.full((runs, 2), np.inf)
        self.weights = np.zeros((runs, 2))

    def load(self) -> np.ndarray:
        return self.weights.sum(1)

    def next_end(self) -> np.ndarray:
        return self.ends.min(1)

    def last_end(self, rows: np.ndarray) -> np.ndarray:
        ends = self.ends[rows]
        return np.where(self.weights[rows] > 0, ends, -np.inf).max(1)

    def add(self, rows: np.ndarray, ends: np.ndarray, weights: np.ndarray) -> None:
        """One new fault for each run where rows is true (ends, weights: per run)."""
        free = self.weights == 0
        if not free[rows].any(1).all():
            self.ends = np.hstack([self.ends, np.full_like(self.ends, np.inf)])
            self.weights = np.hstack([self.weights, np.zeros_like(self.weights)])
            free = self.weights == 0
        index = np.flatnonzero(rows)
        slot = free[index].argmax(1)
        self.ends[index, slot] = ends[index]
        self.weights[index, slot] = weights[index]

    def end_earliest(self, rows: np.ndarray) -> None:
        index = np.flatnonzero(rows)
        slot = self.ends[index].argmin(1)
        self.ends[index, slot] = np.inf
        self.weights[index, slot] = 0.0

    def clear(self, rows: np.ndarray) -> None:
        self.ends[rows] = np.inf
        self.weights[rows] = 0.0


# what happens next in a run, in the order of the rows of `waits` below
_FINISH, _FAULT, _FAULT_ENDS, _PLANNED_RELOAD = range(4)


def simulate_wall_hours(policy: str, params: SimParams, runs: int,
                        rng: np.random.Generator) -> np.ndarray:
    """Wall-clock hours to finish the job, one per run, under one policy.

    Event-driven and vectorised: each pass of the loop moves every run to its own
    next event (finish, fault, end of a fault, planned reload), so the loop runs as
    many times as the busiest run has events, not once per run.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    p = params
    work = p.fault_free_hours
    if policy == "fault_free":
        return np.full(runs, work)
    interval = p.checkpoint_interval_h
    run_index = np.arange(runs)
    wall = np.zeros(runs)
    progress = np.zeros(runs)  # hours of fault-free work done
    running = np.ones(runs, dtype=bool)
    active = _ActiveFaults(runs)
    reload_at = np.full(runs, np.inf)  # the checkpoint (as progress) where a planned reload is due
    switch_share = p.switch_fault_rate_per_h / p.fault_rate_per_h if p.fault_rate_per_h else 0.0

    for _ in range(MAX_EVENTS):
        if not running.any():
            return wall
        load = active.load()
        if policy == "restart_scaling":
            held = np.maximum(p.dp_degree - load, 1) / p.dp_degree
            speed, fault_rate = held, p.fault_rate_per_h * held  # fewer hosts, fewer faults
        else:
            speed, fault_rate = 1 / p.slowdown(load), p.fault_rate_per_h
        with np.errstate(divide="ignore"):
            waits = np.stack([
                (work - progress) / speed,
                # Faults are Poisson: memoryless, so a fresh draw at every event is exact.
                rng.standard_exponential(runs) / fault_rate,
                np.maximum(active.next_end() - wall, 0.0),  # may have ended during a restart
                (reload_at - progress) / speed,
            ])
        event = waits.argmin(0)
        step = np.where(running, waits[event, run_index], 0.0)
        wall += step
        progress += step * speed

        running &= event != _FINISH

        ended = running & (event == _FAULT_ENDS)
        active.end_earliest(ended)
        reload_at[ended & (active.load() == 0)] = np.inf  # repaired before the reload: skip it

        reload = running & (event == _PLANNED_RELOAD)
        progress[reload] = reload_at[reload]
        wall[reload] += p.t_reload_h
        active.clear(reload)
        reload_at[reload] = np.inf

        fault = running & (event == _FAULT)
        elapsed = progress % interval  # work since the last checkpoint
        if policy in ADVISED:
            k_if_failed_over = p.slowdown(load + 1)
            threshold = failover_threshold(interval, k_if_failed_over, p.t_detect_h)
            restart = fault & (elapsed <= threshold)
        elif policy in BASELINES:
            restart = fault
        else:
            restart = np.zeros(runs, dtype=bool)
        fail_over = fault & ~restart

        if policy == "restart_scaling":
            is_switch = rng.random(runs) < switch_share
            replicas_out = np.where(is_switch, p.replicas_per_switch_fault, 1)
            active.add(restart, wall + p.node_replacement_h, replicas_out)
        else:
            active.clear(restart)  # the restarted job runs on healthy spare hardware
        progress[restart] -= elapsed[restart]
        wall[restart] += p.restart_downtime_h
        reload_at[restart] = np.inf

        # Eq. 2 swaps the faulty hardware out at the planned reload, so under
        # degrade_until_checkpoint a repair never ends a fault.
        repaired_at = (np.full(runs, np.inf) if policy == "degrade_until_checkpoint"
                       else wall + p.repair_h)
        active.add(fail_over, repaired_at, np.ones(runs))
        wall[fail_over] += p.t_timeout_h
        if policy in ADVISED and fail_over.any():
            _plan_reload(p, policy, fail_over, wall, progress, active, reload_at)
    raise RuntimeError(
        f"runs still unfinished after {MAX_EVENTS} events: faults come too often for "
        f"the job to make progress under {policy}")


def _plan_reload(p: SimParams, policy: str, fail_over: np.ndarray, wall: np.ndarray,
                 progress: np.ndarray, active: _ActiveFaults, reload_at: np.ndarray) -> None:
    """After a failover, plan a reload at the next checkpoint unless the job ends
    first: always under degrade_until_checkpoint (eq. 2); under advised only when
    that is cheaper than running degraded until the last active fault is repaired."""
    rows = np.flatnonzero(fail_over)
    interval = p.checkpoint_interval_h
    next_checkpoint = (np.floor(progress[rows] / interval) + 1) * interval
    due = next_checkpoint < p.fault_free_hours
    if policy == "advised":
        k = p.slowdown(active.load()[rows])
        at_checkpoint = wall[rows] + k * (next_checkpoint - progress[rows])
        degraded_after = active.last_end(rows) - at_checkpoint
        due &= reload_beats_degraded(k, degraded_after, p.t_reload_h)
    reload_at[rows] = np.where(due, next_checkpoint, np.inf)


@dataclass
class SimResult:
    """GPU hours per run under each policy, and the parameters that produced them."""

    params: SimParams
    runs: int
    seed: int
    gpu_hours: dict[str, np.ndarray]

    @property
    def fault_free_gpu_hours(self) -> float:
        return self.params.gpus * self.params.fault_free_hours

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per policy: median, p99 and mean of total and extra GPU hours, goodput
        (fault-free over mean GPU hours: the share of GPU hours spent on the job's
        work), and the savings in percent of a baseline's median extra GPU hours."""
        summary: dict[str, dict[str, float | None]] = {}
        for name, total in self.gpu_hours.items():
            extra = total - self.fault_free_gpu_hours
            summary[name] = {
                "median_gpu_hours": float(np.median(total)),
                "p99_gpu_hours": float(np.percentile(total, 99)),
                "mean_gpu_hours": float(total.mean()),
                "median_extra_gpu_hours": float(np.median(extra)),
                "p99_extra_gpu_hours": float(np.percentile(extra, 99)),
                "mean_extra_gpu_hours": float(extra.mean()),
                "goodput": self.fault_free_gpu_hours / float(total.mean()),
            }
        for baseline in BASELINES:
            if baseline not in summary:
                continue
            baseline_extra = summary[baseline]["median_extra_gpu_hours"]
            for stats in summary.values():
                stats[f"savings_vs_{baseline}_pct"] = (
                    100 * (1 - stats["median_extra_gpu_hours"] / baseline_extra)
                    if baseline_extra > 0 else None)
        return summary

    def to_json(self) -> dict:
        return {"policies": self.summary(),
                "params": {**asdict(self.params), "runs": self.runs, "seed": self.seed}}


def simulate(params: SimParams | None = None, runs: int = 10_000, seed: int = 0,
             policies: tuple[str, ...] = POLICIES, progress: ProgressBar | None = None
             ) -> SimResult:
    """Simulate `runs` jobs under each policy; reproducible for a given seed."""
    params = SimParams() if params is None else params
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    batch_sizes = [min(BATCH_RUNS, runs - start) for start in range(0, runs, BATCH_RUNS)]
    batch_seeds = np.random.SeedSequence(seed).spawn(len(batch_sizes))
    gpu_hours = {}
    for policy in policies:
        parts = []
        for size, batch_seed in zip(batch_sizes, batch_seeds):
            # Every policy gets the same random stream (common random numbers), which
            # sharpens the comparison between policies.
            rng = np.random.default_rng(batch_seed)
            parts.append(simulate_wall_hours(policy, params, size, rng) * params.gpus)
            if progress is not None:
                progress.advance(policy)
        gpu_hours[policy] = np.concatenate(parts)
    return SimResult(params=params, runs=runs, seed=seed, gpu_hours=gpu_hours)


def _gpu_hours_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def format_table(result: SimResult) -> str:
    p = result.params
    summary = result.summary()
    header = (f"{result.runs:,} runs, seed {result.seed}: {p.gpus:,} GPUs, "
              f"{p.fault_free_hours:g} h fault-free = "
              f"{result.fault_free_gpu_hours:,.0f} GPU hours; "
              f"{p.fault_rate_per_h * p.fault_free_hours:.1f} faults expected")
    columns = ["policy", "median GPU-h", "p99 GPU-h", "median extra", "p99 extra", "mean extra",
               "goodput"]
    baselines = [b for b in BASELINES if b in summary]
    columns += [f"saved vs {b}" for b in baselines]
    rows = [columns]
    for name, stats in summary.items():
        rows.append([name] + [_gpu_hours_text(stats[key]) for key in (
            "median_gpu_hours", "p99_gpu_hours", "median_extra_gpu_hours", "p99_extra_gpu_hours",
            "mean_extra_gpu_hours")]
            + [f"{100 * stats['goodput']:.2f}%"]
            + [_pct_text(stats[f"savings_vs_{b}_pct"]) for b in baselines])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [header, ""]
    for row in rows:
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]))
    lines.append("")
    lines.append("extra: GPU hours above fault-free; goodput: fault-free over mean GPU hours; "
                 "saved: share of the baseline's median extra GPU hours")
    return "\n".join(lines)


def plot_cdf(result: SimResult, path: str) -> None:
    """Write a PNG with the CDF of extra GPU hours per policy."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "the CDF plot needs matplotlib: pip install matplotlib, or pass --no-plot") from e
    figure = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    fraction = np.arange(1, result.runs + 1) / result.runs
    for name, total in result.gpu_hours.items():
        extra = np.sort(total - result.fault_free_gpu_hours)
        axes.step(extra / 1e3, fraction, where="post", label=name)
    p = result.params
    axes.set_title(f"{p.gpus:,} GPUs, {p.fault_free_hours:g} h fault-free, "
                   f"{result.runs:,} runs (seed {result.seed})")
    axes.set_xlabel("extra GPU hours over fault-free (thousands)")
    axes.set_ylabel("fraction of runs")
    axes.set_ylim(0, 1.01)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


@dataclass(frozen=True)
class AnalyticPoint:
    """Expected completion time of one job size under restart and under failover."""

    gpus: int
    fault_free_hours: float
    faults_per_hour: float
    restart_hours: float
    failover_hours: float

    @property
    def improvement_pct(self) -> float:
        return 100 * (1 - self.failover_hours / self.restart_hours)


def expected_restart_cost_h(p: SimParams) -> float:
    """Hours one fault adds under restart: downtime plus, on average, half an
    interval of lost work."""
    return p.restart_downtime_h + p.checkpoint_interval_h / 2


def expected_failover_cost_h(p: SimParams) -> float:
    """Hours one fault adds when the job takes the cheaper of restarting now and
    failing over until a reload at the next checkpoint, over a uniform t_elapsed.

    Uses k for one fault: a degraded spell lasts under one checkpoint interval,
    so concurrent faults are rare.
    """
    interval, k, t_detect = p.checkpoint_interval_h, p.k_by_faults[0], p.t_detect_h
    cut = min(max(failover_threshold(interval, k, t_detect), 0.0), interval)
    # restart (t_detect + t_elapsed) below the cut, failover ((k-1)(interval - t_elapsed)) above it
    chosen = (t_detect * cut + cut ** 2 / 2 + (k - 1) * (interval - cut) ** 2 / 2) / interval
    return p.t_timeout_h + p.t_reload_h + chosen


def _completion_hours(work: float, fault_rate: float, cost_per_fault: float) -> float:
    # Faults arrive at fault_rate over the whole run and each adds cost_per_fault:
    # T = work + fault_rate * T * cost, so T = work / (1 - fault_rate * cost).
    busy = fault_rate * cost_per_fault
    return work / (1 - busy) if busy < 1 else math.inf


def analytic(params: SimParams | None = None,
             gpus: tuple[int, ...] = ANALYTIC_GPUS) -> list[AnalyticPoint]:
    """Closed-form expected completion time for each job size.

    The job's compute is fixed: fault_free_hours scales as params.gpus / gpus.
    """
    params = SimParams() if params is None else params
    compute = params.gpus * params.fault_free_hours
    points = []
    for size in gpus:
        p = replace(params, gpus=size, fault_free_hours=compute / size)
        rate = p.fault_rate_per_h
        points.append(AnalyticPoint(
            gpus=size, fault_free_hours=p.fault_free_hours, faults_per_hour=rate,
            restart_hours=_completion_hours(p.fault_free_hours, rate, expected_restart_cost_h(p)),
            failover_hours=_completion_hours(
                p.fault_free_hours, rate, expected_failover_cost_h(p))))
    return points


def analytic_to_json(points: list[AnalyticPoint], params: SimParams) -> dict:
    return {
        "gpus": [point.gpus for point in points],
        "fault_free_hours": [point.fault_free_hours for point in points],
        "restart_hours": [point.restart_hours for point in points],
        "failover_hours": [point.failover_hours for point in points],
        "improvement_pct": [point.improvement_pct for point in points],
        "params": asdict(params),
    }


def format_analytic_table(points: list[AnalyticPoint]) -> str:
    lines = [f"{'GPUs':>6}  {'fault-free h':>12}  {'faults':>6}  {'restart h':>10}  "
             f"{'failover h':>10}  {'improvement':>11}"]
    for point in points:
        lines.append(
            f"{point.gpus:>6}  {point.fault_free_hours:>12.1f}  "
            f"{point.faults_per_hour * point.fault_free_hours:>6.1f}  "
            f"{point.restart_hours:>10.1f}  "
            f"{point.failover_hours:>10.1f}  {point.improvement_pct:>10.2f}%")
    lines.append("")
    lines.append("expected completion time; same compute at every size; failover: "
                 "degrade_until_checkpoint (eq. 2), restarting where eq. 4 says that is cheaper")
    return "\n".join(lines)


def _error(message: str, code: int) -> int:
    print(f"reccl sim: error: {message}", file=sys.stderr)
    return code


def _write_json(path: str, document: dict) -> None:
    with open(path, "w") as out:
        json.dump(document, out, indent=2)
        out.write("\n")


def run(args: argparse.Namespace) -> int:
    """The ``reccl sim`` command; returns the exit code."""
    try:
        params = SimParams(**{f.name: getattr(args, f.name) for f in fields(SimParams)})
        if args.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {args.runs}")
    except ValueError as e:
        return _error(str(e), 2)

    if args.analytic:
        points = analytic(params)
        print(format_analytic_table(points))
        if args.json:
            _write_json(args.json, analytic_to_json(points, params))
        return 0

    policies = tuple(dict.fromkeys(args.policies))  # keep order, drop repeats
    show_progress = args.progress or sys.stderr.isatty()
    batches = math.ceil(args.runs / BATCH_RUNS)
    bar = ProgressBar(batches * len(policies)) if show_progress else None
    result = simulate(params, runs=args.runs, seed=args.seed, policies=policies, progress=bar)
    print(format_table(result))
    if args.json:
        _write_json(args.json, result.to_json())
    if not args.no_plot:
        try:
            plot_cdf(result, args.plot)
        except ImportError as e:
            return _error(str(e), 1)
        print(f"CDF plot: {args.plot}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "sim", help="GPU hours lost to network faults: restart vs failover",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10_000,
                        help="Monte-Carlo runs per policy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        metavar="POLICY",
                        help=f"policies to simulate, described above: {', '.join(POLICIES)} "
                             "(default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", default=DEFAULT_PLOT,
                        help="PNG for the CDF of extra GPU hours (default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--progress", action="store_true",
                        help="show a progress bar even when stderr is not a terminal")
    parser.add_argument("--analytic", action="store_true",
                        help="closed-form expected completion time for 1k-64k GPUs instead")
    model = parser.add_argument_group(
        "model (defaults: the paper's case study; durations in hours)")
    for f in fields(SimParams):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + " (default: %(default)s)"
        if f.name == "k_by_faults":
            model.add_argument(flag, type=float, nargs="+", default=list(f.default),
                               metavar="K", help=help_text)
        else:
            model.add_argument(flag, type=type(f.default), default=f.default, help=help_text)
    parser.set_defaults(func=run)
    return parser

"""The drill's PNG: throughput over wall time, and loss over training steps.

Top: samples/s of every step (dots) and a moving median against the time since
training began, where a fault shows as a dip. Each applied fault is a dashed
vertical line labelled with what happened; the time a fault held (down to up,
blackhole to heal, a flap) is a shaded span; failover and failback events are
ticks along the panel's bottom edge. A fault-free reference run's median is grey.

Bottom: the loss of every step against the step number (log scale). The
fault-free reference is a grey line and the fault run's losses are markers on
it, so where the runs are bit-identical the markers sit exactly on the line; the
panel states the largest |loss difference| over the steps both runs have. The
faults are marked at the steps they came after.

With --compare, the baseline run (Gloo) is drawn too, in its own colour: its
throughput in the top panel, ending with a cross where it died, and its losses
in the bottom one.

Drawn on matplotlib's Agg canvas directly, so no display is needed.
"""
from __future__ import annotations

import bisect
from typing import Optional

from torch_reccl.drill.runner import RunResult
from torch_reccl.drill.schedule import fault_spans

SMOOTH_STEPS = 9
FAULT_COLOR = "tab:red"
BASELINE_COLOR = "tab:brown"


def moving_median(values, window: int):
    out = []
    half = window // 2
    for i in range(len(values)):
        chunk = sorted(values[max(0, i - half):i + half + 1])
        out.append(chunk[len(chunk) // 2])
    return out


def max_loss_difference(run: RunResult, reference: RunResult):
    """(largest |loss - reference loss| over the steps both runs have, how many steps)."""
    ref = {s["step"]: s["loss"] for s in reference.steps}
    deltas = [abs(s["loss"] - ref[s["step"]]) for s in run.steps if s["step"] in ref]
    return (max(deltas) if deltas else None), len(deltas)


def steps_done_by(run: RunResult, t: float) -> float:
    """Steps finished by time `t` (seconds since training began)."""
    times = [s["t"] for s in run.steps]
    done = bisect.bisect_right(times, t)
    return run.steps[done - 1]["step"] if done else 0


def drill_figure(run: RunResult, title: str, reference: Optional[RunResult] = None,
                 flap_s: Optional[float] = None, baseline: Optional[RunResult] = None):
    """The two panels as a matplotlib Figure (Agg canvas attached)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("the drill plot needs matplotlib (pip install matplotlib)") from error

    figure = Figure(figsize=(10, 7.5))
    FigureCanvasAgg(figure)
    rate_axes, loss_axes = figure.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    spans = fault_spans([(a.fault, a.t) for a in run.applied], run.end_t, flap_s)
    _throughput_panel(rate_axes, run, reference, spans)
    _loss_panel(loss_axes, run, reference, spans)
    if baseline is not None:
        _baseline(rate_axes, loss_axes, baseline)
    rate_axes.set_title(title, fontsize=10)
    figure.tight_layout()
    return figure


def _throughput_panel(axes, run: RunResult, reference: Optional[RunResult], spans) -> None:
    if reference is not None and reference.steps:
        axes.plot([s["t"] for s in reference.steps],
                  moving_median([s["samples_per_s"] for s in reference.steps], SMOOTH_STEPS),
                  color="0.6", lw=1.2, label="fault-free reference (median)")
    if run.steps:
        t = [s["t"] for s in run.steps]
        rate = [s["samples_per_s"] for s in run.steps]
        axes.plot(t, rate, ".", ms=2.5, color="tab:blue", alpha=0.35, label="per step")
        axes.plot(t, moving_median(rate, SMOOTH_STEPS), color="tab:blue", lw=1.6,
                  label=f"median of {SMOOTH_STEPS} steps")
    for start, end, _label in spans:
        axes.axvspan(start, end, color=FAULT_COLOR, alpha=0.10, lw=0)
    for applied in run.applied:
        axes.axvline(applied.t, color=FAULT_COLOR, ls="--", lw=1.0)
        axes.annotate(f"{applied.fault.target} {applied.fault.action}", xy=(applied.t, 1.0),
                      xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                      fontsize=8, color=FAULT_COLOR, rotation=90, va="top")
    marks = {"failover": ("v", "tab:orange"), "failback": ("^", "tab:purple")}
    for kind, (marker, color) in marks.items():
        times = [e["t"] for e in run.events if e["kind"] == kind and e.get("t") is not None]
        if times:
            axes.plot(times, [0] * len(times), marker, color=color, ms=7, clip_on=False,
                      label=f"{kind} ({len(times)})", ls="none")
    axes.set_xlabel("time since training began (s)")
    axes.set_ylabel("throughput (samples/s)")
    axes.set_ylim(bottom=0)
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(alpha=0.3)


def _baseline(rate_axes, loss_axes, baseline: RunResult) -> None:
    """The --compare run: its throughput and losses, and where it died."""
    if baseline.steps:
        t = [s["t"] for s in baseline.steps]
        rate_axes.plot(t, moving_median([s["samples_per_s"] for s in baseline.steps], SMOOTH_STEPS),
                       color=BASELINE_COLOR, lw=1.4, label=f"{baseline.label} (median)")
        loss_axes.plot([s["step"] for s in baseline.steps], [s["loss"] for s in baseline.steps], "x",
                       ms=3, color=BASELINE_COLOR, label=baseline.label)
    if not baseline.finished and baseline.failed_t is not None:
        rate_axes.plot([baseline.failed_t], [0], "X", color=BASELINE_COLOR, ms=10, clip_on=False,
                       label=f"{baseline.label} died ({baseline.failed_t:.0f} s)", ls="none")
    rate_axes.legend(loc="lower right", fontsize=8)
    loss_axes.legend(loc="upper right", fontsize=8)


def _loss_panel(axes, run: RunResult, reference: Optional[RunResult], spans) -> None:
    if reference is not None and reference.steps:
        axes.plot([s["step"] for s in reference.steps], [s["loss"] for s in reference.steps],
                  color="0.55", lw=2.2, label="fault-free reference")
        worst, compared = max_loss_difference(run, reference)
        if worst is None:
            note = "no step in common with the reference"
        else:
            same = " (identical)" if worst == 0 else ""
            note = f"max |\N{GREEK CAPITAL LETTER DELTA}loss| = {worst:.3g} over {compared} steps{same}"
        run_label = "this run (markers)"
    else:
        note = "no fault-free reference (--verify runs one)"
        run_label = "this run"
    if run.steps:
        axes.plot([s["step"] for s in run.steps], [s["loss"] for s in run.steps], "o", ms=3,
                  mfc="none", mew=0.8, color="tab:green", label=run_label)
    for start, end, _label in spans:
        axes.axvspan(steps_done_by(run, start), steps_done_by(run, end), color=FAULT_COLOR,
                     alpha=0.10, lw=0)
    for applied in run.applied:
        axes.axvline(applied.step, color=FAULT_COLOR, ls="--", lw=1.0)
    axes.text(0.5, 0.96, note, transform=axes.transAxes, ha="center", va="top", fontsize=9,
              bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.7"})
    axes.set_yscale("log")
    axes.set_xlabel("training step")
    axes.set_ylabel("training loss (mean over ranks)")
    axes.legend(loc="upper right", fontsize=8)
    axes.grid(alpha=0.3, which="both")


def plot_drill(run: RunResult, path: str, title: str, reference: Optional[RunResult] = None,
               flap_s: Optional[float] = None, baseline: Optional[RunResult] = None) -> str:
    drill_figure(run, title, reference, flap_s, baseline).savefig(path, dpi=110)
    return path

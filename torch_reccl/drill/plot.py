"""The drill's PNG: throughput and loss over time, faults marked.

Top: samples/s of every step (dots) and a moving median; bottom: the loss
(log scale). Each applied fault is a dashed vertical line labelled with what
happened; the time a fault held (down to up, blackhole to heal, a flap) is a
shaded span; failover and failback events are ticks along the top panel's
bottom edge. A fault-free reference run, when there is one, is drawn in grey.
"""
from __future__ import annotations

from typing import Optional

from torch_reccl.drill.runner import RunResult
from torch_reccl.drill.schedule import fault_spans

SMOOTH_STEPS = 9


def moving_median(values, window: int):
    out = []
    half = window // 2
    for i in range(len(values)):
        chunk = sorted(values[max(0, i - half):i + half + 1])
        out.append(chunk[len(chunk) // 2])
    return out


def plot_drill(run: RunResult, path: str, title: str, reference: Optional[RunResult] = None,
               flap_s: Optional[float] = None) -> str:
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the drill plot needs matplotlib (pip install matplotlib)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    if reference is not None and reference.steps:
        t = [s["t"] for s in reference.steps]
        top.plot(t, moving_median([s["samples_per_s"] for s in reference.steps], SMOOTH_STEPS),
                 color="0.6", lw=1.2, label="fault-free reference")
        bottom.plot(t, [s["loss"] for s in reference.steps], color="0.6", lw=1.2,
                    label="fault-free reference")
    if run.steps:
        t = [s["t"] for s in run.steps]
        rate = [s["samples_per_s"] for s in run.steps]
        top.plot(t, rate, ".", ms=2.5, color="tab:blue", alpha=0.35, label="per step")
        top.plot(t, moving_median(rate, SMOOTH_STEPS), color="tab:blue", lw=1.6,
                 label=f"median of {SMOOTH_STEPS} steps")
        bottom.plot(t, [s["loss"] for s in run.steps], color="tab:green", lw=1.4, label="loss")
    bottom.set_yscale("log")
    top.set_ylabel("throughput (samples/s)")
    bottom.set_ylabel("training loss (mean over ranks)")
    bottom.set_xlabel("time since training began (s)")
    top.set_ylim(bottom=0)

    for start, end, label in fault_spans([(a.fault, a.t) for a in run.applied], run.end_t, flap_s):
        for axis in (top, bottom):
            axis.axvspan(start, end, color="tab:red", alpha=0.10, lw=0)
    for applied in run.applied:
        for axis in (top, bottom):
            axis.axvline(applied.t, color="tab:red", ls="--", lw=1.0)
        top.annotate(f"{applied.fault.target} {applied.fault.action}", xy=(applied.t, 1.0),
                     xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                     fontsize=8, color="tab:red", rotation=90, va="top")
    marks = {"failover": ("v", "tab:orange"), "failback": ("^", "tab:purple")}
    for kind, (marker, color) in marks.items():
        times = [e["t"] for e in run.events if e["kind"] == kind and e.get("t") is not None]
        if times:
            top.plot(times, [0] * len(times), marker, color=color, ms=7, clip_on=False,
                     label=f"{kind} ({len(times)})", ls="none")
    top.legend(loc="lower right", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

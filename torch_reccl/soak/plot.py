"""The soak's PNG: throughput, faults and resources against time.

Top: checked iterations per second (rank 0's ticks) and, on the right axis,
the plugin stream's checked MiB/s (its receiver's ticks), with the outages (some
pair of hosts without a path) shaded. Below it each fault as a horizontal bar
in its kind's colour from its start to its end (one row per kind). Then every
process's RSS (the ranks and the stream's two ends), and at the bottom their
open fds, threads and sockets. Drawn on matplotlib's Agg canvas, so no display
is needed.
"""
from __future__ import annotations

from torch_reccl.soak.runner import process_name
from torch_reccl.soak.schedule import KINDS


def plot_soak(report: dict, result, path: str) -> str:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("the soak plot needs matplotlib (pip install matplotlib)") from error

    figure = Figure(figsize=(12, 9))
    FigureCanvasAgg(figure)
    rate, faults, rss, counts = figure.subplots(
        4, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 2, 2]})
    ticks = [t for t in result.ticks if t["rank"] == 0]
    t0 = result.t0 or 0.0
    times, rates = [], []
    for before, after in zip(ticks, ticks[1:]):
        dt = after["t"] - before["t"]
        if dt > 0:
            times.append(after["t"] - t0)
            rates.append((after["iterations"] - before["iterations"]) / dt)
    rate.plot(times, rates, lw=0.8, color="tab:blue")
    rate.set_ylabel("iterations/s", color="tab:blue")
    if result.plugin is not None:
        received = [t for t in result.plugin.ticks if t["role"] == "recv"]
        stream_times, stream_rates = [], []
        for before, after in zip(received, received[1:]):
            dt = after["t"] - before["t"]
            if dt > 0:
                stream_times.append(after["t"] - t0)
                stream_rates.append((after["bytes"] - before["bytes"]) / dt / (1 << 20))
        stream = rate.twinx()
        stream.plot(stream_times, stream_rates, lw=0.8, color="tab:gray")
        stream.set_ylabel("plugin stream MiB/s", color="tab:gray")
    for lo, hi in report["outages"]:
        rate.axvspan(lo, hi, color="tab:red", alpha=0.12, lw=0)
    colors = dict(zip(KINDS, ("tab:red", "tab:purple", "tab:orange", "black", "tab:olive",
                              "tab:cyan", "tab:brown", "tab:pink")))
    for fault in report["schedule"]:
        row = KINDS.index(fault["kind"])
        faults.plot([fault["start_s"], fault["end_s"]], [row, row], lw=5,
                    color=colors[fault["kind"]], solid_capstyle="butt")
    faults.set_yticks(range(len(KINDS)))
    faults.set_yticklabels(KINDS, fontsize=7)
    faults.set_ylim(-0.7, len(KINDS) - 0.3)
    processes = result.processes()
    for k, who in enumerate(processes):
        mine = [s for s in result.samples if s.rank == who]
        rss.plot([s.t for s in mine], [s.rss_kb / 1024 for s in mine], label=process_name(who), lw=0.9,
                 color=f"C{k}")
        counts.plot([s.t for s in mine], [s.fds for s in mine], lw=0.9, color=f"C{k}")
        counts.plot([s.t for s in mine], [s.threads for s in mine], lw=0.9, ls="--", color=f"C{k}")
        counts.plot([s.t for s in mine], [s.sockets for s in mine], lw=0.9, ls=":", color=f"C{k}")
    rss.set_ylabel("RSS (MiB)")
    rss.legend(fontsize=7, ncol=min(10, len(processes)))
    counts.set_ylabel("fds -, threads --,\nsockets :", fontsize=8)
    counts.set_xlabel("seconds since the job started")
    verdict = "OK" if report["ok"] else "FAILED"
    rate.set_title(f"reccl soak: {report['hosts']} hosts x {report['rails']} rails, seed "
                   f"{report['seed']}, {report['faults_applied']} faults: {verdict}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path

"""The report of bench/scale.py: the machine, one Markdown table of reccl against Gloo per
job size, and busbw against the loopback ring ceiling. docs/scale.md explains every row.
"""
from __future__ import annotations

import collections
import os
import platform
import subprocess
from typing import Dict, List

from torch_reccl.bench.scaling.busbw import human_bytes
from torch_reccl.bench.scaling.runner import REPO

BACKENDS = ("reccl", "gloo")


def machine_info() -> dict:
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += " (+ uncommitted changes)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    commit = commit or "? (not a git checkout)"
    import torch

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return {"host": platform.node(), "cores": os.cpu_count(), "memory_GiB": mem, "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit, "kernel": platform.release()}


def _fmt(value, spec: str) -> str:
    if value is None:
        return "—"
    return format(value, spec)


ROWS = [  # (label, getter, format, ratio?)
    ("groups in the job / per rank", lambda r: f"{r['groups_total']} / {r['groups_per_rank']}", None, False),
    ("init_process_group (s)", lambda r: r.get("init_s"), ".2f", True),
    ("group creation (s)", lambda r: r.get("create_s"), ".2f", True),
    ("group first use (s)", lambda r: r.get("first_use_s"), ".2f", True),
    ("group set-up = creation + first use (s)", lambda r: r.get("setup_s"), ".2f", True),
    ("store requests: creation / first use",
     lambda r: f"{r['store'].get('create', {}).get('requests', 0)} / "
               f"{r['store'].get('first_use', {}).get('requests', 0)}" if "create_s" in r else None, None, False),
    ("store keys left after set-up", lambda r: r.get("store_keys_after_first_use"), "d", False),
    ("idle: store requests (reads) in the window",
     lambda r: f"{r['idle']['store_requests']} ({r['idle']['store_reads']})" if "idle" in r else None, None, False),
    ("idle: store requests/s", lambda r: r["idle"]["store_requests_per_s"] if "idle" in r else None, ".1f", True),
    ("idle: CPU burned, all ranks (s)", lambda r: r["idle"]["cpu_s"] if "idle" in r else None, ".2f", True),
    ("idle: wake-ups/s per rank (max)",
     lambda r: max(r["idle"]["wakeups_per_s_per_rank"]) if "idle" in r else None, ".0f", True),
    ("threads per rank (max)", lambda r: r.get("threads_max"), "d", True),
    ("  of which not reccl-path-*/reccl-ib-*", lambda r: r.get("threads_non_transport_max"), "d", True),
    ("open fds per rank (max)", lambda r: r.get("fds_max"), "d", True),
    ("store connections open", lambda r: r.get("store_connections_open"), "d", True),
    ("4-byte all_reduce latency (ms)",
     lambda r: r["latency_4b_s"] * 1e3 if "latency_4b_s" in r else None, ".3f", True),
    ("busbw", None, ".3f", True),  # expanded: one row per measured (op, size), "<size> <op> busbw (GB/s)"
    ("wrong results", lambda r: len(r.get("errors", [])) if "errors" in r else None, "d", False),
]


def _busbw_getter(op: str, nbytes: int, key: str = "busbw_GBps"):
    def get(run: dict):
        return next((b.get(key) for b in run.get("busbw", []) if (b["op"], b["size_bytes"]) == (op, nbytes)),
                    None)
    return get


def format_table(runs: List[dict], machine: dict, idle_s: float) -> str:
    lines = [f"### {machine['host']}: {machine['cores']} cores, {machine['memory_GiB']} GiB, "
             f"torch {machine['torch']}, commit {machine['commit']}", "",
             f"Loopback (127.0.0.1), one process per rank, {idle_s:g} s idle window. "
             f"reccl/gloo > 1 means reccl costs more (or, for busbw, is faster).", "",
             "| N | what | reccl | gloo | reccl/gloo |", "|---:|---|---:|---:|---:|"]
    builds = sorted({(r["extension"].get("sha256"), r["extension"].get("mtime")) for r in runs if "extension" in r},
                    key=lambda b: str(b[1]))
    if builds:
        lines[2] += " reccl extension build(s): " + ", ".join(f"{sha} ({mtime})" for sha, mtime in builds) + "."
        if len(builds) > 1:
            lines[2] += " **The extension was rebuilt between jobs: rows may compare different builds.**"
    loads = [r["load_before"] for r in runs if r.get("load_before")]
    if loads:
        load = [x["loadavg_1m"] for x in loads]
        runnable = [x["runnable"] for x in loads]
        lines[2] += (f" Before each job (none of ours running): 1-min load average {min(load):.1f}–{max(load):.1f}, "
                     f"other runnable threads {min(runnable):.1f}–{max(runnable):.1f} "
                     f"({machine['cores']} cores: more means other work competed).")
    tables = sorted({r["fd_table_at_start"] for r in runs if "fd_table_at_start" in r})
    if tables:
        lines[2] += (f" Ranks started with a {'/'.join(map(str, tables))}-entry fd table "
                     "(64: growing it is a set-up cost; docs/scale.md, 'Set-up').")
    by_n: Dict[int, Dict[str, dict]] = collections.defaultdict(dict)
    for run in runs:
        by_n[run["ranks"]][run["backend"]] = run
    measured = list(dict.fromkeys((b["op"], b["size_bytes"]) for r in runs
                                  for b in r.get("busbw_plan", r.get("busbw", []))))
    rows = []
    for label, get, spec, ratio in ROWS:
        if label != "busbw":
            rows.append((label, get, spec, ratio))
            continue
        for op, nbytes in measured:
            rows.append((f"{human_bytes(nbytes)} {op} busbw (GB/s)", _busbw_getter(op, nbytes), spec, ratio))
            rows.append((f"{human_bytes(nbytes)} {op}: cores kept busy", _busbw_getter(op, nbytes, "cores_busy"),
                         ".1f", False))
    for n in sorted(by_n):
        pair = by_n[n]
        status = {b: pair[b]["status"] for b in pair}
        if any(s != "ok" for s in status.values()):
            lines.append(f"| {n} | status | {status.get('reccl', '—')} | {status.get('gloo', '—')} | |")
        for label, get, spec, ratio in rows:
            cells, values = [], []
            for b in BACKENDS:
                run = pair.get(b)
                value = None
                if run is not None:
                    try:
                        value = get(run)
                    except (KeyError, TypeError, ValueError):
                        value = None
                values.append(value)
                cells.append(_fmt(value, spec) if spec else (value if value is not None else "—"))
            r = "—"
            if ratio and all(isinstance(v, (int, float)) for v in values):
                a, b = values
                r = f"{a / b:.2f}" if b else ("∞" if a else "=")
            lines.append(f"| {n} | {label} | {cells[0]} | {cells[1]} | {r} |")
    return "\n".join(lines)


def format_ceilings(runs: List[dict], ceilings: Dict[int, dict]) -> str:
    """busbw against the loopback ring ceiling of the same N: what fraction of what
    plain TCP moves on this machine each library reaches."""
    lines = ["Loopback ring ceiling (bench/wire_ceiling.py: plain TCP sockets, each rank sends to the "
             "next, 4 sockets, every rank at once; the slowest rank's GB/s). A ring all_reduce sends "
             "and receives its busbw per rank and reduces too, so over TCP its busbw stays below this.", "",
             "| N | ceiling GB/s per rank | op | reccl busbw / ceiling | gloo busbw / ceiling |",
             "|---:|---:|---|---:|---:|"]
    for n in sorted(ceilings):
        ceiling = ceilings[n]["min_GBps"]
        pair = {r["backend"]: r for r in runs if r["ranks"] == n}
        for op, nbytes in dict.fromkeys((b["op"], b["size_bytes"]) for r in pair.values()
                                        for b in r.get("busbw", [])):
            cells = []
            for backend in BACKENDS:
                value = _busbw_getter(op, nbytes)(pair[backend]) if backend in pair else None
                cells.append(_fmt(value / ceiling if value is not None else None, ".2f"))
            lines.append(f"| {n} | {ceiling:.3f} | {human_bytes(nbytes)} {op} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)

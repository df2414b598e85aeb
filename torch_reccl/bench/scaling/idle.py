"""The idle cost in bench/scale.py's jobs: what an idle job costs once its groups are set up.

    settle   --settle-s of quiet before the window
    idle     --idle-s window: store requests (the proxy), CPU seconds of all ranks
             (/proc/<pid>/stat utime+stime); around it, context switches of every thread
             (/proc/<pid>/task/*/status, each a wake-up or a preemption); then threads
             per rank (/proc/<pid>/task, broken down by name) and open fds (/proc/<pid>/fd)
"""
from __future__ import annotations

import collections
import os
import re
import time
from typing import Dict, Tuple

from torch_reccl.bench import procstat

TRANSPORT_THREAD_PREFIXES = ("reccl-path-", "reccl-ib-")

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads, living and exited), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_threads(pid: int) -> Dict[str, str]:
    """tid -> thread name (comm)."""
    return {tid: t.name for tid, t in procstat.threads(pid).items()}


def proc_ctxt_switches(pid: int) -> Dict[str, int]:
    """tid -> voluntary + involuntary context switches (each is a wake-up or preemption)."""
    return {tid: t.switches for tid, t in procstat.threads(pid).items()}


def proc_fds(pid: int) -> Tuple[int, int]:
    """(open fds, of which sockets)."""
    return procstat.fds(pid)


def thread_breakdown(names: Dict[str, str]) -> Dict[str, int]:
    """Thread count per name pattern (digit runs replaced by '#')."""
    return dict(collections.Counter(re.sub(r"\d+", "#", n) for n in names.values()).most_common())


def is_transport_thread(name: str) -> bool:
    return name.startswith(TRANSPORT_THREAD_PREFIXES)


def record(job, settle_s: float, idle_s: float, result: dict) -> None:
    """Launcher side: the settle and idle phases; result["idle"] and the thread, fd and
    store counts after the window."""
    job.enter("settle")
    time.sleep(settle_s)

    size, proxy = job.size, job.proxy
    # Context switches need a walk over every thread in /proc, slow with thousands of threads
    # on a busy machine: the walks bracket the window from outside (the ranks idle throughout)
    # and the rate uses the time between the walks' midpoints. The window itself has only
    # cheap reads at its ends: CPU times, and the proxy's phase switch.
    a0 = time.monotonic()
    ctxt0 = job.per_rank(proc_ctxt_switches)
    a1 = time.monotonic()
    cpu0 = job.per_rank(proc_cpu_s)
    w0 = time.monotonic()
    job.enter("idle")
    time.sleep(max(0.0, w0 + idle_s - time.monotonic()))
    cpu1 = job.per_rank(proc_cpu_s)
    window = time.monotonic() - w0
    proxy.set_phase("after_idle")
    idle = proxy.counts("idle")
    b0 = time.monotonic()
    ctxt1 = job.per_rank(proc_ctxt_switches)
    b1 = time.monotonic()
    ctxt_span = (b0 + b1) / 2 - (a0 + a1) / 2
    names = job.per_rank(proc_threads)
    fds = job.per_rank(proc_fds)
    wakeups = [sum(c1[t] - c0[t] for t in c1 if t in c0) / ctxt_span for c0, c1 in zip(ctxt0, ctxt1)]
    threads = [len(n) for n in names]
    non_transport = [sum(not is_transport_thread(v) for v in n.values()) for n in names]
    worst = max(range(size), key=lambda r: threads[r])
    busiest = max(range(size), key=lambda r: wakeups[r])
    by_name: Dict[str, float] = collections.Counter()
    for tid, n1 in ctxt1[busiest].items():
        if tid in ctxt0[busiest]:
            name = re.sub(r"\d+", "#", names[busiest].get(tid, "?"))
            by_name[name] += (n1 - ctxt0[busiest][tid]) / ctxt_span
    result["idle"] = {
        "window_s": window,
        "store_requests": idle["requests"], "store_reads": idle["reads"], "store_bytes": idle["bytes"],
        "store_unparsed_reads": idle["unparsed_reads"], "store_connections_opened": idle["connections"],
        "store_requests_per_s": idle["requests"] / window, "store_reads_per_s": idle["reads"] / window,
        "store_by_type": idle["by_type"], "store_by_key": idle["by_key"], "store_samples": idle["samples"],
        "cpu_s": sum(cpu1) - sum(cpu0), "cpu_s_per_rank": [b - a for a, b in zip(cpu0, cpu1)],
        "wakeups_per_s_per_rank": wakeups, "wakeups_span_s": ctxt_span,
        "wakeups_per_s_by_thread_name": {"rank": busiest, "names": dict(by_name.most_common())},
    }
    result["threads_per_rank"] = threads
    result["threads_max"] = max(threads)
    result["threads_non_transport_per_rank"] = non_transport
    result["threads_non_transport_max"] = max(non_transport)
    result["thread_names_worst_rank"] = {"rank": worst, "names": thread_breakdown(names[worst])}
    result["thread_names_per_rank"] = [thread_breakdown(n) for n in names]
    result["fds_per_rank"] = [f for f, _ in fds]
    result["sockets_per_rank"] = [s for _, s in fds]
    result["fds_max"] = max(f for f, _ in fds)
    result["sockets_max"] = max(s for _, s in fds)
    result["store_connections_open"] = proxy.open_connections
    result["store_keys_after_idle"] = job.store.num_keys()

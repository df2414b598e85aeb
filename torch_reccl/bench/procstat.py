"""What /proc says about a process: its threads (names, context switches, CPU time) and open fds.

One reader for the benchmarks and tests that count threads and wake-ups
(bench/scale.py, bench/idle_wakeups.py, tests/transport/test_transport_contract.py).
Threads come and go while /proc is read; those gone meanwhile are left out.
It imports nothing of torch_reccl: bench/ loads it by path into processes that must
not import the package (bench/reccl_bench_runs.py, load_standalone).
"""
from __future__ import annotations

import os
from typing import Dict, List, NamedTuple, Tuple, Union

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


class ThreadStat(NamedTuple):
    name: str          # the thread's name (comm, at most 15 characters)
    voluntary: int     # context switches where the thread blocked: one per sleep
    involuntary: int   # preemptions
    user_seconds: float    # CPU time so far in user mode
    system_seconds: float  # ... and in the kernel (system calls: socket I/O, process_vm_readv)

    @property
    def switches(self) -> int:
        return self.voluntary + self.involuntary

    @property
    def cpu_seconds(self) -> float:
        """User + system time so far (a thread that spins shows here, not in switches)."""
        return self.user_seconds + self.system_seconds


def threads(pid: Union[int, str] = "self") -> Dict[str, ThreadStat]:
    """tid -> ThreadStat for every thread of `pid` (default: this process)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                # After the name's closing parenthesis (a name may hold one):
                # field 3 (state) first, so utime (14) and stime (15) are 11 and 12.
                times = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        out[tid] = ThreadStat(fields["Name"].strip(), int(fields["voluntary_ctxt_switches"]),
                              int(fields["nonvoluntary_ctxt_switches"]),
                              int(times[11]) / _TICKS_PER_SECOND, int(times[12]) / _TICKS_PER_SECOND)
    return out


def cpu_ms_by_name(before: Dict[str, ThreadStat], after: Dict[str, ThreadStat],
                   ops: int = 1) -> Dict[str, List[float]]:
    """Thread name -> [user ms, system ms] spent between two `threads()` snapshots,
    divided by `ops`; over the threads alive at the second one."""
    acc: Dict[str, List[float]] = {}
    for tid, now in after.items():
        then = before.get(tid)
        entry = acc.setdefault(now.name, [0.0, 0.0])
        entry[0] += (now.user_seconds - (then.user_seconds if then else 0.0)) / ops * 1e3
        entry[1] += (now.system_seconds - (then.system_seconds if then else 0.0)) / ops * 1e3
    return acc


def fd_table_entries(pid: Union[int, str] = "self") -> int:
    """The size of `pid`'s fd table (FDSize; default: this process). A process that
    starts at the kernel's initial 64 grows it by doubling as fds are opened, and in
    a threaded process each doubling waits for an RCU grace period (docs/scale.md,
    "Set-up")."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("FDSize:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no FDSize line")


def fds(pid: Union[int, str] = "self") -> Tuple[int, int]:
    """(open fds, of which sockets) of `pid` (default: this process)."""
    count = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        count += 1
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return count, sockets

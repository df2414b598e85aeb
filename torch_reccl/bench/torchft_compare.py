"""Host faults and NIC faults under torchft, Gloo against reccl: one training job of
2 replica groups (one rank each, one per host) under torchft's Manager, the same
fault schedule for each backend, and what torchft had to do about it.

Faults (``FAULTS``), applied to replica 1 once both replicas have trained
``fault_step`` steps together:

- ``nic``: replica 1's host loses its NIC 0 for good. In the emulated fabric
  (``mode="fabric"``, root) the NIC's veth loses carrier: a kernel event that Gloo
  (pinned to NIC 0 with ``GLOO_SOCKET_IFNAME``, as a job on one rail) and reccl
  (over NICs 0 and 1) both meet. Without root (``mode="inject"``) the ranks run on
  loopback NICs and the fault is ``torch_reccl.inject_fault`` inside replica 1,
  which acts inside reccl only: Gloo's row then says that no fault reached it.
- ``kill``: replica 1's process is SIGKILLed in mid-step (after its backward pass
  and the step's quorum, before its gradients' all-reduce, so replica 0 waits in
  that all-reduce) and
  started again at once, as a torchft launcher does; it rejoins and heals from
  replica 0. A replica that exits by itself is started again too.

Per run (:class:`Outcome`): quorum changes after the fault, the steps each replica
did not contribute to (after the fault, up to the last step), the time from the
fault until every replica trains again (both commit a step of a quorum of 2),
whether the final parameters and optimizer state are the same on both replicas
(SHA-256), and the first error each replica's Manager reported. Every wait is
bounded: replicas start within ``start_timeout_s``, the run ends by
``run_timeout_s`` (a run that does not finish says so), every process is killed
and the fabric torn down at the end.

bench/torchft_fault.py prints the table; tests/pg/test_torchft.py runs reccl's
rows. The replicas and agents: torch_reccl.bench.torchft_replica.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from torch_reccl.cli.launch import MARKER, free_port, unique_fabric_name

BACKENDS = ("gloo", "reccl")
FAULTS = ("nic", "kill")
MODES = ("fabric", "inject")
REPLICAS = 2
VICTIM = 1                   # the replica the fault hits
FABRIC_STORE_PORT = 29500    # each host its own network namespace: every port is free
FABRIC_LIGHTHOUSE_PORT = 29510
LOG_LINES = 40


@dataclasses.dataclass
class Outcome:
    backend: str
    fault: str
    mode: str
    finished: bool                       # replica 0 reached the last step
    steps: int                           # the last step the job reached
    fault_step: Optional[int]            # the job's step when the fault was applied
    fault_applied: bool
    quorum_changes: Optional[int]        # quorum ids after the fault's
    missed: Dict[int, int]               # replica -> the job's steps after the fault it was not in
    failed: Dict[int, int]               # replica -> its step attempts from the fault on that did not commit
    recovery_s: Optional[float]          # fault -> both replicas commit a step of a quorum of 2
    stall_s: Optional[float]             # replica 0's longest time without committing a step, from the fault on
    params_equal: Optional[bool]
    failovers: int                       # reccl failover events the replicas saw (their last processes)
    restarts: int                        # replicas that exited by themselves, started again
    crashes: List[str]                   # why each of those exited (its last line)
    errors: Dict[int, str]               # replica -> the first error its Manager reported
    wall_s: float
    note: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Process:
    """One process of the run and a reader of its output."""

    def __init__(self, name: str, proc: subprocess.Popen, messages: "queue.Queue", key):
        self.name, self.proc, self.key = name, proc, key
        self.lines: List[str] = []
        self._thread = threading.Thread(target=self._read, args=(messages,), daemon=True,
                                        name=f"torchft-{name}")
        self._thread.start()

    def _read(self, messages: "queue.Queue") -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            at = line.find(MARKER)  # anywhere: torchft's Rust logs share the stream, unbuffered
            if at >= 0:
                try:
                    messages.put((self.key, json.loads(line[at + len(MARKER):])))
                    continue
                except ValueError:
                    pass
            self.lines.append(line)
            del self.lines[:-LOG_LINES]
        self.proc.stdout.close()

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass
        for how in ("wait", "terminate", "kill"):
            if self.proc.poll() is not None:
                break
            if how == "terminate":
                self.proc.terminate()
            elif how == "kill":
                self.proc.kill()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        self._thread.join(timeout=2.0)

    def tail(self, lines: int = 15) -> str:
        status = "running" if self.proc.poll() is None else f"exit code {self.proc.poll()}"
        return f"--- {self.name} ({status}):\n" + "\n".join("    " + line for line in self.lines[-lines:])


class _Hosts:
    """Where the processes run: hosts of an emulated fabric, or this machine."""

    def __init__(self, mode: str, name: Optional[str]):
        self.mode = mode
        self.fabric = None
        if mode == "fabric":
            from torch_reccl.fabric import Fabric

            self.fabric = Fabric(hosts=REPLICAS, rails=2, name=name or unique_fabric_name("tf")).up()
            self.store_ports = [FABRIC_STORE_PORT] * REPLICAS
            self.lighthouse_port = FABRIC_LIGHTHOUSE_PORT
        else:
            self.store_ports = [free_port() for _ in range(REPLICAS)]
            self.lighthouse_port = free_port()

    def address(self, host: int) -> str:
        return self.fabric.mgmt_ip(host) if self.fabric else "127.0.0.1"

    def env(self) -> Dict[str, str]:
        nics = ("eth0", "eth1") if self.fabric else ("127.0.0.1", "127.0.0.2")
        return {"RECCL_NICS": ",".join(nics),
                # Gloo on NIC 0, as a job pinned to one rail
                "GLOO_SOCKET_IFNAME": "eth0" if self.fabric else "lo"}

    def popen(self, host: int, argv: List[str], env: Dict[str, str]) -> subprocess.Popen:
        kwargs = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      stdin=subprocess.PIPE, text=True, bufsize=1)
        if self.fabric:
            return self.fabric.popen(host, argv, **kwargs)
        return subprocess.Popen(argv, **kwargs)

    def nic_down(self, replica: "_Process") -> None:
        if self.fabric:
            self.fabric.nic_down(VICTIM, 0)
        else:
            replica.send({"cmd": "inject", "nic": "lo:127.0.0.1", "kind": "down"})

    def close(self) -> None:
        if self.fabric:
            self.fabric.down()


def run(backend: str, fault: str, mode: str = "inject", steps: int = 300, fault_step: int = 40,
        step_s: float = 0.05, timeout_s: float = 30.0, start_timeout_s: float = 120.0,
        run_timeout_s: float = 240.0, end_grace_s: float = 10.0, max_restarts: int = 30,
        name: Optional[str] = None,
        env: Optional[Dict[str, str]] = None, log=None) -> Outcome:
    """One run of the job under ``fault`` on ``backend``; see the module's docstring.
    ``timeout_s`` is the Manager's and the process group's timeout; ``env`` is added
    to every replica's environment (``RECCL_*`` settings)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not valid; valid: {', '.join(BACKENDS)}")
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r} is not valid; valid: {', '.join(FAULTS)}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not valid; valid: {', '.join(MODES)}")
    if not 0 < fault_step < steps:
        raise ValueError(f"fault_step={fault_step} is not valid: it must be in 1..steps-1 (steps={steps})")
    log = log or (lambda line: None)
    started = time.monotonic()
    messages: "queue.Queue[Tuple[Tuple[str, int, int], dict]]" = queue.Queue()
    hosts = _Hosts(mode, name)
    base = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **hosts.env(), **(env or {})}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, base.get("PYTHONPATH", "")) if p)
    module = [sys.executable, "-m", "torch_reccl.bench.torchft_replica"]
    processes: List[_Process] = []
    replicas: Dict[int, _Process] = {}
    incarnation = {r: 0 for r in range(REPLICAS)}
    lighthouse = f"http://{hosts.address(0)}:{hosts.lighthouse_port}"

    def start_replica(r: int) -> None:
        argv = module + ["replica", "--backend", backend, "--replica", str(r), "--host", hosts.address(r),
                         "--store-port", str(hosts.store_ports[r]), "--lighthouse", lighthouse,
                         "--steps", str(steps), "--step-s", str(step_s), "--timeout", str(timeout_s)]
        # on loopback each replica is a host of its own, as in the fabric
        env = base if hosts.fabric else {**base, "RECCL_HOST_ID": f"torchft-host-{r}"}
        p = _Process(f"replica {r}" + (f" (restart {incarnation[r]})" if incarnation[r] else ""),
                     hosts.popen(r, argv, env), messages, ("replica", r, incarnation[r]))
        processes.append(p)
        replicas[r] = p

    records: List[Tuple[int, int, dict]] = []   # (replica, incarnation, step record)
    done: Dict[int, dict] = {}
    errors: Dict[int, str] = {}
    triggered = False
    fault_time: Optional[float] = None
    fault_at: Optional[int] = None
    quorum_at_fault: Optional[int] = None
    restarts = 0                      # by the launcher's policy, besides the fault's own
    crashes: List[Tuple[int, Optional[int], str]] = []
    note = ""
    try:
        for h in range(REPLICAS):
            argv = module + ["agent", "--host", hosts.address(h), "--store-port", str(hosts.store_ports[h])]
            if h == 0:
                argv += ["--lighthouse-port", str(hosts.lighthouse_port)]
            processes.append(_Process(f"agent {h}", hosts.popen(h, argv, base), messages, ("agent", h, 0)))
        ready = set()
        deadline = time.monotonic() + start_timeout_s
        while len(ready) < REPLICAS:
            item = _next(messages, deadline, processes)
            if item[1].get("kind") == "ready":
                ready.add(item[0][1])
        for r in range(REPLICAS):
            start_replica(r)
        deadline = time.monotonic() + run_timeout_s
        together = set()  # replicas that committed a step of a quorum of 2
        end_by: Optional[float] = None  # once a replica is done, the others' bound
        while len(done) < REPLICAS:
            if end_by is not None and time.monotonic() > end_by:
                note = (f"replica(s) {sorted(set(range(REPLICAS)) - set(done))} did not reach the last step "
                        f"within {end_grace_s:g} s of replica 0")
                log(f"[{backend}] {note}")
                break
            for r, p in list(replicas.items()):
                if r in done or p.proc.poll() is None:
                    continue
                p._thread.join(timeout=2.0)  # its last messages first
                if not messages.empty():
                    break
                # the launcher's policy: a replica that exits before the end is started again
                if restarts >= max_restarts:
                    raise TimeoutError(f"{p.name} exited with code {p.proc.poll()} after {restarts} restarts\n"
                                       + p.tail())
                log(f"[{backend}] {p.name} exited with code {p.proc.poll()}; starting it again")
                crashes.append((r, p.proc.poll(), p.lines[-1] if p.lines else ""))
                incarnation[r] += 1
                restarts += 1
                start_replica(r)
            item = _next(messages, min(deadline, end_by or deadline), processes,
                         allow_exit=lambda p: p.key[0] == "replica")
            if item is None:
                continue
            (role, r, inc), message = item
            if role != "replica" or inc != incarnation[r]:
                continue
            kind = message.get("kind")
            if kind == "step":
                records.append((r, inc, message))
                if message.get("error") and r not in errors:
                    errors[r] = message["error"]
                if message["committed"] and message["participants"] == REPLICAS:
                    together.add(r)
                if (not triggered and together == set(range(REPLICAS))
                        and message["step"] >= fault_step and r == VICTIM):
                    triggered = True
                    fault_at = max(rec["step"] for _, _, rec in records)
                    quorum_at_fault = max(rec["quorum"] for _, _, rec in records)
                    if fault == "nic" and mode == "inject" and backend == "gloo":
                        note = "no fault reached Gloo: inject_fault acts inside reccl only"
                        log(f"[{backend}] step {fault_at}: fault not applied ({note})")
                    elif fault == "nic":
                        fault_time = time.time()
                        hosts.nic_down(replicas[VICTIM])
                        log(f"[{backend}] step {fault_at}: replica {VICTIM}'s NIC 0 down")
                    else:
                        replicas[VICTIM].send({"cmd": "die"})
            elif kind == "dying":  # the kill: the launcher starts the replica again at once
                fault_time = message["t"]
                try:
                    replicas[r].proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    replicas[r].proc.kill()
                    replicas[r].proc.wait(timeout=10)
                incarnation[r] += 1
                log(f"[{backend}] step {message['step']}: replica {r} killed in mid-step; starting it again")
                start_replica(r)
            elif kind == "done":
                done[r] = message
                if r == 0:  # the job's end: the others finish that step within the grace, or not at all
                    end_by = time.monotonic() + end_grace_s
        finished = 0 in done
    except TimeoutError as error:
        finished = False
        note = (note + "; " if note else "") + str(error)
        log(f"[{backend}] {error}")
    finally:
        ended = time.time()
        for p in processes:
            p.stop()
        hosts.close()
    fault_applied = fault_time is not None
    # The job's steps are the survivor's (replica 0): torchft numbers a step when it commits.
    last = done[0]["step"] if 0 in done else max((rec["step"] + 1 for r, _, rec in records if r == 0), default=0)
    committed = {r: {rec["step"]: rec for rr, _, rec in records
                     if rr == r and rec["committed"] and rec["participating"]} for r in range(REPLICAS)}
    missed: Dict[int, int] = {}
    failed: Dict[int, int] = {}
    recovery_s = None
    stall_s = None
    quorum_changes = None
    if fault_at is not None:
        after = range(fault_at + 1, last)
        for r in range(REPLICAS):
            # replica r is in the job's step s when it committed s in the survivor's quorum
            missed[r] = sum(1 for s in after if s not in committed[r]
                            or (r != 0 and committed[0].get(s, {}).get("participants", 0) < REPLICAS))
            failed[r] = sum(1 for rr, _, rec in records if rr == r and rec["step"] > fault_at - 1
                            and not rec["committed"])
        quorum_changes = max(rec["quorum"] for _, _, rec in records) - quorum_at_fault
        if fault_applied:
            both = [max(committed[0][s]["t"], committed[1][s]["t"]) for s in after
                    if s in committed[0] and s in committed[1] and committed[0][s]["participants"] == REPLICAS]
            recovery_s = (both[0] - fault_time) if both else None
            times = [fault_time] + [rec["t"] for s, rec in sorted(committed[0].items()) if rec["t"] > fault_time]
            if 0 not in done:
                times.append(ended)
            stall_s = max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None
    params_equal = None
    if len(done) == REPLICAS and len({d["step"] for d in done.values()}) == 1:
        params_equal = len({d["digest"] for d in done.values()}) == 1
    return Outcome(backend=backend, fault=fault, mode=mode, finished=finished, steps=last,
                   fault_step=fault_at, fault_applied=fault_applied, quorum_changes=quorum_changes,
                   missed=missed, failed=failed, recovery_s=recovery_s, stall_s=stall_s,
                   params_equal=params_equal, restarts=restarts,
                   failovers=sum(d.get("failovers", 0) for d in done.values()),
                   crashes=[f"replica {r} (exit code {code}): {line}" for r, code, line in crashes],
                   errors=errors, wall_s=time.monotonic() - started, note=note)


def _next(messages: "queue.Queue", deadline: float, processes: List[_Process], allow_exit=None):
    """The next (key, message). TimeoutError (with the processes' last lines) when
    the deadline passes or a process that must not exit has exited. With
    ``allow_exit`` (which processes may exit), None after a quiet half second."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the run did not finish in time\n" + "\n".join(p.tail() for p in processes))
        try:
            return messages.get(timeout=min(left, 0.5))
        except queue.Empty:
            pass
        for p in processes:
            if p.proc.poll() is not None and not (allow_exit and allow_exit(p)):
                p._thread.join(timeout=2.0)
                if messages.empty():
                    raise TimeoutError(f"{p.name} exited with code {p.proc.poll()}\n"
                                       + "\n".join(q.tail() for q in processes))
        if allow_exit is not None:
            return None


def table(outcomes: List[Outcome]) -> str:
    """The comparison as a Markdown table."""
    rows = ["| fault on replica 1 | backend | quorum changes | job steps without replica 0 / 1 "
            "| failed steps of replica 0 / 1 | replica 0's longest stall | all replicas train again after "
            "| crashes restarted | final parameters equal |",
            "|---|---|---|---|---|---|---|---|---|"]
    names = {"nic": "NIC 0 lost for good", "kill": "process killed, restarted"}
    for o in outcomes:
        def pair(d: Dict[int, int]) -> str:
            return " / ".join(str(d.get(r, "-")) for r in range(REPLICAS))

        if not o.fault_applied:
            recovery, stall = "no fault applied", "—"
        else:
            recovery = ("not within the run" if o.recovery_s is None else f"{o.recovery_s:.1f} s")
            stall = "—" if o.stall_s is None else f"{o.stall_s:.1f} s"
        equal = {True: "yes", False: "NO", None: "—"}[o.params_equal]
        if not o.finished:
            equal += f" (replica 0 did not finish: {o.steps} steps in {o.wall_s:.0f} s)"
        rows.append(f"| {names[o.fault]} | {o.backend} | {o.quorum_changes} | {pair(o.missed)} | {pair(o.failed)} "
                    f"| {stall} | {recovery} | {o.restarts} | {equal} |")
    return "\n".join(rows)

"""The driver of ``reccl soak``: start the ranks in the emulated fabric and, once
they start, the plugin stream between hosts 0 and 1; apply and heal the
schedule's faults on time, sample every process's resources, watch for wrong
values, errors, stalls and crashes, and judge the run.

Every wait is bounded: the ranks must set up within ``start_timeout_s`` and
run each op of the opening sweep within it too (the plugin stream must connect
within it), progress of the ranks and of the stream may each stop for at most
``stall_s`` plus the time some pair of hosts had no path (an outage of the
schedule), and the run must end within its duration plus ``finish_timeout_s``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Dict, List, Optional, Set, Tuple, Union

from torch_reccl.cli.launch import FabricPlacement, Job
from torch_reccl.soak.plugin_stream import ROLES
from torch_reccl.soak.schedule import FLAP_PERIOD_S, SoakFault, outages, overlap_s

TICK_S = 0.05
SAMPLE_EVERY_S = 10.0
# in the fault-free warm-up and after the last fault healed: the floors the run
# starts and ends with
QUIET_SAMPLE_EVERY_S = 2.0
FINISH_TIMEOUT_S = 120.0
PROBE_EXIT_TIMEOUT_S = 5.0  # the scheduling probe writes its histogram on SIGTERM
# glibc returns big blocks at free() only under a fixed mmap threshold; with its
# default (a threshold that grows) freed tensors stay in the heap and RSS ratchets
# up with the largest message seen, which hides a real leak behind noise
#
# One data socket per path: a path grows its data sockets on demand, so with
# several a backup that first carries a large message after a failover keeps more
# sockets than it had in the warm-up (bounded, not a leak); with one, every socket
# beyond the warm-up's count is one that was not returned.
RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "RECCL_NSOCKS": "1"}
INTERRUPTION_KINDS = ("failover", "failback")
# the engine's worker pool: grows with the ops in flight, retires idle workers
POOL_THREAD = "reccl-worker"
# the plugin stream's processes, by role, as samples, logs and verdicts name them
PLUGIN_LABELS = tuple(f"plugin-{role}" for role in ROLES)
# where its ends run: the receiver listens in host 1, the sender connects from host 0
STREAM_HOSTS = {"send": 0, "recv": 1}
# past the ends' own bound on connecting (--start-timeout): time to report why
STREAM_START_SLACK_S = 10.0


@dataclasses.dataclass
class SoakSettings:
    duration_s: float
    seed: int = 0
    max_bytes: int = 64 << 20
    stall_s: float = 30.0
    start_timeout_s: float = 180.0
    warmup_s: float = 30.0
    settle_s: float = 20.0
    rss_growth: float = 0.05
    log_dir: Optional[str] = None  # every process's whole output, rank<R>.log, plugin-<role>.log
    plugin: bool = True  # the plugin stream beside the ranks


@dataclasses.dataclass
class Sample:
    t: float
    rank: Union[int, str]  # a rank, or one of PLUGIN_LABELS
    rss_kb: int
    fds: int
    threads: int
    sockets: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StreamResult:
    """What the plugin stream's processes reported (torch_reccl/soak/plugin_stream.py)."""
    started: Dict[str, float] = dataclasses.field(default_factory=dict)  # by role: connected at
    ticks: List[dict] = dataclasses.field(default_factory=list)
    wrong: List[dict] = dataclasses.field(default_factory=list)
    errors: List[dict] = dataclasses.field(default_factory=list)  # an ncclResult other than success, or a bound
    done: Dict[str, dict] = dataclasses.field(default_factory=dict)  # by role
    received: int = 0  # intact messages, as the receiver last reported

    def absorb(self, role: str, message: dict) -> bool:
        """Files one message of the ``role`` end; True when it shows progress: the
        receiver got messages since its last report, or an end finished."""
        kind = message.get("kind")
        fields = {k: v for k, v in message.items() if k != "kind"}
        fields["role"] = role
        if kind == "start":
            self.started[role] = float(message["t"])
            return True
        if kind == "tick":
            self.ticks.append(fields)
            if role == "recv" and message["messages"] > self.received:
                self.received = message["messages"]
                return True
        elif kind == "wrong":
            self.wrong.append(fields)
        elif kind == "error":
            self.errors.append(fields)
        elif kind == "done":
            self.done[role] = fields
            return True
        return False

    def problems(self) -> List[str]:
        """What fails the soak among the reports: a wrong message, an error."""
        out = []
        if self.wrong:
            out.append(f"plugin stream: wrong message ({self.summary()['wrong']} in all): "
                       f"{self.wrong[0]}")
        out += [f"plugin stream: the {e['role']} end failed: {e.get('what')}" for e in self.errors]
        return out

    def summary(self, t0: Optional[float] = None) -> dict:
        """The totals: the receiver's intact messages and bytes, what the sender
        had sent, the wrong ones, and the receiver's longest time without a message
        (``longest_gap_end``: when it ended, seconds since the epoch; with the
        job's start ``t0`` also ``longest_gap_end_s``, seconds since it)."""
        last = {}
        for tick in self.ticks:
            last[tick["role"]] = tick
        last.update(self.done)
        recv, send = last.get("recv", {}), last.get("send", {})
        out = {"messages": recv.get("messages", 0), "bytes": recv.get("bytes", 0),
               "sent": send.get("messages", 0),
               "wrong": max([r.get("wrong", 0) for r in last.values()] + [len(self.wrong)]),
               "errors": len(self.errors), "longest_gap_s": recv.get("longest_gap_s"),
               "longest_gap_end": recv.get("longest_gap_end")}
        if t0 is not None and out["longest_gap_end"] is not None:
            out["longest_gap_end_s"] = out["longest_gap_end"] - t0
        return out

    def to_json(self, t0: Optional[float] = None) -> dict:
        return {"started": self.started, "ticks": self.ticks, "wrong": self.wrong,
                "errors": self.errors, "done": self.done, "summary": self.summary(t0)}


@dataclasses.dataclass
class SoakResult:
    t0: Optional[float] = None
    world: int = 0
    ticks: List[dict] = dataclasses.field(default_factory=list)
    events: List[dict] = dataclasses.field(default_factory=list)
    wrong: List[dict] = dataclasses.field(default_factory=list)
    applied: List[dict] = dataclasses.field(default_factory=list)
    samples: List[Sample] = dataclasses.field(default_factory=list)
    done: Dict[int, dict] = dataclasses.field(default_factory=dict)
    errors: List[str] = dataclasses.field(default_factory=list)
    stalls: List[dict] = dataclasses.field(default_factory=list)
    replay: Optional[dict] = None
    # per rank: its threads by name and sockets by kind at each quiet sample (the
    # warm-up's second half and the settle), so a count not returned is named
    inventory: Dict[Union[int, str], List[Tuple[float, dict]]] = dataclasses.field(default_factory=dict)
    plugin: Optional[StreamResult] = None  # None: run without the plugin stream
    scheduling: Optional[dict] = None  # the probe's lateness histogram (torch_reccl/soak/probe.py)

    def processes(self) -> List[Union[int, str]]:
        """What the samples name: every rank, then the plugin stream's processes."""
        return list(range(self.world)) + (list(PLUGIN_LABELS) if self.plugin is not None else [])

    def to_json(self) -> dict:
        return {"t0": self.t0, "world": self.world, "ticks": self.ticks, "events": self.events,
                "wrong": self.wrong, "faults_applied": self.applied,
                "samples": [s.to_json() for s in self.samples],
                "done": {str(r): d for r, d in sorted(self.done.items())},
                "errors": self.errors, "stalls": self.stalls, "replay": self.replay,
                "inventory": {str(who): [{"t": t, **held} for t, held in i]
                              for who, i in self.inventory.items()},
                "plugin": self.plugin.to_json(self.t0) if self.plugin is not None else None,
                "scheduling": self.scheduling}


def process_name(who: Union[int, str]) -> str:
    return f"rank {who}" if isinstance(who, int) else who


def proc_resources(pid: int) -> Optional[Tuple[int, int, int, int]]:
    """(RSS kB, open fds, threads, sockets) of a live process, or None."""
    try:
        rss = threads = 0
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        fds = sockets = 0
        for name in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            try:
                if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    sockets += 1
            except OSError:
                pass
        return rss, fds, threads, sockets
    except (OSError, ValueError):
        return None


_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
               "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
               "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _tcp_endpoint(hex_endpoint: str) -> str:
    """/proc/net/tcp{,6}'s ``ADDR:PORT`` (ADDR as 32-bit words in host order)."""
    address, port = hex_endpoint.split(":")
    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
    ip = ipaddress.ip_address(raw)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}" if ip.version == 4 else f"[{ip}]:{int(port, 16)}"


def proc_inventory(pid: int) -> Optional[dict]:
    """What a live process holds: its threads by name, and every socket as
    ``local->remote STATE`` (TCP) or its kind, counted; None once it is gone."""
    try:
        threads = Counter()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    threads[comm.read().strip()] += 1
            except OSError:
                pass
        described = {}
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as lines:
                    next(lines)
                    for line in lines:
                        fields = line.split()
                        described[fields[9]] = (f"{_tcp_endpoint(fields[1])}->"
                                                f"{_tcp_endpoint(fields[2])} "
                                                f"{_TCP_STATES.get(fields[3], fields[3])}")
            except OSError:
                pass
        sockets = Counter()
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                sockets[described.get(target[8:-1], "other socket")] += 1
        return {"threads": dict(threads), "sockets": dict(sockets)}
    except OSError:
        return None


def socket_kind(described: str) -> str:
    """A socket's kind for counting: a listener by its address, a connection by
    its state and remote address (its ports differ from dial to dial)."""
    if "->" not in described:
        return described
    local, remote_state = described.split("->", 1)
    remote, _, state = remote_state.partition(" ")
    return f"LISTEN on {local}" if state == "LISTEN" else f"{state} to {remote.rsplit(':', 1)[0]}"


def inventory_floor(held: List[dict]) -> Dict[str, Counter]:
    """The fewest of each thread name and socket kind over some inventories."""
    floor: Dict[str, Counter] = {}
    for what, key in (("thread", "threads"), ("socket", "sockets")):
        counts = []
        for one in held:
            if what == "socket":
                kinds = Counter()
                for described, n in one[key].items():
                    kinds[socket_kind(described)] += n
                counts.append(kinds)
            else:
                counts.append(Counter(one[key]))
        names = set().union(*counts) if counts else set()
        floor[what] = Counter({name: min(c[name] for c in counts) for name in names})
    return floor


def inventory_growth(before: dict, after: dict) -> List[str]:
    """What ``after`` holds beyond ``before``: '+2 thread reccl-dial',
    '+1 socket ESTABLISHED to 198.19.0.1', ..."""
    start, end = inventory_floor([before]), inventory_floor([after])
    grown = []
    for what in ("thread", "socket"):
        grown += [f"+{n} {what} {name}" for name, n in sorted((end[what] - start[what]).items())]
    return grown


class FaultDriver:
    """Applies and heals schedule faults in the fabric."""

    def __init__(self, fabric):
        self.fabric = fabric
        self.flaps = {}

    def apply(self, fault: SoakFault) -> None:
        f = self.fabric
        if fault.kind == "nic_down":
            f.nic_down(fault.host, fault.rail, wait=False)
        elif fault.kind == "rail_down":
            f.rail_down(fault.rail, wait=False)
        elif fault.kind == "flap":
            self.flaps[fault.index] = f.flap(fault.host, fault.rail, period_s=FLAP_PERIOD_S,
                                             count=fault.flaps)
        elif fault.kind == "blackhole":
            f.blackhole(fault.host, fault.rail)
        elif fault.kind == "slow":
            f.slow(fault.host, fault.rail, fault.percent)
        elif fault.kind == "lossy":
            f.lossy(fault.host, fault.rail, fault.percent)
        elif fault.kind in ("host_down", "split"):
            for host, rail in fault.nics_down(f.hosts):
                f.nic_down(host, rail, wait=False)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")

    def heal(self, fault: SoakFault) -> None:
        f = self.fabric
        if fault.kind == "nic_down":
            f.nic_up(fault.host, fault.rail, wait=False)
        elif fault.kind == "rail_down":
            f.rail_up(fault.rail, wait=False)
        elif fault.kind == "flap":
            handle = self.flaps.pop(fault.index, None)
            if handle is not None:
                handle.stop()
            f.nic_up(fault.host, fault.rail, wait=False)
        elif fault.kind == "blackhole":
            f.blackhole(fault.host, fault.rail, on=False)
        elif fault.kind == "slow":
            f.slow(fault.host, fault.rail, on=False)
        elif fault.kind == "lossy":
            f.lossy(fault.host, fault.rail, on=False)
        else:
            for host, rail in fault.nics_down(f.hosts):
                f.nic_up(host, rail, wait=False)

    def heal_all(self) -> None:
        for handle in self.flaps.values():
            handle.stop()
        self.flaps.clear()
        self.fabric.heal()


def worker_argv(settings: SoakSettings, replay_steps: Optional[int] = None) -> List[str]:
    argv = [sys.executable, "-m", "torch_reccl.soak.worker", "--seed", str(settings.seed),
            "--max-bytes", str(settings.max_bytes)]
    argv += ["--replay", str(replay_steps)] if replay_steps is not None else \
        ["--duration", str(settings.duration_s)]
    return argv


class StreamPlacement:
    """Where the plugin stream's ends run: each in its host's namespace
    (STREAM_HOSTS), with the NICs (RECCL_NICS) and the set-up the rank of that
    host gets."""

    kind = "fabric"

    def __init__(self, fabric):
        self.ranks = len(ROLES)
        self._hosts = FabricPlacement(fabric)

    def host(self, index: int) -> int:
        return STREAM_HOSTS[ROLES[index]]

    def env(self, index: int) -> Dict[str, str]:
        return self._hosts.env(self.host(index))

    def popen(self, index: int, argv: List[str], **kwargs):
        return self._hosts.popen(self.host(index), argv, **kwargs)


def stream_argv(settings: SoakSettings, handle: str) -> List[str]:
    """Both ends' command line, less --role: the soak's seed, duration and bounds."""
    return [sys.executable, "-m", "torch_reccl.soak.plugin_stream", "--handle", handle,
            "--duration", str(settings.duration_s), "--seed", str(settings.seed),
            "--start-timeout", str(settings.start_timeout_s),
            "--finish-timeout", str(FINISH_TIMEOUT_S)]


def stall(stalled_s: float, elapsed_s: float, spans: List[Tuple[float, float]],
          stall_s: float) -> Optional[dict]:
    """The stall when progress stopped ``stalled_s`` before ``elapsed_s`` (seconds
    into the run) is past the bound, ``stall_s`` plus the time in that window some
    pair of hosts had no path (``spans``); None within it."""
    allowed = stall_s + overlap_s(spans, elapsed_s - stalled_s, elapsed_s)
    if stalled_s <= allowed:
        return None
    return {"t": elapsed_s, "stalled_s": stalled_s, "allowed_s": allowed}


def stall_problem(record: dict, stall_s: float) -> str:
    return (f"no progress for {record['stalled_s']:.1f} s at {record['t']:.1f} s, past the bound "
            f"of {record['allowed_s']:.1f} s ({stall_s:g} s + outages in that time)")


@contextlib.contextmanager
def scheduling_probe(result: SoakResult, max_s: float):
    """Runs torch_reccl.soak.probe beside the job (in this namespace: the cores are the
    machine's) and leaves its histogram in result.scheduling."""
    with tempfile.TemporaryDirectory(prefix="reccl-soak-probe-") as folder:
        out = os.path.join(folder, "lateness.json")
        probe = subprocess.Popen([sys.executable, "-m", "torch_reccl.soak.probe", "--out", out,
                                  "--max-s", f"{max_s:.0f}"], stdin=subprocess.DEVNULL)
        try:
            yield
        finally:
            probe.terminate()
            try:
                probe.wait(PROBE_EXIT_TIMEOUT_S)
                with open(out) as f:
                    result.scheduling = json.load(f)
            except (subprocess.TimeoutExpired, OSError, ValueError) as error:
                probe.kill()
                probe.wait(PROBE_EXIT_TIMEOUT_S)
                print(f"reccl soak: no scheduling probe result: {error}", file=sys.stderr)


def run_soak(fabric, settings: SoakSettings, faults: List[SoakFault], faults_end_s: float,
             on_line=None) -> SoakResult:
    """Runs the soak job, and from its start the plugin stream (unless
    ``settings.plugin`` is off), through ``faults``; then the fault-free replay."""
    placement = FabricPlacement(fabric)
    result = SoakResult(world=placement.ranks, plugin=StreamResult() if settings.plugin else None)
    stream = result.plugin
    actions = sorted([(f.start_s, 0, f) for f in faults] + [(f.end_s, 1, f) for f in faults],
                     key=lambda a: (a[0], a[1]))
    spans = outages(faults, fabric.hosts, fabric.rails)
    driver = FaultDriver(fabric)
    say = on_line or (lambda line: None)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(scheduling_probe(result, settings.start_timeout_s + settings.duration_s
                                                 + FINISH_TIMEOUT_S + STREAM_START_SLACK_S))
            job = stack.enter_context(Job(placement, worker_argv(settings), env=RANK_ENV,
                                          log_dir=settings.log_dir))
            stream_job: Optional[Job] = None
            watched: List[Tuple[Union[int, str], int]] = list(enumerate(job.pids()))
            started = time.monotonic()
            last_progress = stream_progress = started
            next_sample = started
            deadline = started + settings.start_timeout_s + settings.duration_s + FINISH_TIMEOUT_S
            while True:
                got = job.next_message(TICK_S)
                now = time.monotonic()
                if got is not None:
                    rank, message = got
                    if _absorb(result, rank, message):
                        last_progress = now
                    if message.get("kind") == "sweep":  # the start bound is on setting up, not the sweep
                        started = now
                        deadline = now + settings.start_timeout_s + settings.duration_s + FINISH_TIMEOUT_S
                if stream is not None and stream_job is None and result.t0 is not None:
                    handle_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="reccl-soak-"))
                    stream_job = stack.enter_context(Job(
                        StreamPlacement(fabric), stream_argv(settings, os.path.join(handle_dir, "handle")),
                        env=RANK_ENV, log_dir=settings.log_dir, names=list(PLUGIN_LABELS),
                        per_rank_args=lambda index: ["--role", ROLES[index]]))
                    watched += list(zip(PLUGIN_LABELS, stream_job.pids()))
                    stream_started = stream_progress = now
                    deadline = max(deadline, now + settings.start_timeout_s + STREAM_START_SLACK_S
                                   + settings.duration_s + FINISH_TIMEOUT_S)
                if stream_job is not None and _drain_stream(stream_job, stream):
                    stream_progress = now
                if result.t0 is not None:
                    elapsed = time.time() - result.t0
                    while actions and actions[0][0] <= elapsed:
                        _, heal, fault = actions.pop(0)
                        try:
                            (driver.heal if heal else driver.apply)(fault)
                        except Exception as error:  # FabricError, OSError: the soak cannot go on
                            result.errors.append(f"could not {'heal' if heal else 'apply'} "
                                                 f"{fault.describe()}: {error}")
                            break
                        record = {"index": fault.index, "kind": fault.kind, "target": fault.target,
                                  "what": "heal" if heal else "apply", "t": time.time() - result.t0}
                        result.applied.append(record)
                        say(f"{record['t']:8.1f} s  {'heal ' if heal else 'apply'} "
                            f"{fault.describe()}")
                    record = stall(now - last_progress, elapsed, spans, settings.stall_s) \
                        if len(result.done) < result.world else None
                    if record:
                        _dump_stacks(job)
                        result.stalls.append({"who": "ranks", **record})
                        result.errors.append(f"{stall_problem(record, settings.stall_s)}\n{job.logs()}")
                    if stream_job is not None and len(stream.done) < len(ROLES):
                        record = stall(now - stream_progress, elapsed, spans, settings.stall_s)
                        if len(stream.started) < len(ROLES):  # the bound on connecting is the start's
                            if now - stream_started > settings.start_timeout_s + STREAM_START_SLACK_S:
                                result.errors.append(
                                    f"plugin stream: the ends did not connect within "
                                    f"{settings.start_timeout_s:.0f} s\n{stream_job.logs()}")
                        elif record:
                            _dump_stacks(stream_job)
                            result.stalls.append({"who": "plugin stream", **record})
                            result.errors.append(f"plugin stream: {stall_problem(record, settings.stall_s)}"
                                                 f"\n{stream_job.logs()}")
                if now >= next_sample:
                    t = time.time() - (result.t0 or time.time())
                    quiet = t < settings.warmup_s or t >= faults_end_s
                    next_sample = now + (QUIET_SAMPLE_EVERY_S if quiet else SAMPLE_EVERY_S)
                    # a process that reported done is ending (closing its sockets, freeing
                    # memory): its samples would lower the floors the verdicts compare
                    ended = set(result.done) | {PLUGIN_LABELS[ROLES.index(role)]
                                                for role in (stream.done if stream is not None else ())}
                    for who, pid in watched:
                        if who in ended:
                            continue
                        got_res = proc_resources(pid)
                        if got_res is not None:
                            result.samples.append(Sample(t, who, *got_res))
                        if settings.warmup_s / 2 <= t < settings.warmup_s or \
                                t >= faults_end_s + settings.settle_s / 2:
                            held = proc_inventory(pid)
                            if held is not None:
                                result.inventory.setdefault(who, []).append((t, held))
                if result.wrong and not any(e.startswith("wrong value") for e in result.errors):
                    result.errors.append(f"wrong value: {result.wrong[0]}\n{job.logs()}")
                failed = job.failed_ranks()
                if failed:
                    _drain(job, result)
                    result.errors.append(f"rank(s) {failed} failed\n{job.logs(failed)}")
                if stream_job is not None and not any(e.startswith("plugin stream") for e in result.errors):
                    result.errors += _stream_failures(stream_job, stream)
                if len(result.done) == result.world and (stream is None or len(stream.done) == len(ROLES)):
                    break
                if result.errors:
                    break
                if result.t0 is None and now - started > settings.start_timeout_s:
                    result.errors.append(f"the ranks did not start within "
                                         f"{settings.start_timeout_s:.0f} s\n{job.logs()}")
                    break
                if now > deadline:
                    result.errors.append(f"the run did not end by its deadline\n{job.logs()}"
                                         + (f"\n{stream_job.logs()}" if stream_job is not None else ""))
                    break
            if not result.errors and not job.wait(FINISH_TIMEOUT_S):
                result.errors.append(f"the ranks did not exit within {FINISH_TIMEOUT_S:.0f} s")
            _drain(job, result)
            if stream_job is not None and not result.errors:
                if not stream_job.wait(FINISH_TIMEOUT_S):
                    result.errors.append(f"plugin stream: the ends did not exit within "
                                         f"{FINISH_TIMEOUT_S:.0f} s\n{stream_job.logs()}")
                else:
                    result.errors += _stream_failures(stream_job, stream)
    finally:
        driver.heal_all()
    if result.t0 is not None:
        for event in result.events:
            event["t"] = float(event["time"]) - result.t0
        result.events.sort(key=lambda e: e["t"])
    if not result.errors and len(result.done) == result.world:
        result.replay = replay(fabric, settings, result)
    return result


def replay(fabric, settings: SoakSettings, soaked: SoakResult) -> dict:
    """The same training steps with no faults and no checked ops; compares parameters."""
    steps = {d["steps"] for d in soaked.done.values()}
    digests = {d["params_sha256"] for d in soaked.done.values()}
    if len(steps) != 1:
        return {"identical": False, "why": f"ranks ended at different steps {sorted(steps)}"}
    (count,) = steps
    ref = SoakResult(world=soaked.world)
    with Job(FabricPlacement(fabric), worker_argv(settings, count), env=RANK_ENV) as job:
        deadline = time.monotonic() + settings.start_timeout_s + count * 2.0 + FINISH_TIMEOUT_S
        while len(ref.done) < ref.world and time.monotonic() < deadline:
            got = job.next_message(0.2)
            if got is not None:
                _absorb(ref, *got)
            if job.failed_ranks():
                return {"identical": False, "why": f"the replay failed\n{job.logs()}"}
        job.wait(FINISH_TIMEOUT_S)
    ref_digests = {d["params_sha256"] for d in ref.done.values()}
    if len(ref.done) < ref.world:
        return {"identical": False, "why": "the replay did not finish"}
    return {"identical": len(digests) == 1 and digests == ref_digests, "steps": count,
            "params_sha256": sorted(digests), "replay_params_sha256": sorted(ref_digests)}


def _absorb(result: SoakResult, rank: int, message: dict) -> bool:
    """Files one message; True when it shows progress."""
    kind = message.get("kind")
    if kind == "start":
        result.t0 = float(message["t0"])
        return True
    if kind == "tick":
        result.ticks.append({k: v for k, v in message.items() if k != "kind"})
        return rank == 0
    if kind == "event":
        event = {k: v for k, v in message.items() if k not in ("kind", "event")}
        event["kind"] = message["event"]
        result.events.append(event)
    elif kind == "wrong":
        result.wrong.append({k: v for k, v in message.items() if k != "kind"})
    elif kind == "done":
        result.done[rank] = {k: v for k, v in message.items() if k != "kind"}
        return True
    return False


def _dump_stacks(job: Job) -> None:
    """Asks every process of ``job`` for its threads' stacks (faulthandler on
    SIGUSR1) into its log."""
    for pid in job.pids():
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(2.0)


def _drain(job: Job, result: SoakResult) -> None:
    while (got := job.next_message(0)) is not None:
        _absorb(result, *got)


def _drain_stream(job: Job, stream: StreamResult) -> bool:
    """Files the stream's messages so far; True when one shows progress."""
    progressed = False
    while (got := job.next_message(0)) is not None:
        progressed |= stream.absorb(ROLES[got[0]], got[1])
    return progressed


def _stream_failures(job: Job, stream: StreamResult) -> List[str]:
    """The plugin stream's problems so far: a wrong message, an error, an end
    that exited non-zero; the last with the ends' logs."""
    failed = job.failed_ranks()
    if failed:
        job.join_output(failed, 5.0)  # an end's last report comes before its exit
        _drain_stream(job, stream)
    problems = stream.problems()
    if failed and not problems:
        codes = job.exit_codes()
        problems = ["plugin stream: " + ", ".join(f"{job.names[i]} exited with status {codes[i]}"
                                                  for i in failed)]
    if problems:
        problems[-1] += "\n" + job.logs()
    return problems


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def explained_growth(warm: List[dict], end: List[dict], rank: Union[int, str], setup_hosts: Set[str],
                     store_rank: int, world: int) -> Tuple[Dict[str, int], List[str]]:
    """How many more threads and sockets the end's floors may hold than the
    warm-up's for reasons that are not leaks, and what else the end holds:

    - the engine's worker pool (``reccl-worker``) grows with the ops in flight and
      retires idle workers: up to the most it had in the warm-up;
    - the fault board opens its own store connection at the first fault and keeps
      it (pg/fault_board.cc): one per process, and at the store's host the other
      end of each rank's.
    """
    before, after = inventory_floor(warm), inventory_floor(end)
    most_workers = max((Counter(one["threads"])[POOL_THREAD] for one in warm), default=0)
    threads = after["thread"] - before["thread"]
    explained = {"threads": 0, "sockets": 0}
    if after["thread"][POOL_THREAD] <= most_workers:
        explained["threads"] = threads.pop(POOL_THREAD, 0)
    sockets = after["socket"] - before["socket"]
    store_allowance = 1 + (world if rank == store_rank else 0)
    for kind in sorted(sockets):
        remote = kind.rsplit(" ", 1)[-1]
        if kind.startswith("ESTABLISHED to ") and remote in setup_hosts:
            taken = min(sockets[kind], store_allowance)
            store_allowance -= taken
            explained["sockets"] += taken
            sockets[kind] -= taken
    rest = [f"+{n} thread {name}" for name, n in sorted(threads.items()) if n > 0]
    rest += [f"+{n} socket {kind}" for kind, n in sorted(sockets.items()) if n > 0]
    return explained, rest


def resource_verdicts(result: SoakResult, settings: SoakSettings, faults_end_s: float,
                      setup_hosts: Set[str] = frozenset(),
                      store_rank: int = 0) -> Tuple[List[str], dict]:
    """Growth checks against the floors (lowest samples) of the fault-free second
    half of the warm-up: RSS at the end within ``rss_growth`` of it, and fds,
    threads and sockets back to it once the faults have healed. A floor ignores
    what is in flight at a sample (a large message's buffers, a dial's thread and
    socket); a leak raises it. With inventories (thread names, socket kinds) the
    growth ``explained_growth`` accounts for is allowed and the rest is named;
    ``setup_hosts`` are the addresses of the set-up network (the store's). The
    plugin stream's ends are judged as the ranks are; they use no store, so no
    connection on the set-up network is explained for them."""
    problems: List[str] = []
    summary = {}
    for who in result.processes():
        name = process_name(who)
        mine = [s for s in result.samples if s.rank == who]
        first = [s for s in mine if settings.warmup_s / 2 <= s.t < settings.warmup_s]
        healed = [s for s in mine if s.t >= faults_end_s + settings.settle_s / 2]
        if not first or not healed:
            problems.append(f"{name}: no resource sample in the fault-free "
                            f"{'warm-up' if not first else 'settle'} (it died early?)")
            continue
        window = max(30.0, 0.1 * settings.duration_s)
        last = [s for s in mine if s.t >= mine[-1].t - window]
        floors = {what: (min(getattr(s, what) for s in first), min(getattr(s, what) for s in healed))
                  for what in ("fds", "threads", "sockets")}
        rss_base = min(s.rss_kb for s in first)
        rss_end = min(s.rss_kb for s in last)
        growth = rss_end / rss_base - 1.0
        held = result.inventory.get(who, [])
        warm = [one for t, one in held if t < settings.warmup_s]
        end = [one for t, one in held if t >= faults_end_s + settings.settle_s / 2]
        explained, unexplained = ({"threads": 0, "sockets": 0}, [])
        if warm and end:
            explained, unexplained = explained_growth(
                warm, end, who, set(setup_hosts) if isinstance(who, int) else set(), store_rank,
                result.world)
        explained["fds"] = explained["sockets"]
        summary[who] = {"rss_kb_warm": rss_base, "rss_kb_end": rss_end, "rss_growth": growth,
                         "rss_kb_max": max(s.rss_kb for s in mine),
                         **{what: list(pair) for what, pair in floors.items()},
                         "explained": explained}
        if growth > settings.rss_growth:
            problems.append(f"{name}: RSS grew {growth:.1%} over its warm-up level "
                            f"({rss_base} -> {rss_end} kB), more than {settings.rss_growth:.0%}")
        for what, (before, after) in floors.items():
            if after - before > explained[what]:
                problems.append(f"{name}: {what} not returned after the faults healed: "
                                f"{before} in the warm-up, {after} at the end (floors)"
                                + (f", {explained[what]} of them explained" if explained[what]
                                   else "")
                                + (f"; beyond the warm-up the end holds {', '.join(unexplained)}"
                                   if unexplained else ""))
    return problems, summary


def interruption_stats(result: SoakResult, spans: List[Tuple[float, float]]) -> dict:
    """p50/p99/max, in ms, of the interruption (duration_s) of every failover and
    failback: of all of them, and of those that did not overlap an outage of the
    schedule (a failover that waited for some path to come back counts the wait)."""
    out = {}
    for kind in INTERRUPTION_KINDS:
        timed = [(e.get("t"), 1000.0 * e["duration_s"]) for e in result.events
                 if e["kind"] == kind and e.get("duration_s") is not None]
        for label, values in (
                (kind, [ms for _, ms in timed]),
                (f"{kind}_outside_outages",
                 [ms for t, ms in timed
                  if t is not None and overlap_s(spans, t - ms / 1000.0, t) == 0.0])):
            out[label] = {"count": len(values), "p50_ms": percentile(values, 0.5),
                          "p99_ms": percentile(values, 0.99),
                          "max_ms": max(values, default=float("nan"))}
    return out

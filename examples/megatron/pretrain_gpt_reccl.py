"""Megatron-LM pretraining with torch_reccl: start the process group ourselves, then
run Megatron's own pretrain script unchanged.

What was and was not run: Megatron-LM main by hand on one H200 (issue 18); the
repeatable GPU check (bench/megatron_fault.py, tests/gpu/test_megatron_failover.py)
not yet. Written from Megatron-LM's public source: its ``_initialize_distributed``
skips ``init_process_group`` when torch.distributed is already initialised and adopts
that group's rank and world size; otherwise it calls
``init_process_group(backend=args.distributed_backend, ...)`` with
``--distributed-backend`` limited to ``choices=['nccl', 'gloo']``. Run on CPU
(tests/tools/test_examples.py): this launcher under torchrun and without it, from
tests/helpers/megatron_checkout/ (a stand-in for a Megatron-LM checkout: pretrain_gpt.py,
megatron/training/training.py and dist_signal_handler.py behave as Megatron's do at
the points used here), with ``--exit-signal-handler``, ``--reccl-wandb`` with an
offline run and ``--reccl-fault-schedule``.

Run on GPU hosts, from a Megatron-LM checkout, with torch_reccl installed:

    export RECCL_NICS=eth0,eth1,eth2,eth3          # this host's NICs, in rail order
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        /path/to/torch_reccl/examples/megatron/pretrain_gpt_reccl.py \\
        --reccl-script pretrain_gpt.py --reccl-events-jsonl reccl_events.jsonl \\
        <the usual pretrain_gpt.py arguments>

Our options start with ``--reccl-`` and are taken out of argv before Megatron parses
it. ``--reccl-backend`` (default ``reccl``): the "reccl" backend runs CUDA tensors on
torch's own ProcessGroupNCCL, whose inter-host traffic torch_reccl's NCCL net plugin
carries with NIC failover (``import torch_reccl`` sets NCCL_NET_PLUGIN before NCCL
starts), and CPU tensors on the reccl engine. Megatron's extra gloo groups
(``backend="gloo"`` in its parallel_state) are unaffected. The script runs as
``python SCRIPT`` would run it: its directory first on sys.path, so a checkout's
``megatron`` package imports.

``--exit-signal-handler``: Megatron all-gathers a "signal received" flag on the
device that ``megatron/training/dist_signal_handler.py``'s ``get_device()`` names,
which knows only nccl (cuda) and gloo (cpu) and raises RuntimeError for any other
backend. The launcher wraps it (when Megatron imports that module) so that a
"reccl" group's device is cuda where CUDA is available, else cpu; other backends
keep Megatron's answer.

Events: every rank's events go to one collecting rank (``on_event(job_wide=True)``),
which prints them and, with ``--reccl-events-jsonl``, writes them as JSON lines.
``--reccl-wandb``: Megatron's W&B run (``--wandb-project``) lives on the last rank and
is made inside pretrain, so the launcher collects on the last rank
(``join_job(collector_rank=world_size - 1)``) and attaches the W&B integration with
``wait_for_run=True``: events wait until Megatron has called ``wandb.init``.

Fault schedule (``--reccl-fault-schedule``), the drill's syntax by iteration
(torch_reccl/drill/schedule.py parses it), e.g. ``h0nic0:down@step 100,h0nic0:up@step 200``:
``TARGET:ACTION@step N`` fires right before Megatron's iteration N+1 starts (after N
iterations finished, the drill's "step N"), with ``torch_reccl.inject_fault`` in every
process of host H (``hHnicR``; ``nicR`` is host 0, ``railR`` every host) on its R-th
NIC. A host is a torchrun node (GROUP_RANK); started without torchrun, each process
is its own host (rank // LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE 1 by default), as when
two ranks share one GPU with their own NCCL_HOSTID. Actions: down, up, flap,
blackhole, heal. With ``--reccl-fault-driver PATH`` the faults are real ones made
outside the job (bench/megatron_fault.py ``--link veth`` takes a veth down in an
emulated fabric): rank 0 writes the iterations done to PATH before each iteration,
the driver acts when the schedule's step is reached, and every drill action
(slow=, lossy= too) is allowed. The hook: Megatron's ``train()`` calls ``train_step`` by its name in
``megatron.training.training`` every iteration, with ``iteration=`` the number of
iterations done; the launcher wraps that function when Megatron imports the module
(torch_reccl.import_hook), so Megatron is not edited. The same wrapper times every
``train_step`` (CUDA synchronised at its end). At exit the collecting rank prints a
summary (fault-free median step time, the slowest step within 5 iterations of each
fault, failovers and failbacks counted from every rank's events) and writes it with
``--reccl-report PATH`` as JSON.

Exit: Megatron returns from pretrain (or sys.exit()s) without destroying its
process groups. The launcher then publishes the events, destroys every group and
lets rank 0 - which hosts the TCPStore when started without torchrun - leave last,
so no rank's NCCL watchdog or event channel talks to a store that is gone; every
step of this is bounded (FINISH_TIMEOUT_S).

Restart or run degraded (``--reccl-policy advised``; docs/simulation.md, "The
advisor in a running job"): the launcher holds a torch_reccl.policy.FaultPolicy
with Megatron's ``--save-interval`` as its checkpoint interval and asks it after
every ``train_step`` (one broadcast, so every rank gets the same answer at the same
iteration). At ``checkpoint_and_exit`` it goes through Megatron's own exit path:
``--exit-signal-handler``'s gathered flags read "signal received" on every rank,
so Megatron saves its checkpoint (``--save``) and leaves its loop; the launcher then
exits with code 75 after the usual finish. At ``exit_now`` every rank exits 75 at
once, without a checkpoint. ``torchrun --max-restarts`` starts the job again and
Megatron resumes from ``--load``. A restarted job (TORCHELASTIC_RESTART_COUNT > 0)
fires no scheduled faults: an injected fault dies with its process. The rule's
costs: ``--reccl-t-detect``, ``--reccl-t-reload`` (seconds, the paper's 1800 by
default), ``--reccl-expected-repair`` (inf: eq. 2), ``--reccl-assumed-k``. Each
change of answer, with its inputs, goes to ``--reccl-events-jsonl`` and
``--reccl-wandb`` on the collecting rank.

Two other routes, documented in examples/megatron/README.md: a patch to Megatron's
arguments.py and dist_signal_handler.py (``--distributed-backend reccl``) and the
zero-code route ``NCCL_NET_PLUGIN=$(python -m torch_reccl --plugin-path)``.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import runpy
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import torch_reccl  # first: registers "reccl" and points NCCL at the plugin
from torch_reccl.drill.faults import InjectedFaults
from torch_reccl.drill.runner import median
from torch_reccl.drill.schedule import Fault, ScheduleError, check_topology, fault_spans, parse_schedule, take_due
from torch_reccl.import_hook import after_import

SHOWN_KINDS = ["failover", "failback", "nic_down", "nic_up", "connection_failed", "slowdown"]
COUNTED_KINDS = ("failover", "failback", "nic_down", "nic_up", "rebalance", "path_down")
SIGNAL_HANDLER_MODULE = "megatron.training.dist_signal_handler"
TRAINING_MODULE = "megatron.training.training"
# Step times within this many iterations of a fault count as "around the fault".
FAULT_WINDOW = 5
# The first iterations also build NCCL's communicators and our connections: not fault-free time.
WARMUP_ITERATIONS = 2
# Bounds at exit: every rank reaching the end, rank 0 waiting for the others to leave,
# and the whole of it (events, summary, destroying the groups).
FINISH_BARRIER_S = 120.0
LEAVE_WAIT_S = 30.0
FINISH_TIMEOUT_S = 240.0
FINISHED_KEY = "reccl/launcher/finished"
LEFT_KEY = "reccl/launcher/left"


def split_argv(argv):
    """(our --reccl-* options, Megatron's arguments)."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_reccl.py", add_help=True,
        description="Megatron-LM pretraining over torch_reccl; other arguments go to Megatron.")
    parser.add_argument("--reccl-script", default="pretrain_gpt.py",
                        help="Megatron's training script to run (default: pretrain_gpt.py)")
    parser.add_argument("--reccl-backend", default="reccl",
                        help='process group backend (default "reccl": CUDA tensors through NCCL '
                             'and our plugin, CPU tensors on the reccl engine)')
    parser.add_argument("--reccl-timeout-minutes", type=float, default=10.0,
                        help="process group timeout, as Megatron's --distributed-timeout-minutes")
    parser.add_argument("--reccl-events-jsonl", default=None,
                        help="the collecting rank appends every rank's events to this file")
    parser.add_argument("--reccl-wandb", action="store_true",
                        help="log every rank's events to Megatron's W&B run (on the last rank)")
    parser.add_argument("--reccl-fault-schedule", default=None, metavar="SCHEDULE",
                        help="faults by iteration, the drill's syntax: TARGET:ACTION@step N[,...], "
                             "e.g. 'h0nic0:down@step 100,h0nic0:up@step 200' (fires before "
                             "iteration N+1 in every process of host H, by inject_fault)")
    parser.add_argument("--reccl-fault-driver", default=None, metavar="PATH",
                        help="the schedule's faults are real link faults made by a driver outside "
                             "the job (bench/megatron_fault.py --link veth): this process injects "
                             "nothing and rank 0 writes the iterations done to PATH before each one")
    parser.add_argument("--reccl-policy", choices=("advised", "restart", "run_degraded"),
                        default=None, help="follow torch_reccl.policy.FaultPolicy with this rule: "
                        "checkpoint and exit 75 through Megatron's --exit-signal-handler path")
    parser.add_argument("--reccl-policy-interval", type=int, default=None, metavar="N",
                        help="iterations between checkpoints (default: Megatron's --save-interval)")
    parser.add_argument("--reccl-t-detect", type=float, default=1800.0,
                        help="seconds to find a faulty node (FaultPolicy t_detect_s)")
    parser.add_argument("--reccl-t-reload", type=float, default=1800.0,
                        help="seconds to reschedule and load a checkpoint (FaultPolicy t_reload_s)")
    parser.add_argument("--reccl-expected-repair", type=float, default=float("inf"),
                        help="seconds a fault lasts (default inf: reload at the next checkpoint)")
    parser.add_argument("--reccl-assumed-k", type=float, default=1.03,
                        help="slowdown assumed until measured (FaultPolicy assumed_k)")
    parser.add_argument("--reccl-report", default=None, metavar="PATH",
                        help="the collecting rank writes the run's summary here as JSON: step "
                             "time of every iteration, around each fault, failovers and failbacks")
    return parser.parse_known_args(argv)


# ---------------------------------------------------------------- fault schedule


def parse_iteration_schedule(text: Optional[str], by_driver: bool = False) -> List[Fault]:
    """The drill's schedule by iteration ("step N"): restricted to what a training
    process can do to itself (an inject_fault equivalent), unless a fabric driver
    outside the job makes the faults (``by_driver``: every drill action)."""
    faults = parse_schedule(text or "")
    for fault in faults:
        if fault.at_step is None:
            raise ScheduleError(f"fault {fault.text!r}: the Megatron launcher schedules by iteration; "
                                f"use @step N (fires before iteration N+1), not a time")
        if fault.action in InjectedFaults.FABRIC_ONLY and not by_driver:
            raise ScheduleError(f"fault {fault.text!r}: a {fault.action} NIC needs the emulated fabric; "
                                f"inject_fault has no equivalent (valid here: "
                                f"{', '.join(sorted(InjectedFaults.KIND))})")
    return faults


def this_host() -> int:
    """The host this process is on, as the schedule's hHnicR counts hosts: torchrun's
    node rank, else RANK // LOCAL_WORLD_SIZE (each process its own host by default)."""
    if os.environ.get("GROUP_RANK", "").isdigit():
        return int(os.environ["GROUP_RANK"])
    rank = int(os.environ.get("RANK", "0"))
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_count(world_size: int) -> int:
    if os.environ.get("GROUP_WORLD_SIZE", "").isdigit():
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def inject(nic: str, action: str) -> str:
    kind = InjectedFaults.KIND[action]
    torch_reccl.inject_fault(nic, kind)
    return f"inject_fault({nic!r}, {kind!r})"


class IterationHook:
    """Wraps Megatron's train_step: fires the schedule's faults for this host before
    an iteration starts and times each train_step (``sync`` at its end, so queued
    GPU work is counted). ``step_s`` maps Megatron's logged iteration number (1 for
    the first train_step) to its seconds."""

    def __init__(self, faults: List[Fault], host: int, nic_names: List[str],
                 apply: Callable[[str, str], str] = inject, sync: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, announce: Callable[[str], None] = print,
                 progress: Optional[Callable[[int], None]] = None, policy=None):
        self.progress = progress
        self.policy = policy       # a FaultPolicy asked after every train_step, or None
        self.reschedule = None     # its checkpoint_and_exit answer, once given
        self.pending = [f for f in faults if f.host is None or f.host == host]
        self.nic_names = nic_names
        self.apply = apply
        self.sync = sync
        self.clock = clock
        self.announce = announce
        self.calls = 0
        self.step_s: Dict[int, float] = {}
        self.fired: List[dict] = []

    def fire_due(self, done: int) -> None:
        """Applies every pending fault due once ``done`` iterations have finished."""
        for fault in take_due(self.pending, 0.0, done):
            what = self.apply(self.nic_names[fault.rail], fault.action)
            self.fired.append({"fault": fault.text, "before_iteration": done + 1, "what": what})
            self.announce(f"[reccl fault] before iteration {done + 1}: {what} ({fault.text})")

    def wrap(self, train_step):
        @functools.wraps(train_step)
        def train_step_with_faults(*args, **kwargs):
            # Megatron passes iteration= (iterations done); older ones do not: count calls.
            done = kwargs.get("iteration")
            done = self.calls if done is None else int(done)
            if self.progress is not None:
                self.progress(done)
            self.fire_due(done)
            start = self.clock()
            result = train_step(*args, **kwargs)
            if self.sync is not None:
                self.sync()
            self.step_s[done + 1] = self.clock() - start
            self.calls += 1
            if self.policy is not None and self.reschedule is None:
                advice = self.policy.step(done + 1)
                if advice.checkpoint:
                    self.reschedule = advice  # Megatron saves and leaves at its signal check
                elif advice.exit:
                    self.policy.exit_for_rescheduling(advice)
            return result

        train_step_with_faults.reccl_hooked = True
        return train_step_with_faults

    def install(self, module) -> None:
        if not getattr(module.train_step, "reccl_hooked", False):
            module.train_step = self.wrap(module.train_step)

    def adapt_signals(self, module) -> None:
        """Once the policy says checkpoint_and_exit, every rank's gathered "signal
        received" flags read true (the gather still runs), so Megatron saves and exits."""
        original = module.DistributedSignalHandler.signals_received
        if getattr(original, "reccl_hooked", False):
            return
        hook = self

        def signals_received(handler):
            flags = original(handler)
            return [1] * len(flags) if hook.reschedule is not None else flags

        signals_received.reccl_hooked = True
        module.DistributedSignalHandler.signals_received = signals_received


def left_to_driver(nic: str, action: str) -> str:
    return f"{action} on {nic}, made by the fabric driver"


def progress_writer(path: str) -> Callable[[int], None]:
    """Publishes the iterations done for a driver outside the job: written aside and
    renamed, so the driver never reads a half-written number."""
    def write(done: int) -> None:
        with open(path + ".tmp", "w") as f:
            f.write(str(done))
        os.replace(path + ".tmp", path)

    return write


def cuda_sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- summary


def summarize(step_s: Dict[int, float], faults: List[Fault], events: List[dict],
              window: int = FAULT_WINDOW, warmup: int = WARMUP_ITERATIONS) -> dict:
    """The run in numbers. A fault with ``@step N`` fires before iteration N+1; its
    window is iterations N+1-window .. N+1+window. Fault-free: iterations after the
    warm-up and outside every fault's span (down .. up, from the drill's
    fault_spans) widened by the window; degraded: inside a span, outside the windows."""
    iterations = sorted(step_s)
    spans = fault_spans([(f, f.at_step + 1) for f in sorted(faults, key=lambda f: f.at_step)],
                        end_s=(iterations[-1] + 1) if iterations else 0)

    def near(i: int, at: int) -> bool:
        return abs(i - at) <= window

    around = []
    for fault in faults:
        at = fault.at_step + 1
        inside = {i: step_s[i] for i in iterations if near(i, at)}
        slowest = max(inside, key=inside.get) if inside else None
        around.append({"fault": fault.text, "before_iteration": at,
                       "max_step_s": inside[slowest] if slowest is not None else None,
                       "max_at_iteration": slowest})
    fault_free = [step_s[i] for i in iterations if i > warmup and not any(
        start - window <= i <= end + window for start, end, _ in spans)]
    degraded = [step_s[i] for i in iterations if any(start <= i < end for start, end, _ in spans)
                and not any(near(i, f.at_step + 1) for f in faults)]
    by_kind: Dict[str, Dict[str, int]] = {}
    for event in events:
        if event["kind"] in COUNTED_KINDS:
            ranks = by_kind.setdefault(event["kind"], {})
            ranks[str(event["rank"])] = ranks.get(str(event["rank"]), 0) + 1
    fault_free_median = median(fault_free) if fault_free else None
    for entry in around:
        entry["vs_fault_free"] = (entry["max_step_s"] / fault_free_median
                                  if entry["max_step_s"] is not None and fault_free_median else None)
    return {
        "iterations": len(iterations),
        "step_s": {str(i): step_s[i] for i in iterations},
        "fault_free_median_step_s": fault_free_median,
        "fault_free_iterations": len(fault_free),
        "degraded_median_step_s": median(degraded) if degraded else None,
        "faults": around,
        "events": {kind: sum(by_kind.get(kind, {}).values()) for kind in COUNTED_KINDS},
        "events_by_rank": by_kind,
    }


def summary_lines(report: dict) -> List[str]:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.2f} ms"

    lines = [f"[reccl summary] {report['iterations']} iterations; fault-free median step "
             f"{ms(report['fault_free_median_step_s'])} ({report['fault_free_iterations']} iterations); "
             f"during faults {ms(report['degraded_median_step_s'])}"]
    for entry in report["faults"]:
        ratio = entry["vs_fault_free"]
        lines.append(f"[reccl summary] {entry['fault']} (before iteration {entry['before_iteration']}): "
                     f"slowest step within {FAULT_WINDOW} iterations {ms(entry['max_step_s'])} at "
                     f"iteration {entry['max_at_iteration']}"
                     + (f", {ratio:.2f}x the fault-free median" if ratio else ""))
    counts = ", ".join(f"{n} {kind}" for kind, n in report["events"].items() if n)
    lines.append(f"[reccl summary] events (every rank): {counts or 'none'}")
    return lines


def init_distributed(backend: str, timeout_minutes: float) -> None:
    """What Megatron's _initialize_distributed would do, with our backend: bind this
    process to its GPU, then make the default group from torchrun's env://."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def reccl_aware_get_device(original):
    """Megatron's dist_signal_handler.get_device(local_rank), which raises for any
    backend but nccl and gloo, answering for "reccl" too: the device its tensors are
    on, cuda where CUDA is available (NCCL carries them), else cpu (the reccl engine)."""
    def get_device(local_rank=None):
        import torch

        if torch_reccl.backend.BACKEND_NAME not in str(torch.distributed.get_backend()):
            return original(local_rank)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda") if local_rank is None else torch.device("cuda", local_rank)

    return get_device


def adapt_signal_handler(module) -> None:
    module.get_device = reccl_aware_get_device(module.get_device)


def run_script(script: str, argv) -> int:
    """Runs `script` as ``python script argv...`` would: as __main__, with its own
    directory (a Megatron-LM checkout's root, holding megatron/) first on sys.path
    in place of this launcher's. Returns its exit code (0 unless it sys.exit()s)."""
    sys.argv = [script] + list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:  # Megatron's exit paths (--exit-interval, signals) end this way
        if done.code is None:
            return 0
        return done.code if isinstance(done.code, int) else 1
    return 0


def say(line: str) -> None:
    """One line in one write: the ranks share stdout, and a line written in two
    pieces (text, then newline, as print does unbuffered) can run into another
    rank's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def show(event) -> None:
    from torch_reccl.integrations._sink import describe

    say(f"[reccl event] {describe(event)}")


def wait_for_count(store, key: str, target: int, timeout_s: float) -> bool:
    """Adds nothing; polls ``key``'s counter until it reaches ``target`` (exit only)."""
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < target:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def finish(store, rank: int, world: int, collector: int, hook: IterationHook, faults: List[Fault],
           events: List[dict], report_path: Optional[str]) -> None:
    """The end of a run: every rank's events reach the collector, which prints and
    writes the summary; every group is destroyed; rank 0 leaves last."""
    import torch.distributed as dist

    from torch_reccl.events import flush_events, leave_job

    flush_events(job_wide=True)  # publishers: wait until their events are in the store
    store.add(FINISHED_KEY, 1)
    if not wait_for_count(store, FINISHED_KEY, world, FINISH_BARRIER_S):
        print(f"[reccl] rank {rank}: not every rank finished within {FINISH_BARRIER_S:.0f} s; "
              f"the summary may miss events", flush=True)
    flush_events(job_wide=True)  # the collector: read what the others published
    if rank == collector:
        report = summarize(hook.step_s, faults, events)
        report.update(world=world, collector_rank=rank, fired=hook.fired,
                      schedule=[f.text for f in faults])
        for line in summary_lines(report):
            print(line, flush=True)
        if report_path:
            with open(report_path, "w") as f:
                json.dump(report, f, indent=1)
    leave_job()
    if dist.is_initialized():  # Megatron's SIGTERM path destroys them itself
        dist.destroy_process_group()  # every group Megatron made, ours and its gloo ones
    if rank == 0:  # hosts the store when started without torchrun: the others first
        if not wait_for_count(store, LEFT_KEY, world - 1, LEAVE_WAIT_S):
            print(f"[reccl] rank 0: the other ranks did not leave within {LEAVE_WAIT_S:.0f} s; "
                  f"leaving anyway", flush=True)
    else:
        store.add(LEFT_KEY, 1)


def bounded(seconds: float, what: str):
    """A watchdog: if not cancelled within ``seconds``, says so and ends the process."""
    def expire():
        print(f"[reccl] {what} took longer than {seconds:.0f} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def policy_interval(ours, megatron_args) -> Optional[int]:
    """The policy's checkpoint interval: ours, else Megatron's --save-interval; checks
    that Megatron's checkpoint-and-exit path is on."""
    if not ours.reccl_policy:
        return None
    if "--exit-signal-handler" not in megatron_args:
        raise SystemExit("pretrain_gpt_reccl.py: --reccl-policy needs Megatron's "
                         "--exit-signal-handler (its save-and-exit path), and --save/--load")
    if ours.reccl_policy_interval is not None:
        return ours.reccl_policy_interval
    for i, arg in enumerate(megatron_args):
        value = arg.split("=", 1)[1] if arg.startswith("--save-interval=") else (
            megatron_args[i + 1] if arg == "--save-interval" and i + 1 < len(megatron_args) else None)
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    raise SystemExit("pretrain_gpt_reccl.py: --reccl-policy needs the checkpoint interval: "
                     "Megatron's --save-interval N or --reccl-policy-interval N")


def main(argv=None) -> None:
    ours, megatron_args = split_argv(sys.argv[1:] if argv is None else argv)
    try:
        faults = parse_iteration_schedule(ours.reccl_fault_schedule, by_driver=bool(ours.reccl_fault_driver))
    except ScheduleError as error:
        raise SystemExit(f"pretrain_gpt_reccl.py: --reccl-fault-schedule: {error}")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        faults = []  # an injected fault died with the process that had it
    interval = policy_interval(ours, megatron_args)
    init_distributed(ours.reccl_backend, ours.reccl_timeout_minutes)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nic_names = [nic["name"] for nic in torch_reccl.nics()]
    try:
        check_topology(faults, host_count(world), len(nic_names))
    except ScheduleError as error:
        raise SystemExit(f"pretrain_gpt_reccl.py: --reccl-fault-schedule: {error} "
                         f"(this process's NICs: {', '.join(nic_names)})")
    # Megatron logs to W&B from the last rank; collect the job's events there.
    collector = world - 1 if ours.reccl_wandb else 0
    store = dist.distributed_c10d._get_default_store()
    torch_reccl.events.join_job(collector_rank=collector)
    torch_reccl.on_event(show, kinds=SHOWN_KINDS, job_wide=True)
    events: List[dict] = []
    torch_reccl.on_event(lambda event: events.append(event.to_dict()), kinds=COUNTED_KINDS, job_wide=True)
    driver = ours.reccl_fault_driver
    policy = None
    if ours.reccl_policy:
        from torch_reccl.policy import FaultPolicy

        policy = FaultPolicy(interval, t_detect_s=ours.reccl_t_detect,
                             t_reload_s=ours.reccl_t_reload,
                             expected_repair_s=ours.reccl_expected_repair,
                             assumed_k=ours.reccl_assumed_k, rule=ours.reccl_policy)
    hook = IterationHook(faults, this_host(), nic_names, sync=cuda_sync,
                         apply=left_to_driver if driver else inject,
                         announce=lambda line: say(f"{line} on rank {rank}"),
                         progress=progress_writer(driver) if driver and rank == 0 else None,
                         policy=policy)
    after_import(TRAINING_MODULE, hook.install)
    if policy is not None:
        after_import(SIGNAL_HANDLER_MODULE, hook.adapt_signals)
    sinks = []
    if ours.reccl_events_jsonl:
        from torch_reccl.integrations import jsonl

        sinks.append(jsonl.attach(ours.reccl_events_jsonl))
    if ours.reccl_wandb:
        from torch_reccl.integrations import wandb as reccl_wandb

        sinks.append(reccl_wandb.attach(wait_for_run=True))  # Megatron calls wandb.init in pretrain
    if policy is not None:
        policy.loggers += sinks  # each change of answer, with its inputs, on the collecting rank
    after_import(SIGNAL_HANDLER_MODULE, adapt_signal_handler)  # --exit-signal-handler
    # Megatron sees an initialised torch.distributed and keeps it (its
    # _initialize_distributed prints "torch distributed is already initialized").
    code = run_script(ours.reccl_script, megatron_args)
    if hook.reschedule is not None:
        from torch_reccl.policy import RESCHEDULE_EXIT_CODE, rescheduling_message

        say(rescheduling_message(hook.reschedule, rank))
        code = RESCHEDULE_EXIT_CODE
    watchdog = bounded(FINISH_TIMEOUT_S, f"rank {rank}'s exit (events, summary, destroying groups)")
    finish(store, rank, world, collector, hook, faults, events, ours.reccl_report)
    watchdog.cancel()
    sys.exit(code)


if __name__ == "__main__":
    main()

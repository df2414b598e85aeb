"""The one runner of bench/scale.py's jobs: N rank processes driven phase by phase.

The launcher starts N rank processes on 127.0.0.1 (one process per rank: forked by a
zygote that imported torch once, or spawned; torch.set_num_threads(1) in each) and hosts
the rendezvous store itself: the real c10d TCPStore server (is_master=True,
wait_for_workers=False) behind the counting proxy of store.py. The phases are
driven over each rank's stdin (commands) and a private pipe (JSON replies), never
through the store: start (ranks import torch and torch_reccl, report their pid), then
those of groups.py (init, create, first_use), idle.py (settle, idle), latency.py
(collectives) and busbw.py (one per (op, size)).

Every phase is bounded; a job that does not finish a phase in its bound is reported as
"did not finish (<phase>)" and its ranks are killed.

The rank program is this module (``python -m torch_reccl.bench.scaling.runner``):
``--_rank ...`` runs one rank (start method "spawn"), ``--_zygote ...`` forks them
(start method "fork").
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from torch_reccl.bench import procstat
from torch_reccl.bench.scaling import (
    busbw as scale_busbw,
    groups as scale_setup,
    idle as scale_idle,
    latency as scale_latency,
)
from torch_reccl.bench.scaling.store import CountingProxy

NICS = "127.0.0.1,127.0.0.2"
# The directory holding the torch_reccl package (the checkout's root): the ranks run
# there with it on PYTHONPATH, and the report names its commit.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RANK_PROGRAM = [sys.executable, "-m", "torch_reccl.bench.scaling.runner"]

# --------------------------------------------------------------------------- the rank


class RankContext:
    """A rank's side of the phases: a command line in per phase, JSON replies out."""

    def __init__(self, rank: int, size: int, replies, commands) -> None:
        self.rank, self.size = rank, size
        self.phase = "start"
        self.errors: List[str] = []  # wrong results so far (each phase reports its new ones)
        self._replies, self._commands = replies, commands
        self._reported = 0

    def emit(self, kind: str, **fields) -> None:
        self._replies.write(json.dumps({"kind": kind, "rank": self.rank, **fields}) + "\n")
        self._replies.flush()

    def progress(self, step: str) -> None:
        self.emit("progress", step=step)

    def command(self, expected: str, name: Optional[str] = None) -> None:
        """Waits for the launcher's next command, which must be ``expected``."""
        self.phase = name or expected
        line = self._commands.readline()  # blocks in read(): an idle rank's main thread sleeps here
        if not line:  # the launcher is gone or gave up on this job
            os._exit(3)
        if line.strip() != expected:
            self.emit("error", error=f"expected command {expected!r}, got {line.strip()!r}")
            os._exit(4)

    def new_errors(self) -> List[str]:
        """The wrong results found since the last call."""
        new = self.errors[self._reported:]
        self._reported = len(self.errors)
        return new


def rank_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--msg-fd", type=int, required=True)
    p.add_argument("--cmd-fd", type=int, default=0)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--small-iters", type=int, required=True)
    p.add_argument("--busbw", required=True, help="the busbw plan: JSON [[op, size bytes, untimed, timed], ...]")
    args = p.parse_args(argv)
    out = os.fdopen(args.msg_fd, "w", buffering=1)
    ctx = RankContext(args.rank, args.size, out, os.fdopen(args.cmd_fd, "r"))

    fd_table_at_start = procstat.fd_table_entries()
    import torch

    torch.set_num_threads(1)
    torch.ones(1000).sum()  # let torch start whatever threads it starts before measuring
    threads_torch = scale_setup.thread_count()
    ctx.emit("start", pid=os.getpid(), threads_torch=threads_torch, threads_imported=scale_setup.thread_count(),
             fd_table_at_start=fd_table_at_start)
    timeout = datetime.timedelta(seconds=args.timeout)

    try:
        scale_setup.rank_phases(ctx, args.backend, args.store_port, timeout)
        scale_latency.rank_phase(ctx, args.warmup, args.small_iters)
        scale_busbw.rank_phases(ctx, json.loads(args.busbw))
    except Exception as error:  # noqa: BLE001 - told to the launcher, then the traceback goes to the log
        ctx.emit("error", error=f"rank {args.rank} in phase {ctx.phase}: {type(error).__name__}: {error}"[:3000])
        raise

    ctx.command("exit")
    out.close()
    os._exit(0)  # no teardown: nothing in it is measured, and it may be slow


# --------------------------------------------------------------------------- the launcher


class DidNotFinish(Exception):
    def __init__(self, phase: str, detail: str) -> None:
        super().__init__(f"did not finish ({phase}): {detail}")
        self.phase, self.detail = phase, detail


def zygote_main(spec_json: str) -> int:
    """Imports torch once, then forks one process per rank (start method "fork").

    Importing torch takes seconds of CPU per process; on a small machine N fresh
    interpreters spend most of a job's start-up doing that. The zygote imports
    torch (no tensor op, no thread but its own), then forks; each child closes the
    other ranks' pipes, sends its output to its log, dies with the zygote
    (PR_SET_PDEATHSIG) and runs rank_main.
    """
    import ctypes
    import signal
    import traceback

    specs = json.loads(spec_json)
    import torch  # noqa: F401 - the expensive part, once
    import torch.distributed  # noqa: F401

    zygote = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for spec in specs:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                if os.getppid() != zygote:
                    os._exit(5)
                log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                for other in specs:
                    if other is not spec:
                        os.close(other["cmd_fd"])
                        os.close(other["msg_fd"])
                code = rank_main(spec["argv"])
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported in the rank's log
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code or 0)
        children.append(pid)
    for spec in specs:
        os.close(spec["cmd_fd"])
        os.close(spec["msg_fd"])
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return 0


class _Ranks:
    """N rank processes: commands on a pipe each (one line per phase), JSON replies on another.

    start_method "fork": one zygote process imports torch and forks the ranks;
    "spawn": one fresh interpreter per rank (slow on small machines: every rank
    imports torch). A rank that exits closes its reply pipe, which is how its
    death is noticed.
    """

    def __init__(self, backend: str, size: int, store_port: int, opts: dict, env: dict, log_dir: str,
                 start_method: str = "fork"):
        self.size = size
        self.procs: List[subprocess.Popen] = []
        self.pids: Dict[int, int] = {}
        self.cmd: Dict[int, int] = {}
        self.fds: Dict[int, int] = {}
        self.closed = set()
        self.partial: Dict[int, bytes] = {}
        self.replies: Dict[str, Dict[int, dict]] = collections.defaultdict(dict)
        self.logs = [os.path.join(log_dir, f"{backend}-{size}-rank{r}.log") for r in range(size)]
        self.zygote_log = os.path.join(log_dir, f"{backend}-{size}-zygote.log")
        self.selector = selectors.DefaultSelector()
        specs = []
        for r in range(size):
            cmd_r, cmd_w = os.pipe()
            msg_r, msg_w = os.pipe()
            argv = ["--rank", str(r), "--size", str(size), "--backend", backend, "--store-port", str(store_port),
                    "--msg-fd", str(msg_w), "--cmd-fd", str(cmd_r), "--timeout", str(opts["op_timeout"]),
                    "--warmup", str(opts["warmup"]), "--small-iters", str(opts["small_iters"]),
                    "--busbw", json.dumps([[b["op"], b["size_bytes"], b["warmup"], b["iters"]]
                                           for b in opts["busbw"]])]
            specs.append({"argv": argv, "cmd_fd": cmd_r, "msg_fd": msg_w, "log": self.logs[r]})
            self.cmd[r] = cmd_w
            self.fds[msg_r] = r
            self.partial[msg_r] = b""
            self.selector.register(msg_r, selectors.EVENT_READ, r)
        try:
            if start_method == "spawn":
                for spec in specs:
                    with open(spec["log"], "wb") as log:
                        self.procs.append(subprocess.Popen(
                            [*RANK_PROGRAM, "--_rank", *spec["argv"]],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            pass_fds=(spec["cmd_fd"], spec["msg_fd"]), env=env, cwd=REPO))
            elif start_method == "fork":
                with open(self.zygote_log, "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [*RANK_PROGRAM, "--_zygote", json.dumps(specs)],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        pass_fds=[fd for spec in specs for fd in (spec["cmd_fd"], spec["msg_fd"])],
                        env=env, cwd=REPO))
            else:
                raise ValueError(f"start method {start_method!r}: expected fork or spawn")
        finally:
            for spec in specs:
                os.close(spec["cmd_fd"])
                os.close(spec["msg_fd"])

    def send(self, command: str) -> None:
        for fd in self.cmd.values():
            try:
                os.write(fd, command.encode() + b"\n")
            except OSError:
                pass

    def wait(self, kind: str, phase: str, timeout: float) -> Dict[int, dict]:
        deadline = time.monotonic() + timeout
        got = self.replies[kind]
        while len(got) < self.size:
            if self.replies["error"]:
                r, msg = sorted(self.replies["error"].items())[0]
                settle = time.monotonic() + 2  # let the rank write its traceback and exit
                while r not in self.closed and time.monotonic() < settle:
                    self._drain(0.1)
                raise DidNotFinish(phase, f"{msg.get('error', '?')}; rank {r} log tail:\n{self.log_tail(r)}")
            dead = [r for r in self.closed if r not in got]
            if dead:
                raise DidNotFinish(phase, f"rank {dead[0]} exited ({len(dead)} ranks gone); log tail:\n"
                                          f"{self.log_tail(dead[0])}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.size) if r not in got]
                steps = collections.Counter(self.replies["progress"].get(r, {}).get("step", "no step done")
                                            for r in missing)
                raise DidNotFinish(phase, f"{len(missing)} of {self.size} ranks not done after {timeout:.0f} s "
                                          f"(first: {missing[:8]}); their last step: "
                                          + "; ".join(f"{n} x {step!r}" for step, n in steps.most_common())
                                          + f"; rank {missing[0]} log tail:\n{self.log_tail(missing[0])}")
            self._drain(min(left, 0.5))
        return got

    def _drain(self, timeout: float = 0) -> None:
        for key, _ in self.selector.select(timeout):
            fd, r = key.fd, key.data
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self.selector.unregister(fd)
                self.closed.add(r)
                continue
            buf = self.partial[fd] + data
            *lines, self.partial[fd] = buf.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                self.replies[msg["kind"]][r] = msg
                if msg["kind"] == "start":
                    self.pids[r] = msg["pid"]

    def log_tail(self, r: int, chars: int = 1500) -> str:
        """The end of rank r's log (or of the zygote's, where the rank wrote none)."""
        for path in (self.logs[r], self.zygote_log):
            try:
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    if f.tell() == 0:
                        continue
                    f.seek(max(0, f.tell() - chars))
                    return f.read().decode("utf-8", "replace")
            except OSError:
                continue
        return "(no log)"

    def kill(self) -> None:
        """Kills every rank (by the pid it reported) and the processes started here."""
        import signal

        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for fd in self.cmd.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.cmd.clear()
        for fd in list(self.fds):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)
        self.fds.clear()
        self.selector.close()


def rank_env(backend: str, extra: Optional[dict] = None, nics: str = NICS) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("RECCL_NICS", nics)
    env["GLOO_SOCKET_IFNAME"] = env.get("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def extension_identity(env: Optional[dict] = None) -> dict:
    """The torch_reccl._C the ranks will load (first match on the ranks' PYTHONPATH, then the
    repository): path, mtime and a short sha256 over it and the libnccl-net-reccl.so it links
    (core and transports live there), so a record says which build it measured (the extension
    may be rebuilt between jobs)."""
    import glob
    import hashlib

    roots = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p] + [REPO]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "torch_reccl", "_C*.so"))):
            try:
                digest = hashlib.sha256()
                for part in (path, os.path.join(os.path.dirname(path), "libnccl-net-reccl.so")):
                    with open(part, "rb") as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            digest.update(block)
                return {"path": path, "sha256": digest.hexdigest()[:12],
                        "mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))}
            except OSError:
                continue
    return {"path": None}


def machine_load(samples: int = 5, interval_s: float = 0.1) -> dict:
    """Other work on the machine, read before a job (when none of ours run): from
    /proc/loadavg, the 1-minute load average, and the runnable threads (mean of a few
    samples; this reader excluded) and all threads."""
    runnable, fields = [], []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                fields = f.read().split()
            runnable.append(int(fields[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return {}
        if i + 1 < samples:
            time.sleep(interval_s)
    return {"loadavg_1m": float(fields[0]), "runnable": sum(runnable) / len(runnable),
            "threads": int(fields[3].split("/")[1])}


class Job:
    """The launcher's side of one running job: enters phases (timing each, telling the
    proxy and ``progress``), sends their commands and waits, within the bounds, for every
    rank's reply."""

    def __init__(self, size: int, store, proxy: CountingProxy, label: str, phase_timeout: float,
                 deadline: float, phase_times: Dict[str, float], progress=None) -> None:
        self.size, self.store, self.proxy = size, store, proxy
        self.ranks: Optional[_Ranks] = None  # set once they are started
        self.pids: List[int] = []
        self.phase = "start"
        self._label, self._phase_timeout, self._deadline = label, phase_timeout, deadline
        self._phase_times, self._progress = phase_times, progress
        self._phase_start = time.monotonic()

    def enter(self, name: str) -> None:
        now = time.monotonic()
        self._phase_times[self.phase] = now - self._phase_start
        self.phase, self._phase_start = name, now
        self.proxy.set_phase(name)
        if self._progress:
            self._progress(f"{self._label}: {name}")

    def end(self) -> None:
        """Closes the phase in progress (the job did not finish it)."""
        self._phase_times[self.phase] = time.monotonic() - self._phase_start

    def bound(self, seconds: float) -> float:
        """A phase's bound: the smaller of its own and what is left of the whole job."""
        return max(1.0, min(seconds, self._deadline - time.monotonic()))

    def step(self, name: str, command: Optional[str] = None) -> Tuple[Dict[int, dict], float]:
        """Enters phase ``name``, sends ``command`` (default: the name) and waits for every
        rank's reply of that kind; the replies by rank and the seconds from the command."""
        command = command or name
        self.enter(name)
        t0 = time.monotonic()
        self.ranks.send(command)
        replies = self.ranks.wait(command, name, self.bound(self._phase_timeout))
        return replies, time.monotonic() - t0

    def per_rank(self, fn) -> list:
        """fn(pid) for every rank; a rank gone from /proc ends the job as "did not finish"."""
        out = []
        for r, pid in enumerate(self.pids):
            try:
                out.append(fn(pid))
            except OSError as error:
                raise DidNotFinish(self.phase, f"rank {r} (pid {pid}) is gone: {error}") from None
        return out

    @staticmethod
    def errors(replies: Dict[int, dict]) -> List[str]:
        """The wrong results the ranks reported in one phase."""
        return [f"rank {r}: {e}" for r, m in sorted(replies.items()) for e in m["errors"]]


def run_job(backend: str, size: int, *, idle_s: float = 10.0, settle_s: float = 1.0,
            phase_timeout: float = 180.0, start_timeout: Optional[float] = None, op_timeout: float = 120.0,
            warmup: int = 10, small_iters: int = 50, busbw_iters: int = 5,
            busbw: Sequence[Tuple[str, int]] = (("all_reduce", 16 << 20),), env: Optional[dict] = None,
            log_dir: Optional[str] = None, skip_collectives: bool = False,
            total_timeout: Optional[float] = None, start_method: str = "fork", progress=None) -> dict:
    """One job: N ranks of one backend through every phase; a dict of everything measured.

    ``busbw`` lists the (op, size in bytes) whose busbw is measured after the 4-byte
    latency, each in a phase of its own ("busbw <op> <size>", bounded by
    ``phase_timeout``), with the op counts of busbw_counts(size, busbw_iters, warmup).

    ``status`` is "ok" or "did not finish (<phase>)" (``detail`` says why; what was
    measured before that phase is kept). ``progress`` (a callable taking a string)
    is told when each phase starts. ``total_timeout`` bounds the whole job too: a
    phase gets the smaller of its own bound and what is left of the total.
    """
    import torch.distributed as dist

    if size < 2 or size % 2:
        raise ValueError(f"ranks must be even and >= 2 (tensor-parallel pairs), not {size}")
    log_dir = log_dir or tempfile.mkdtemp(prefix="reccl-scale-")
    os.makedirs(log_dir, exist_ok=True)
    env = env if env is not None else rank_env(backend)
    nics = [n for n in env.get("RECCL_NICS", "").split(",") if n]
    plan = [entry for op, nbytes in busbw for entry in scale_busbw.busbw_plan([op], [nbytes], busbw_iters, warmup)]
    opts = {"op_timeout": op_timeout, "warmup": warmup, "small_iters": small_iters, "busbw": plan}
    groups = scale_setup.group_layout(size)
    result: dict = {
        "backend": backend, "ranks": size, "status": "ok", "log_dir": log_dir, "nics": len(nics),
        "groups_total": 1 + len(groups), "groups_per_rank": 1 + sum(0 in g for _, g in groups),
        "idle_s": idle_s, "settle_s": settle_s, "start_method": start_method, "busbw_plan": plan,
    }
    result["load_before"] = machine_load()
    if backend == "reccl":
        result["extension"] = extension_identity(env)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=phase_timeout),
                          wait_for_workers=False)
    proxy = CountingProxy(store.port).start()
    ranks = None
    job_start = time.monotonic()
    job_deadline = job_start + total_timeout if total_timeout else float("inf")
    result["phase_s"] = phase_times = {}
    job = Job(size, store, proxy, f"{backend} N={size}", phase_timeout, job_deadline, phase_times, progress)

    try:
        job.enter("start")
        ranks = job.ranks = _Ranks(backend, size, proxy.port, opts, env, log_dir, start_method)
        started = ranks.wait("start", job.phase, job.bound(start_timeout or max(phase_timeout, 3.0 * size)))
        job.pids = [started[r]["pid"] for r in range(size)]
        result["threads_torch"] = max(m["threads_torch"] for m in started.values())
        result["threads_imported"] = max(m["threads_imported"] for m in started.values())
        result["fd_table_at_start"] = min(m["fd_table_at_start"] for m in started.values())

        scale_setup.record(job, result)
        scale_idle.record(job, settle_s, idle_s, result)
        if not skip_collectives:
            scale_latency.record(job, result)
            scale_busbw.record(job, plan, result)
        job.enter("done")
        ranks.send("exit")
    except DidNotFinish as error:
        job.end()
        result["status"] = f"did not finish ({error.phase})"
        result["detail"] = error.detail
    finally:
        result["total_s"] = time.monotonic() - job_start
        if backend == "reccl" and extension_identity(env) != result["extension"]:
            result["extension_changed_during_job"] = extension_identity(env)
        result["store"] = {k: {f: v[f] for f in ("reads", "bytes", "requests", "unparsed_reads", "connections",
                                                  "by_type", "by_key", "samples")}
                           for k, v in proxy.counts().items()}
        if ranks is not None:
            ranks.kill()
        proxy.stop()
        del store
    return result


def rank_program(argv: List[str]) -> int:
    """The rank program's command line: ``--_rank ARGS`` or ``--_zygote SPECS``."""
    if argv[:1] == ["--_rank"]:
        return rank_main(argv[1:])
    if argv[:1] == ["--_zygote"] and len(argv) == 2:
        return zygote_main(argv[1])
    print("usage: python -m torch_reccl.bench.scaling.runner (--_rank ARGS | --_zygote SPECS); "
          "bench/scale.py starts it", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(rank_program(sys.argv[1:]))

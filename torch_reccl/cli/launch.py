"""Start the ranks of a small job and talk to them: ``reccl bench`` and ``reccl drill``.

A *placement* says where the ranks run and which NICs they use:

* :class:`LoopbackPlacement` (any user): every rank on this machine, the NICs are
  the loopback addresses 127.0.0.1, 127.0.0.2, ... (one per rail), the store on
  127.0.0.1;
* :class:`FabricPlacement` (root): rank *h* in host *h* of an emulated
  :class:`~torch_reccl.fabric.Fabric`, NICs ``eth0..eth{K-1}``, the store on host
  0's ``mgmt0`` (never faulted).

Ranks get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so a rank program also runs under torchrun unchanged.

Line protocol: a rank reports by printing ``@reccl {json}`` lines on stdout
(:func:`report`); everything else it prints is kept as its log, for error
messages. The driver may send JSON lines to a rank's stdin (:meth:`Job.send`),
which the rank reads with :func:`listen_for_commands`.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

MARKER = "@reccl "
LOG_LINES = 60            # last lines of each rank's output kept for error messages
FABRIC_STORE_PORT = 29500  # a fresh network namespace has every port free
STOP_GRACE_S = 10.0        # a rank asked to stop gets this long before SIGTERM, then SIGKILL


class LaunchError(RuntimeError):
    """The job could not be started, or a rank failed."""


# ---------------------------------------------------------------- rank side


def report(kind: str, **fields) -> None:
    """Rank side: one message to the driver (a line on stdout)."""
    line = MARKER + json.dumps({"kind": kind, **fields}, sort_keys=True)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def listen_for_commands(handle: Callable[[dict], None]) -> threading.Thread:
    """Rank side: calls ``handle(message)`` for every JSON line the driver sends,
    on a daemon thread, until stdin closes."""

    def run() -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                print(f"[reccl] ignoring a command that is not JSON: {line!r}", file=sys.stderr)
                continue
            try:
                handle(message)
            except Exception as error:  # a bad command must not kill the rank
                print(f"[reccl] command {message!r} failed: {error!r}", file=sys.stderr)
                report("command_failed", command=message, error=repr(error))

    thread = threading.Thread(target=run, name="reccl-commands", daemon=True)
    thread.start()
    return thread


def spawn_bounded(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """torch.multiprocessing.spawn with a bound: ranks still running after
    ``timeout_s`` are killed and TimeoutError is raised (a rank's exception is
    re-raised as spawn does)."""
    import torch.multiprocessing as mp

    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{nprocs} ranks of {getattr(fn, '__name__', fn)} did not finish "
                               f"within {timeout_s:.0f} s; killed")


# ---------------------------------------------------------------- CUDA ranks


def cuda_net_env(backend: str) -> Dict[str, str]:
    """The environment of CUDA ranks on one machine over ``backend``: "reccl" is
    NCCL through torch_reccl's net plugin, "nccl" NCCL's own socket transport.
    NCCL's peer-to-peer and shared-memory transports are off (with each rank's own
    NCCL_HOSTID, :func:`cuda_rank_env`) so every byte crosses the network layer as
    between hosts; NVLink multicast stays off (on a shared GPU machine a program
    using it can take the host's GPUs out of service)."""
    if backend not in ("reccl", "nccl"):
        raise ValueError(f"CUDA ranks run over reccl or nccl, not {backend!r}")
    return {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
            "NCCL_NET": "ReCCL" if backend == "reccl" else "Socket"}


def cuda_problem(ranks: int = 1) -> Optional[str]:
    """Why --device cuda cannot run here, or None: ``ranks`` ranks of one GPU
    each need as many GPUs (1, the default, where ranks share the GPUs)."""
    try:
        import torch
    except ImportError as error:
        return f"torch is not importable: {error}"
    if not torch.cuda.is_available():
        return (f"--device cuda needs CUDA GPUs, and this torch ({torch.__version__}) sees none; "
                f"use --device cpu")
    if torch.cuda.device_count() < ranks:
        return (f"--device cuda runs one rank per GPU: {ranks} ranks need {ranks} GPUs, "
                f"this machine has {torch.cuda.device_count()}; use --ranks "
                f"{torch.cuda.device_count()}")
    return None


def cuda_rank_env(rank: int, label: str) -> Dict[str, str]:
    """Rank ``rank``'s own NCCL host: ranks sharing a machine (or a GPU) look like hosts."""
    return {"NCCL_HOSTID": f"{label}-{rank}"}


# ---------------------------------------------------------------- placements


# Store ports come from below Linux's ephemeral range (32768-60999 by default):
# a port the kernel hands out for bind(0) - as reccl's own listeners on the
# loopback NICs do - could be taken again before the store binds it.
STORE_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port that is free now, outside the ephemeral range."""
    import random

    for port in random.sample(STORE_PORTS, 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {STORE_PORTS.start}..{STORE_PORTS.stop - 1} for the store")


class LoopbackPlacement:
    """Every rank on this machine; NIC r is 127.0.0.{r+1}."""

    kind = "loopback"

    def __init__(self, ranks: int, rails: int):
        if not 1 <= rails <= 254:
            raise ValueError(f"rails must be 1..254 for loopback NICs; got {rails}")
        self.ranks = ranks
        self.rails = rails
        self.port = free_port()

    def nic_names(self, rank: int) -> List[str]:
        """Names that inject_fault and stats() use for this rank's NICs."""
        return [f"lo:127.0.0.{r + 1}" for r in range(self.rails)]

    def env(self, rank: int) -> Dict[str, str]:
        return {
            "RECCL_NICS": ",".join(f"127.0.0.{r + 1}" for r in range(self.rails)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
        }

    def control_ifname(self) -> str:
        """The interface of set-up traffic (store, NCCL's bootstrap)."""
        return "lo"

    def popen(self, rank: int, argv: List[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(argv, **kwargs)

    def describe(self) -> str:
        nics = ",".join(f"127.0.0.{r + 1}" for r in range(self.rails))
        return f"{self.ranks} ranks on this machine, NICs {nics} (loopback)"


class FabricPlacement:
    """Rank h in host h of an emulated fabric that is up."""

    kind = "fabric"

    def __init__(self, fabric):
        self.fabric = fabric
        self.ranks = fabric.hosts
        self.rails = fabric.rails
        self.port = FABRIC_STORE_PORT

    def nic_names(self, rank: int) -> List[str]:
        return [self.fabric.nic_name(r) for r in range(self.rails)]

    def env(self, rank: int) -> Dict[str, str]:
        nics = ",".join(self.nic_names(rank))
        return {
            "RECCL_NICS": nics,
            "MASTER_ADDR": self.fabric.mgmt_ip(0),
            "MASTER_PORT": str(self.port),
            # baselines without failover use the first data NIC, like a job pinned to one rail
            "GLOO_SOCKET_IFNAME": self.fabric.nic_name(0),
            "NCCL_SOCKET_IFNAME": self.fabric.nic_name(0),
        }

    def control_ifname(self) -> str:
        """The interface of set-up traffic (store, NCCL's bootstrap): never faulted."""
        return self.fabric.mgmt_name

    def popen(self, rank: int, argv: List[str], **kwargs) -> subprocess.Popen:
        return self.fabric.popen(rank, argv, **kwargs)

    def describe(self) -> str:
        f = self.fabric
        rate = f"{f.rate_mbit:g} Mbit/s per NIC" if f.rate_mbit else "no rate cap"
        tcp = f"TCP {f.tcp_congestion}" if f.tcp_congestion else "TCP as this machine"
        return (f"{f.hosts} hosts x {f.rails} rails in emulated fabric {f.name!r} "
                f"(one rank per host, NICs {','.join(self.nic_names(0))}, {rate}, {tcp})")


# ---------------------------------------------------------------- the job


class Job:
    """The rank processes of one run and the messages they report.

    ``with Job(...) as job:`` guarantees every rank is gone on exit. ``names``
    (default "rank R") name the processes in logs; ``per_rank_args(R)`` is
    appended to process R's ``argv``.
    """

    def __init__(self, placement, argv: List[str], env: Optional[Dict[str, str]] = None,
                 per_rank_env: Optional[Callable[[int], Dict[str, str]]] = None,
                 commands: bool = False, log_dir: Optional[str] = None,
                 names: Optional[List[str]] = None,
                 per_rank_args: Optional[Callable[[int], List[str]]] = None):
        self.placement = placement
        # what messages and logs call each process: "rank R" unless named
        self.names = names or [f"rank {r}" for r in range(placement.ranks)]
        if len(self.names) != placement.ranks:
            raise ValueError(f"{len(self.names)} names for {placement.ranks} processes")
        # every line a process prints that is not a message, in full (rank<R>.log, or
        # <name>.log), besides the tail kept
        self._log_files = [open(os.path.join(log_dir, f"{name.replace(' ', '')}.log"), "a")
                           for name in self.names] if log_dir else []
        self.ranks = placement.ranks
        self._messages: "queue.Queue[Tuple[int, dict]]" = queue.Queue()
        self._logs: List[Deque[str]] = [collections.deque(maxlen=LOG_LINES) for _ in range(self.ranks)]
        self._procs: List[subprocess.Popen] = []
        self._readers: List[threading.Thread] = []
        self._send_lock = threading.Lock()
        # one thread per rank unless the user asked otherwise: ranks share the cores
        base = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, base.get("PYTHONPATH", "")) if p)
        try:
            for rank in range(self.ranks):
                rank_env = {**base, **placement.env(rank),
                            "RANK": str(rank), "WORLD_SIZE": str(self.ranks),
                            # every rank is on this one machine (GPU index for --device cuda)
                            "LOCAL_RANK": str(rank),
                            **(per_rank_env(rank) if per_rank_env else {})}
                proc = placement.popen(
                    rank, argv + (per_rank_args(rank) if per_rank_args else []), env=rank_env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    stdin=subprocess.PIPE if commands else subprocess.DEVNULL,
                    text=True, bufsize=1)
                self._procs.append(proc)
                reader = threading.Thread(target=self._read, args=(rank, proc),
                                          name=f"reccl-rank{rank}-out", daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(MARKER):
                try:
                    self._messages.put((rank, json.loads(line[len(MARKER):])))
                    continue
                except ValueError:
                    pass
            self._logs[rank].append(line)
            if self._log_files:
                self._log_files[rank].write(line + "\n")
        proc.stdout.close()
        if self._log_files:
            self._log_files[rank].close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -------------------------------------------------------------- messages
    def next_message(self, timeout: float) -> Optional[Tuple[int, dict]]:
        """The next (rank, message), or None after ``timeout`` seconds."""
        try:
            return self._messages.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def send(self, rank: int, message: dict) -> None:
        """One command to a rank (the job must have been started with commands=True)."""
        proc = self._procs[rank]
        if proc.stdin is None:
            raise LaunchError("this job was started without a command channel")
        with self._send_lock:
            try:
                proc.stdin.write(json.dumps(message) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as error:
                raise LaunchError(f"rank {rank} is not reading commands (exited?): {error}")

    # -------------------------------------------------------------- processes
    def pids(self) -> List[int]:
        """The rank processes' ids, by rank."""
        return [proc.pid for proc in self._procs]

    def exit_codes(self) -> List[Optional[int]]:
        return [proc.poll() for proc in self._procs]

    def failed_ranks(self) -> List[int]:
        """Ranks that exited with a nonzero status."""
        return [r for r, code in enumerate(self.exit_codes()) if code not in (None, 0)]

    def all_exited(self) -> bool:
        return all(code is not None for code in self.exit_codes())

    def wait(self, timeout: float) -> bool:
        """Waits (bounded) until every rank exited; True when they have."""
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        for reader in self._readers:  # their last lines are in the queue after this
            reader.join(timeout=max(0.1, deadline - time.monotonic()))
        return True

    def join_output(self, ranks: List[int], timeout: float) -> None:
        """Waits (bounded) until the output of exited ``ranks`` is read to its end,
        so that their last messages are in the queue."""
        deadline = time.monotonic() + timeout
        for rank in ranks:
            self._readers[rank].join(timeout=max(0.0, deadline - time.monotonic()))

    def log(self, rank: int) -> str:
        return "\n".join(self._logs[rank])

    def logs(self, ranks: Optional[List[int]] = None, lines: int = 25) -> str:
        out = []
        for rank in (range(self.ranks) if ranks is None else ranks):
            tail = list(self._logs[rank])[-lines:]
            code = self._procs[rank].poll() if rank < len(self._procs) else None
            status = "running" if code is None else f"exit code {code}"
            out.append(f"--- {self.names[rank]} ({status}), last lines of its output:")
            out.extend("    " + line for line in tail) if tail else out.append("    (no output)")
        return "\n".join(out)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ends every rank still running: waits ``grace_s``, then SIGTERM, then SIGKILL."""
        for proc in self._procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace_s
        for signal_step in ("wait", "terminate", "kill"):
            for proc in self._procs:
                if proc.poll() is not None:
                    continue
                if signal_step == "terminate":
                    proc.terminate()
                elif signal_step == "kill":
                    proc.kill()
            for proc in self._procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()) if signal_step == "wait" else 5.0)
                except subprocess.TimeoutExpired:
                    pass
            if self.all_exited():
                break
        for reader in self._readers:
            reader.join(timeout=2.0)


# ---------------------------------------------------------------- cleanup on signals


class terminated_by_signal:
    """``with terminated_by_signal():`` SIGTERM and SIGHUP raise KeyboardInterrupt in
    the main thread (as Ctrl-C does), so every ``finally`` runs: ranks are stopped and
    fabrics torn down. The previous handlers come back on exit."""

    SIGNALS = ("SIGTERM", "SIGHUP")

    def __enter__(self):
        import signal

        self._previous = {}
        self._pid = os.getpid()
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    def _raise(self, signum, _frame):
        import signal

        if os.getpid() != self._pid:
            # A forked child that has not exec'ed (pyroute2's netns helpers) inherits
            # this handler; it must die as by default, not run our cleanup.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc) -> None:
        import signal

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def unique_fabric_name(prefix: str) -> str:
    """A fabric name (at most 4 chars of [a-z0-9]) unique to this process."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    pid, tail = os.getpid(), ""
    for _ in range(4 - len(prefix)):
        pid, d = divmod(pid, 36)
        tail = digits[d] + tail
    return prefix + tail

"""Shared helpers for the transport, wire-fuzz and config tests.

NIC health is process-global: a fault injected by one test would leak into the
next, so every test module that injects faults uses ``healed_nics`` (it heals
every NIC the process knows after the test). Events are collected with the
``events`` fixture, which filters by connection id, so stale events from earlier
tests never satisfy a later test's expectations.

``Fabric`` is two hosts with two NICs each over either transport (TCP on
loopback addresses, or the IB verbs emulation); the NICs of the two hosts have
different names, so a fault on one host's NIC is seen by that host only, in one
process. test_transport_contract.py runs over both kinds, test_ib_transport.py
over IB (the ``fabric`` fixture).

The GPU checks (tests/gpu, marker ``gpu``) skip with the reason in pytest's
summary where there is no CUDA, no NCCL or too few GPUs (``needs_gpus``); their
two ranks look like two hosts to NCCL (``two_host_env``) and share one GPU where
there is only one (``gpu_of``).
"""
from __future__ import annotations

import collections
import contextlib
import gc
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
# Peer scripts, harnesses and stand-ins (tests/helpers) are imported by name, as they
# import each other when run as scripts. What the tests share with bench/ is in the
# package (torch_reccl.bench); a bench script a test needs whole runs as a subprocess.
HELPERS = os.path.join(TESTS, "helpers")
sys.path.insert(0, HELPERS)

# Tests that need a Debian package carry a marker; where it is missing they skip
# with the reason and the install line (`bash scripts/test.sh` as root installs both).
SYSTEM_NEEDS = {
    "needs_nft": ("the nft command (blackholes and lossy NICs)", "nftables"),
    "needs_verbs_headers": ("a build compiled against the libibverbs headers", "libibverbs-dev"),
}


def _missing(marker: str) -> bool:
    if marker == "needs_nft":
        from torch_reccl.fabric.fabric import nft_command

        return nft_command() is None
    return not native().ib_verbs_headers_compiled()


def pytest_runtest_setup(item):
    for marker, (what, package) in SYSTEM_NEEDS.items():
        if item.get_closest_marker(marker) is not None and _missing(marker):
            rebuild = " then rebuild (pip install -e .)" if marker == "needs_verbs_headers" else ""
            pytest.skip(f"needs {what}: apt-get install {package}{rebuild}, "
                        f"or run `bash scripts/test.sh` as root, which installs it")


PRIMARY = "lo:127.0.0.1"
BACKUP = "lo:127.0.0.2"
NICS = "127.0.0.1,127.0.0.2"


def reccl_env(**overrides) -> Dict[str, str]:
    """A RECCL_* settings dict for two loopback NICs; overrides use short names."""
    env = {
        "RECCL_NICS": NICS,
        "RECCL_HEARTBEAT_MS": "300",
        "RECCL_CONNECT_TIMEOUT_MS": "2000",
        "RECCL_NO_PATH_TIMEOUT_MS": "5000",
    }
    for key, value in overrides.items():
        env[key if key.startswith("RECCL_") else "RECCL_" + key] = str(value)
    return env


def native():
    """torch_reccl._C."""
    module = sys.modules.get("torch_reccl._C")
    if module is not None:
        return module
    from torch_reccl._native import native as load

    return load()


def testing():
    """torch_reccl._testing: the verbs and CUDA emulations (never loaded by NCCL)."""
    from torch_reccl._native import testing as load

    return load()


def heal_all() -> None:
    c = native()
    for name in c.nic_stats():
        c.inject_fault(name, "up")


# --------------------------------------------------------------------------- data


def message(seed: int, index: int, size: int) -> bytes:
    """Deterministic random contents of message `index` of a plan."""
    import numpy as np

    return np.random.default_rng([seed, index]).bytes(size)


def plan_sizes(seed: int, count: int, max_bytes: int, big: int = 0) -> List[int]:
    """`count` sizes, log-uniform in 1..max_bytes, with a 0-byte, a 1-byte and
    `big` messages of exactly max_bytes*8 spread through the plan."""
    import numpy as np

    rng = np.random.default_rng([seed, 999])
    sizes = [int(s) for s in np.exp(rng.uniform(0, np.log(max_bytes), count)).astype(np.int64)]
    if count > 2:
        sizes[1] = 0
        sizes[2] = 1
    for k in range(big):
        sizes[(k + 1) * count // (big + 1)] = max_bytes * 8
    return sizes


def run_sender(conn, sizes, seed, window=8, timeout=30.0,
               on_done: Optional[Callable[[int], None]] = None) -> int:
    """Streams the plan; every send must complete with its exact size."""
    pending = collections.deque()
    total = 0

    def finish():
        index, request, data = pending.popleft()
        got = request.wait(timeout)
        assert got == len(data), f"send {index}: completed with {got} of {len(data)} bytes"
        if on_done is not None:
            on_done(index)

    for index, size in enumerate(sizes):
        while len(pending) >= window:
            finish()
        data = message(seed, index, size)
        pending.append((index, conn.isend(data), data))
        total += size
    while pending:
        finish()
    return total


def run_receiver(conn, sizes, seed, window=8, timeout=30.0, slack=0,
                 on_done: Optional[Callable[[int], None]] = None) -> int:
    """Receives the plan into buffers `slack` bytes larger than each message and
    checks size, order and every byte."""
    pending = collections.deque()
    total = 0

    def finish():
        index, request, buf = pending.popleft()
        got = request.wait(timeout)
        expected = message(seed, index, sizes[index])
        assert got == len(expected), f"message {index}: {got} bytes, expected {len(expected)}"
        if bytes(buf[:got]) != expected:
            diff = next(i for i in range(got) if buf[i] != expected[i])
            raise AssertionError(f"message {index} ({got} bytes) differs from byte {diff}")
        if on_done is not None:
            on_done(index)

    for index, size in enumerate(sizes):
        while len(pending) >= window:
            finish()
        buf = bytearray(size + slack)
        pending.append((index, conn.irecv(buf), buf))
        total += size
    while pending:
        finish()
    return total


def in_thread(fn, *args, **kwargs):
    """Starts fn in a thread; returns join() that re-raises its exception."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in join
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout=60.0):
        thread.join(timeout)
        assert not thread.is_alive(), f"{fn.__name__} still running after {timeout} s"
        if "error" in box:
            raise box["error"]
        return box.get("result")

    return join


def stream(send, recv, sizes, seed, window=8, on_sent=None, slack=0):
    """Streams sizes over send->recv (receiver in a thread); checks every byte."""
    join = in_thread(run_receiver, recv, sizes, seed, window, 30.0, slack)
    sent = run_sender(send, sizes, seed, window, 30.0, on_done=on_sent)
    received = join()
    assert sent == received == sum(sizes)


def registered_stream(send_transport, recv_transport, send, recv, sizes, seed, register_send=True,
                      register_recv=True, window=8, on_sent=None):
    """Streams `sizes` from one registered arena into another (each side only
    if asked), message i at its own offset; checks every byte of every message."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = max(sum(sizes), 1)
    src = bytearray(total)
    for i, size in enumerate(sizes):
        src[offsets[i]:offsets[i] + size] = message(seed, i, size)
    dst = bytearray(b"\xa5" * total)
    src_reg = send_transport.register(src) if register_send else None
    dst_reg = recv_transport.register(dst) if register_recv else None
    assert (src_reg is not None) == register_send and (dst_reg is not None) == register_recv
    src_view, dst_view = memoryview(src), memoryview(dst)

    def receive():
        pending = []
        for i, size in enumerate(sizes):
            while len(pending) >= window:
                index, request = pending.pop(0)
                assert request.wait(30) == sizes[index]
            pending.append((i, recv.irecv(dst_view[offsets[i]:offsets[i] + size], registration=dst_reg)))
        for index, request in pending:
            assert request.wait(30) == sizes[index]

    join = in_thread(receive)
    pending = []
    for i, size in enumerate(sizes):
        while len(pending) >= window:
            index, request = pending.pop(0)
            assert request.wait(30) == sizes[index]
            if on_sent is not None:
                on_sent(index)
        pending.append((i, send.isend(src_view[offsets[i]:offsets[i] + size], registration=src_reg)))
    for index, request in pending:
        assert request.wait(30) == sizes[index]
    join()
    for i, size in enumerate(sizes):
        if dst[offsets[i]:offsets[i] + size] != src[offsets[i]:offsets[i] + size]:
            raise AssertionError(f"message {i} ({size} bytes) differs")
    return src, dst


def socket_fds() -> int:
    from torch_reccl.bench import procstat

    return procstat.fds()[1]


@contextlib.contextmanager
def socket_count():
    """Yields sockets() -> how many sockets this process opened (less closed)
    since the block began. The count is process-wide, so nothing else may close
    sockets meanwhile: a transport an earlier test left in a reference cycle (a
    traceback holding its test's frame, say) keeps its own 3 sockets (2 acceptors,
    netlink) until the garbage collector runs, which in a long session can be in
    the middle of a count (seen: 85 sockets where 88 were open). So garbage is
    collected first and the collector stays off until the block ends."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        base = socket_fds()
        yield lambda: socket_fds() - base
    finally:
        if was_enabled:
            gc.enable()


def wait_until(predicate, timeout, interval=0.02):
    """Polls `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class RankProcesses:
    """Base of a test's rank processes (``self.procs``, one Popen per rank, stderr
    piped): kills those still running and collects their stderr for a failure message."""

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def logs(self) -> str:
        self.kill()
        text = []
        for rank, proc in enumerate(self.procs):
            try:
                _, err = proc.communicate(timeout=5)
            except Exception:  # noqa: BLE001 - best effort for a failure message
                err = ""
            text.append(f"--- rank {rank}\n{(err or '')[-3000:]}")
        return "\n".join(text)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOPs `pid` and returns once it is really stopped: the signal is
    asynchronous, and a test that goes on at once may still be answered."""
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    assert wait_until(stopped, timeout, interval=0.005), f"process {pid} did not stop"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def healed_nics():
    """Heals every NIC of this process after the test (faults are process-global)."""
    native()
    heal_all()
    yield
    heal_all()


class EventLog:
    """Every event delivered by torch_reccl.on_event while the fixture is active."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events = []

    def __call__(self, event):
        with self._lock:
            self._events.append(event)

    def all(self):
        with self._lock:
            return list(self._events)

    def of(self, kind=None, connection=None, **fields):
        out = []
        for event in self.all():
            if kind is not None and event.kind != kind:
                continue
            if connection is not None and event.connection != connection:
                continue
            if any(getattr(event, k) != v for k, v in fields.items()):
                continue
            out.append(event)
        return out

    def wait_for(self, timeout, kind=None, connection=None, count=1, **fields):
        """Polls until `count` matching events arrived or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.of(kind, connection, **fields)
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)


@pytest.fixture
def events():
    import torch_reccl
    from torch_reccl.events import flush_events

    flush_events()  # old events go to old handles, not to this log
    log = EventLog()
    handle = torch_reccl.on_event(log)
    yield log
    handle.remove()


@pytest.fixture
def pair_factory():
    """make(env, nic=0) -> (transport, listener, send, recv), all closed after the test."""
    from torch_reccl.transport import Transport

    made = []

    def make(env=None, nic=0):
        transport = Transport(env or reccl_env())
        listener = transport.listen(nic)
        send = transport.connect(nic, listener.handle)
        send.wait_ready(10)
        recv = listener.accept(10)
        made.append((send, recv, listener))
        return transport, listener, send, recv

    yield make
    heal_all()
    for send, recv, listener in made:
        close_both(send, recv)
        listener.close()


# --------------------------------------------------------------------------- two hosts

# Fixed names: NIC health is process-global and holds a bounded number of NICs,
# so every test reuses these. IB: emulated RDMA devices (each IbTransport resets
# their link state from the emulation's ports when it starts). TCP: loopback
# addresses, two per host, so a fault on one host's NIC is seen by that host only.
A0, A1, B0, B1 = "ib-a-0", "ib-a-1", "ib-b-0", "ib-b-1"
TCP_HOSTS = {"a": "127.0.0.1,127.0.0.2", "b": "127.0.0.3,127.0.0.4"}
IB_CHUNK = 64 << 10


def ib_env(devices, **overrides) -> Dict[str, str]:
    """reccl_env for an IbTransport over emulated `devices` (no RECCL_NICS)."""
    env = reccl_env(
        RECCL_IB_HCA=",".join(devices),
        RECCL_CHUNK_BYTES=IB_CHUNK,
        # 4.096 us * 2^12 = 16.8 ms per try, 8 tries: retry-exceeded after ~134 ms.
        RECCL_IB_TIMEOUT=12,
        RECCL_IB_RETRY_CNT=7)
    del env["RECCL_NICS"]
    for key, value in overrides.items():
        env[key if key.startswith("RECCL_") else "RECCL_" + key] = str(value)
    return env


class Fabric:
    """Two hosts, a and b, each a transport with two NICs (rail 0 and rail 1).

    kind "ib": two IbTransports over one ``_testing.IbEmulation`` with devices A0, A1
    (host a) and B0, B1 (host b). kind "tcp": two TCP Transports, host a on
    127.0.0.1/127.0.0.2, host b on 127.0.0.3/127.0.0.4; both in one process, so
    their paths take same-host reads (payloads of 16 KiB or more read from the
    sender's memory); kind "tcp-sockets": the same with RECCL_SAME_HOST_READS=0. ``pair()`` connects a -> b;
    ``link()``/``blackhole()`` fault one NIC of one host in the way the transport
    supports: an emulated port event / silent drop for IB, ``inject_fault`` for
    TCP (the only fault a TCP transport can be given inside one process).
    """

    def __init__(self, kind="ib", infiniband=None, **overrides):
        """`infiniband`: IB only, four subnet prefixes (A0, A1, B0, B1) that make
        the devices InfiniBand ports instead of RoCE ones."""
        if kind == "tcp-sockets":
            # TCP with every payload byte through the sockets: in one process
            # both hosts share a kernel, so "tcp" takes same-host reads.
            kind = "tcp"
            overrides.setdefault("SAME_HOST_READS", 0)
        self.kind = kind
        self.same_host_reads = kind == "tcp" and str(overrides.get("SAME_HOST_READS", 1)) != "0"
        self.pairs = []
        self.listeners = []
        if kind == "ib":
            self.emu = testing().IbEmulation([A0, A1, B0, B1])
            for device, prefix in zip((A0, A1, B0, B1), infiniband or ()):
                self.emu.set_infiniband(device, prefix)
            self.nics_a, self.nics_b = [A0, A1], [B0, B1]
            self.a = native().IbTransport(self.emu, ib_env(self.nics_a, **overrides))
            self.b = native().IbTransport(self.emu, ib_env(self.nics_b, **overrides))
            self.link_down_reason = "link down"  # a port event (IBV_EVENT_PORT_ERR)
        elif kind == "tcp":
            self.emu = None
            self.nics_a = ["lo:" + a for a in TCP_HOSTS["a"].split(",")]
            self.nics_b = ["lo:" + a for a in TCP_HOSTS["b"].split(",")]
            self.a = native().Transport(reccl_env(RECCL_NICS=TCP_HOSTS["a"], **overrides))
            self.b = native().Transport(reccl_env(RECCL_NICS=TCP_HOSTS["b"], **overrides))
            self.link_down_reason = "injected"
        else:
            raise ValueError(f"unknown transport kind {kind!r}")
        self._faulted = set()

    def pair(self, nic=0, reverse=False):
        """A connection a -> b with its primary on rail `nic` (b -> a with `reverse`)."""
        sender, receiver = (self.b, self.a) if reverse else (self.a, self.b)
        listener = receiver.listen(nic)
        self.listeners.append(listener)
        send = sender.connect(nic, listener.handle)
        send.wait_ready(10)
        recv = listener.accept(10)
        self.pairs.append((send, recv))
        return send, recv

    def link(self, nic, up):
        """NIC `nic` (a name) loses (up=False) or regains its link."""
        self._faulted.add(nic)
        if self.kind == "ib":
            (self.emu.port_up if up else self.emu.port_down)(nic)
        else:
            native().inject_fault(nic, "up" if up else "down")

    def blackhole(self, nic, on=True):
        """Traffic through `nic` silently vanishes (on) or flows again."""
        self._faulted.add(nic)
        if self.kind == "ib":
            self.emu.drop(nic, on)
        else:
            native().inject_fault(nic, "blackhole" if on else "up")

    def heal(self):
        for nic in sorted(self._faulted):
            if self.kind == "ib":
                self.emu.port_up(nic)
                self.emu.drop(nic, False)
            native().inject_fault(nic, "up")

    def close(self):
        """Heals, closes every connection and listener it made, and drops its
        transports, so that nothing here keeps their threads alive."""
        if self.a is None:
            return
        self.heal()
        for send, recv in self.pairs:
            close_both(send, recv)
        for listener in self.listeners:
            listener.close()
        self.pairs, self.listeners = [], []
        self.a = self.b = self.emu = None


def fabrics(kind):
    """Body of a fixture: yields make(**overrides) -> Fabric; closes them after."""
    made: List[Fabric] = []

    def make(**overrides) -> Fabric:
        f = Fabric(kind, **overrides)
        made.append(f)
        return f

    make.kind = "tcp" if kind.startswith("tcp") else kind
    yield make
    for f in made:
        f.close()


@pytest.fixture
def fabric():
    """make(**overrides) -> an IB-emulation Fabric (test_ib_transport.py)."""
    yield from fabrics("ib")


def close_both(send, recv) -> None:
    """Closes both ends at once: each close waits (bounded) for the peer's CLOSE."""
    closer = threading.Thread(target=send.close, daemon=True)
    closer.start()
    recv.close()
    closer.join(30)


def run_rank_job(tmp_path, target, world, args, job_timeout_s, store_timeout_s=90, killed=()):
    """Hosts a TCPStore and runs `world` spawned processes target(rank, port,
    out_dir, *args), each expected to write rank<r>.json with "ok" (or "error"),
    except the ranks in `killed`, which must end by SIGKILL and write nothing.
    Bounded by `job_timeout_s`; ranks still running then are killed. Asserts every
    rank reported ok and returns the results in rank order (None for `killed`)."""
    import datetime
    import json
    import multiprocessing

    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, world + 1, True,
                         timeout=datetime.timedelta(seconds=store_timeout_s), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, host.port, str(tmp_path), *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + job_timeout_s
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = [json.loads(path.read_text()) if (path := tmp_path / f"rank{r}.json").exists()
               else {"rank": r, "error": "wrote no result"} for r in range(world)]
    for r in killed:
        assert procs[r].exitcode == -signal.SIGKILL, (
            f"rank {r} was to die by SIGKILL; exit code {procs[r].exitcode}")
        results[r] = None
    failed = [r for r in results if r is not None and not r.get("ok")]
    assert not failed, (f"{len(failed)} rank(s) failed (hung: {hung}); "
                        f"rank {failed[0]['rank']}:\n{failed[0]['error']}")
    return results


def init_rank_groups(rank, port, world, group_sizes=(), timeout_s=60, store_timeout_s=90):
    """In a rank spawned by run_rank_job: torch on one thread, the default
    "reccl" group over the job's store with 4 KiB chunks and a window of 2 (so
    moderate counts take several chunks per step), and a group of the first k
    ranks for each k of `group_sizes`. Returns (torch, dist, {k: group})."""
    import datetime

    import torch
    import torch.distributed as dist

    from torch_reccl.backend import Options

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False,
                          timeout=datetime.timedelta(seconds=store_timeout_s))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("reccl", store=store, rank=rank, world_size=world, timeout=timeout,
                            pg_options=Options(chunk_bytes=4096, window=2))
    groups = {k: dist.new_group(list(range(k)), timeout=timeout) for k in group_sizes}
    return torch, dist, groups


def report_rank(out_dir, rank, body: Callable[[dict], None]) -> None:
    """The end of a rank spawned by run_rank_job: runs body(result) on a dict
    holding "rank", writes it to rank<r>.json with "ok", or with the traceback
    as "error", and exits at once (os._exit: interpreter teardown is slow and
    releases nothing more)."""
    import json
    import traceback

    result = {"rank": rank}
    try:
        body(result)
        result["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


# --------------------------------------------------------------------------- GPU checks


def needs_gpus(count: int) -> list:
    """Marks for a GPU check's module (``pytestmark``): marker ``gpu``, and a skip
    whose reason pytest's summary shows unless this host has CUDA, a torch built
    with NCCL and at least `count` GPUs."""
    import torch
    import torch.distributed as dist

    reason = None
    if not torch.cuda.is_available():
        reason = f"needs a CUDA GPU; torch {torch.__version__} sees none"
    elif not dist.is_nccl_available():
        reason = f"needs NCCL; torch {torch.__version__} was built without it"
    elif torch.cuda.device_count() < count:
        reason = f"needs {count} GPUs; this host has {torch.cuda.device_count()}"
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


def gpu_of(rank: int) -> int:
    """GPU of `rank` in a two-rank GPU check: its own where there are two; with one
    GPU both ranks share it (their own NCCL_HOSTID keeps NCCL from refusing that)."""
    import torch

    return rank % torch.cuda.device_count()


def two_host_env(rank: int, label: str) -> Dict[str, str]:
    """NCCL and reccl settings that make two ranks on one machine look like two hosts,
    so every byte between them crosses the net plugin: own NCCL_HOSTID, P2P and SHM
    off, the two loopback NICs. NVLink multicast (NVLS) stays off: on shared GPU
    machines a program using it can take the host's GPUs out of service."""
    return {
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
        "NCCL_HOSTID": f"{label}-{rank}", "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RECCL_NICS": NICS, "RECCL_HEARTBEAT_MS": "500",
    }

"""Scale: what groups, rendezvous and an idle job cost, reccl against Gloo in the same run.

For each N in --ranks and each backend (reccl, gloo; same invocation, same harness)
the launcher starts N rank processes on 127.0.0.1 (one process per rank, started
with subprocess, torch.set_num_threads(1) in each) and hosts the rendezvous store
itself: the real c10d TCPStore server (is_master=True, wait_for_workers=False)
behind a counting TCP proxy (one thread, one epoll selector for every connection)
that the ranks connect to. Every store request of every rank (also those of
cloned stores, which connect to the same address) passes the proxy, which counts
them per phase. The phases are driven by the launcher over each rank's stdin
(commands) and a private pipe (replies), never through the store:

    start        ranks import torch (and torch_reccl), report their pid
    init         TCPStore client through the proxy, init_process_group
    create       Megatron-like group set: world, tensor-parallel pairs (2k, 2k+1),
                 data-parallel groups (ranks with equal r % 2), 4 more world-sized
                 groups (dist.new_group(list(range(N))) x 4): 1 + N/2 + 2 + 4
                 groups in the job, 7 per rank
    first_use    one small all_reduce on every group the rank is in (exact check)
    settle       --settle-s of quiet before the window
    idle         --idle-s window: store requests (proxy), CPU seconds of all ranks
                 (/proc/<pid>/stat utime+stime); around it, context switches of every
                 thread (/proc/<pid>/task/*/status); then threads per rank
                 (/proc/<pid>/task, broken down by /proc/<pid>/task/*/comm) and open
                 fds (/proc/<pid>/fd)
    collectives  world group: 4-byte all_reduce latency (per rank: median of
                 --small-iters timed ops after --warmup; reported: the max over ranks
                 of the per-rank medians)
    busbw        one phase per (op, size) of --busbw-ops x --busbw-sizes-mib (default:
                 all_reduce of 16 MiB), on the world group: per rank, the untimed
                 ops, each checked, a barrier, the timed ops back to back (as
                 nccl-tests), then one more checked op; per rank the loop's time
                 per op; t = the max over ranks of those; busbw as nccl-tests:
                 algbw = bytes / t, busbw = algbw x 2(N-1)/N (all_reduce) or
                 (N-1)/N (all_gather, reduce_scatter).
                 "bytes" is the size given, as in nccl-tests the largest buffer of
                 the op (rounded down to a multiple of 4N for the last two):
                   all_reduce      the buffer each rank reduces (input = output)
                   all_gather      the gathered output; each rank sends bytes/N
                   reduce_scatter  each rank's input; each rank gets bytes/N
                 so a rank holds about 1.25 x bytes whatever N (the buffers plus a
                 uint8 copy of the input pattern). Op counts per size: at 16 MiB
                 max(1, --warmup/2) untimed and --busbw-iters timed; other sizes
                 scale both by 16 MiB/size (timed: min(2, iters) .. 4 x iters;
                 untimed: 1 .. warmup/2), the same for reccl and Gloo.
                 Also the CPU time of every thread of every rank during the
                 timed ops, per op, and "cores kept busy" = that / t: when it
                 is near the machine's cores, the CPUs are the limit.

Every result of every checked op is compared bit for bit (the 4-byte all_reduces
and, per busbw phase, the untimed ops and one after the timed loop; inputs are
integer-valued floats: (element index % 251) + rank, so every sum is exact in
float32; all_gather and reduce_scatter outputs are set to -1 before each checked
op, so an unwritten output fails).
The shapes, bus factors and collective calls are those of torch_reccl/bench/rank.py
(``reccl bench``), loaded by path.

Every phase is bounded by --phase-timeout; a job that does not finish in its bound
is reported as "did not finish (<phase>)" and its ranks are killed.

    python bench/scale.py                      # N = 4 8 16 ... up to 8 x cores
    python bench/scale.py --ranks 4 8 --idle-s 10 --json scale.json
    python bench/scale.py --ranks 2 4 8 --busbw-sizes-mib 1 4 16 64 256 \\
        --busbw-ops all_reduce all_gather reduce_scatter

Output: a Markdown table per machine on stdout (reccl, gloo, reccl/gloo; one
"<size> <op> busbw (GB/s)" row per measured (op, size)), and the full record
(per-phase store counts with samples of the requests seen, per-rank numbers,
thread names; per (op, size): bytes, op counts, t, every rank's mean, algbw and
busbw) with --json. docs/scale.md explains every column.

Store requests are counted two ways by the proxy: "reads" (client->server recv()
calls that returned data; TCPStore's client writes each request with one send(), so
on loopback a read is about one request, but two requests sent back to back can
arrive in one read) and "requests", parsed from the byte stream with TCPStore's
wire format (exact while the format is the one parsed here; a connection whose
bytes stop parsing falls back to counting reads only, reported as "unparsed").
Bytes are reported too.

The reusable pieces (CountingProxy, run_job, format_table, ...) are imported by
tests/test_scale.py.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NICS = "127.0.0.1,127.0.0.2"
DEFAULT_RANKS = (4, 8, 16, 32, 64, 128)
BACKENDS = ("reccl", "gloo")
PHASES = ("start", "init", "create", "first_use", "settle", "idle", "collectives", "busbw")  # busbw: one per (op, size)
TRANSPORT_THREAD_PREFIXES = ("reccl-path-", "reccl-ib-")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procstat  # noqa: E402 - bench/procstat.py, beside this file
import wire_ceiling  # noqa: E402 - bench/wire_ceiling.py, beside this file
from reccl_bench_runs import load_standalone  # noqa: E402 - beside this file too

# bench_rank: its shapes, bus factors and collective calls are the ones ``reccl bench`` uses.
_bench_rank = load_standalone("bench.rank")
OPS = _bench_rank.OPS                  # all_reduce, all_gather, reduce_scatter
shape_for = _bench_rank.shape_for      # nccl-tests' sizes: the size is the largest buffer
bus_factor = _bench_rank.bus_factor    # nccl-tests' busbw = algbw x 2(N-1)/N or (N-1)/N
run_collective = _bench_rank.run_collective

# --------------------------------------------------------------------------- busbw plan

BUSBW_REFERENCE_BYTES = 16 << 20  # --busbw-iters and --warmup/2 are the counts at this size


def busbw_counts(size_bytes: int, iters: int, warmup: int) -> Tuple[int, int]:
    """(untimed, timed) ops of one busbw measurement of ``size_bytes``.

    At 16 MiB: max(1, warmup // 2) untimed and ``iters`` timed, as before sizes were
    configurable. Other sizes scale both by 16 MiB / size, so every size moves about
    the same bytes: timed ops between min(2, iters) and 4 x iters, untimed between 1
    and max(1, warmup // 2). The counts depend on the size only, never on N or the
    backend, so reccl and Gloo run the same ops.
    """
    scale = BUSBW_REFERENCE_BYTES / max(1, size_bytes)
    warm = max(1, warmup // 2)
    return (max(1, min(warm, round(warm * scale))),
            max(min(2, iters), min(4 * iters, round(iters * scale))))


def busbw_plan(ops, sizes_bytes, iters: int, warmup: int) -> List[dict]:
    """Every (op, size) to measure, ops outer, sizes inner, with its op counts."""
    plan = []
    for op in ops:
        if op not in OPS:
            raise ValueError(f"busbw op {op!r}: expected one of {OPS}")
        for size in sizes_bytes:
            warm, timed = busbw_counts(int(size), iters, warmup)
            plan.append({"op": op, "size_bytes": int(size), "warmup": warm, "iters": timed})
    return plan


def human_bytes(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else (f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B")

# --------------------------------------------------------------------------- TCPStore wire format

# c10d::detail::QueryType (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, torch 2.13)
QUERY_NAMES = ("VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT", "GETNUMKEYS",
               "DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
               "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS", "BARRIER")
# fields after the type byte: u32/i64 fixed values, "key"/"payload" = u64 length + bytes,
# "keys" = u64 count + that many keys, "kv" = u64 count + that many (key, payload)
_LAYOUT = {
    "VALIDATE": ("u32",), "SET": ("key", "payload"), "COMPARE_SET": ("key", "payload", "payload"),
    "GET": ("key",), "ADD": ("key", "i64"), "CHECK": ("keys",), "WAIT": ("keys",),
    "GETNUMKEYS": (), "DELETE_KEY": ("key",), "APPEND": ("key", "payload"),
    "MULTI_GET": ("keys",), "MULTI_SET": ("kv",), "CANCEL_WAIT": (), "PING": ("u32",),
    "QUEUE_PUSH": ("key", "payload"), "QUEUE_POP": ("key",), "QUEUE_LEN": ("key",),
    "LIST_KEYS": (), "BARRIER": ("key", "i64"),
}
_MAX_LEN = 1 << 31


class _Incomplete(Exception):
    pass


class RequestParser:
    """Splits one client->server byte stream into TCPStore requests.

    feed() returns the requests completed by the new bytes as (type, first key or
    None, number of keys). On bytes that do not parse (an unknown type, an absurd
    length) the parser gives up for good (``broken``); the proxy then counts reads only.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.broken = False

    def feed(self, data: bytes) -> List[Tuple[str, Optional[str], int]]:
        if self.broken:
            return []
        self.buf += data
        out = []
        while self.buf:
            try:
                request, used = self._parse_one()
            except _Incomplete:
                break
            except ValueError:
                self.broken = True
                self.buf.clear()
                break
            del self.buf[:used]
            out.append(request)
        return out

    def _parse_one(self):
        buf, pos = self.buf, 1
        qtype = buf[0]
        if qtype >= len(QUERY_NAMES):
            raise ValueError(f"unknown query type {qtype}")
        name = QUERY_NAMES[qtype]

        def need(n):
            if pos + n > len(buf):
                raise _Incomplete

        def u64():
            nonlocal pos
            need(8)
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            if value > _MAX_LEN:
                raise ValueError("absurd length")
            return value

        def blob():
            nonlocal pos
            n = u64()
            need(n)
            value = bytes(buf[pos:pos + n])
            pos += n
            return value

        keys: List[str] = []
        for field in _LAYOUT[name]:
            if field == "u32":
                need(4)
                pos += 4
            elif field == "i64":
                need(8)
                pos += 8
            elif field == "key":
                keys.append(blob().decode("utf-8", "replace"))
            elif field == "payload":
                blob()
            elif field == "keys":
                for _ in range(u64()):
                    keys.append(blob().decode("utf-8", "replace"))
            elif field == "kv":
                for _ in range(u64()):
                    keys.append(blob().decode("utf-8", "replace"))
                    blob()
        return (name, keys[0] if keys else None, len(keys)), pos


def key_pattern(key: Optional[str]) -> str:
    """A key with every digit run replaced by '#', to group per-rank/per-group keys."""
    return "" if key is None else re.sub(r"\d+", "#", key)


# --------------------------------------------------------------------------- counting proxy


class _Side:
    __slots__ = ("sock", "peer", "out", "is_client", "conn_id", "parser", "reading")

    def __init__(self, sock, is_client, conn_id):
        self.sock, self.is_client, self.conn_id = sock, is_client, conn_id
        self.peer: Optional["_Side"] = None
        self.out = bytearray()
        self.parser = RequestParser() if is_client else None
        self.reading = True


class CountingProxy:
    """A TCP proxy in front of a TCPStore server that counts client->server traffic per phase.

    One thread and one selector (epoll on Linux) serve every connection; nothing
    wakes it but traffic (a socketpair stops it). Counts per phase: reads (recv()
    calls that returned client bytes), bytes, parsed requests (by type and key
    pattern, plus the first ``samples`` requests verbatim), connections opened,
    and reads/bytes in the server->client direction.
    """

    MAX_BUFFERED = 8 << 20  # stop reading a side while its peer has this much unsent

    def __init__(self, upstream_port: int, host: str = "127.0.0.1", samples: int = 40) -> None:
        self.upstream = (host, upstream_port)
        self.samples = samples
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._phase = "start"
        self._phase_start = time.monotonic()
        self._counts: Dict[str, dict] = {}
        self._stop = False
        self._next_id = 0
        self.open_connections = 0
        self.thread = threading.Thread(target=self._loop, name="scale-proxy", daemon=True)

    # -- public
    def start(self) -> "CountingProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)

    def set_phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
            self._phase_start = time.monotonic()

    def counts(self, phase: Optional[str] = None) -> dict:
        """A copy of the counts of one phase (zeros if none), or of all phases."""
        with self._lock:
            if phase is not None:
                return json.loads(json.dumps(self._counts.get(phase) or self._new_counts()))
            return json.loads(json.dumps(self._counts))

    # -- internals
    @staticmethod
    def _new_counts() -> dict:
        return {"reads": 0, "bytes": 0, "requests": 0, "unparsed_reads": 0, "connections": 0,
                "reply_reads": 0, "reply_bytes": 0, "by_type": {}, "by_key": {}, "samples": []}

    def _bucket(self) -> dict:
        bucket = self._counts.get(self._phase)
        if bucket is None:
            bucket = self._counts[self._phase] = self._new_counts()
        return bucket

    def _loop(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stop:
            for key, events in self.selector.select():
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                else:
                    side = key.data
                    if events & selectors.EVENT_WRITE:
                        self._flush(side)
                    if events & selectors.EVENT_READ and side.sock.fileno() >= 0:
                        self._read(side)
        for key in list(self.selector.get_map().values()):
            try:
                key.fileobj.close()
            except OSError:
                pass
        self.selector.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            self._next_id += 1
            a, b = _Side(client, True, self._next_id), _Side(server, False, self._next_id)
            a.peer, b.peer = b, a
            self.selector.register(client, selectors.EVENT_READ, a)
            self.selector.register(server, selectors.EVENT_READ, b)
            self.open_connections += 1
            with self._lock:
                self._bucket()["connections"] += 1

    def _interest(self, side: _Side) -> None:
        """(Re)registers a side for what it waits on: reading (unless paused), writing (if it has output)."""
        if side.sock.fileno() < 0:
            return
        events = (selectors.EVENT_READ if side.reading else 0) | (selectors.EVENT_WRITE if side.out else 0)
        try:
            if events:
                try:
                    self.selector.modify(side.sock, events, side)
                except KeyError:
                    self.selector.register(side.sock, events, side)
            else:
                self.selector.unregister(side.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, side: _Side) -> None:
        """Closes a connection: both sides."""
        closed_any = False
        for s in (side, side.peer):
            if s is None or s.sock.fileno() < 0:
                continue
            try:
                self.selector.unregister(s.sock)
            except (KeyError, ValueError):
                pass
            s.sock.close()
            closed_any = True
        if closed_any:
            self.open_connections -= 1

    def _read(self, side: _Side) -> None:
        try:
            data = side.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # one end closed: deliver what is pending to the other, then close both
            peer = side.peer
            if peer.out and peer.sock.fileno() >= 0:
                try:
                    peer.sock.setblocking(True)
                    peer.sock.settimeout(1)
                    peer.sock.sendall(bytes(peer.out))
                except OSError:
                    pass
            self._close(side)
            return
        now = time.monotonic()
        with self._lock:
            bucket = self._bucket()
            if side.is_client:
                bucket["reads"] += 1
                bucket["bytes"] += len(data)
                broken_before = side.parser.broken
                requests = side.parser.feed(data)
                if side.parser.broken:
                    bucket["unparsed_reads"] += 1
                    if not broken_before:
                        bucket["samples"].append(f"conn {side.conn_id}: bytes stopped parsing")
                for qtype, key, nkeys in requests:
                    bucket["requests"] += 1
                    bucket["by_type"][qtype] = bucket["by_type"].get(qtype, 0) + 1
                    pattern = f"{qtype} {key_pattern(key)}".strip()
                    bucket["by_key"][pattern] = bucket["by_key"].get(pattern, 0) + 1
                    if len(bucket["samples"]) < self.samples:
                        more = f" (+{nkeys - 1} keys)" if nkeys > 1 else ""
                        bucket["samples"].append(f"+{now - self._phase_start:.3f}s conn {side.conn_id}: "
                                                 f"{qtype} {key or ''}{more}".rstrip())
            else:
                bucket["reply_reads"] += 1
                bucket["reply_bytes"] += len(data)
        peer = side.peer
        peer.out += data
        self._flush(peer)
        if len(peer.out) > self.MAX_BUFFERED:
            side.reading = False
            self._interest(side)

    def _flush(self, side: _Side) -> None:
        if side.sock.fileno() < 0:
            return
        while side.out:
            try:
                sent = side.sock.send(side.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(side)
                return
            del side.out[:sent]
        self._interest(side)
        peer = side.peer
        if peer is not None and not peer.reading and len(side.out) <= self.MAX_BUFFERED // 2 \
                and peer.sock.fileno() >= 0:
            peer.reading = True
            self._interest(peer)


# --------------------------------------------------------------------------- /proc


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


# --------------------------------------------------------------------------- the rank


def group_layout(size: int) -> List[Tuple[str, List[int]]]:
    """The Megatron-like groups every rank creates, in creation order (world excluded)."""
    groups = [(f"tp{k}", [2 * k, 2 * k + 1]) for k in range(size // 2)]
    groups += [(f"dp{j}", list(range(j, size, 2))) for j in range(2)]
    groups += [(f"world{i}", list(range(size))) for i in range(4)]
    return groups


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


PATTERN = 251       # inputs: (global element index % 251) + rank; every sum is an exact float32 integer
CHECK_CHUNK = 1 << 20  # elements compared per step: the check's temporaries stay 8 MiB whatever the size


def _pattern(count: int):
    """uint8 tensor of (i % 251) for i < count: the inputs' shape, a quarter of a float32 buffer."""
    import torch

    return torch.arange(PATTERN, dtype=torch.uint8).repeat(-(-count // PATTERN))[:count]


def _first_wrong(segments) -> Optional[Tuple[int, float, float]]:
    """(output index, got, expected) of the first element that is not base x scale + offset in
    any (output slice, output start, base slice, scale, offset) segment; None if all are right."""
    import torch

    for out, start, base, scale, offset in segments:
        for a in range(0, out.numel(), CHECK_CHUNK):
            b = min(a + CHECK_CHUNK, out.numel())
            want = base[a:b].float().mul_(scale).add_(offset)
            if not torch.equal(out[a:b], want):
                bad = int((out[a:b] != want).nonzero()[0].item())
                return start + a + bad, out[a + bad].item(), want[bad].item()
    return None


def measure_busbw(op: str, nominal: int, warm: int, iters: int, rank: int, size: int, errors: List[str],
                  progress=None) -> dict:
    """``warm`` untimed ops, each checked bit for bit, then ``iters`` back-to-back timed
    ops, then one more checked op; as nccl-tests, which time a loop and check apart.

    Shapes as nccl-tests (shape_for): ``nominal`` bytes is the largest buffer, the
    all_reduce buffer, the all_gather output, the reduce_scatter input; all_gather's
    input and reduce_scatter's output are 1/N of it. So a rank holds about 1.25 x
    the size (the buffer(s) plus a uint8 copy of the pattern), whatever N.
    Before every checked op the input is refilled and an all_gather/reduce_scatter
    output set to -1 (never a right value), so a result the op did not write is caught.
    The timed ops run back to back on the buffers as they are (an in-place all_reduce
    keeps summing), after a barrier so every rank starts the loop together: timing
    each op alone, with a refill and a check between, measured the ranks' skew as
    much as the op (sessions before 14). Returns the mean time per timed op, its CPU
    (this process, every thread) and the shapes.
    """
    import torch
    import torch.distributed as dist

    count, nbytes, n_in, n_out = shape_for(op, nominal, size, "float32")
    chunk = count // size
    base = _pattern(count)
    total = float(size * (size - 1) // 2)   # sum over ranks of the "+ rank" offsets
    if op == "all_reduce":
        inp = out = torch.empty(count)
        mine = base
        segments = [(out, 0, base, float(size), total)]
    elif op == "all_gather":
        inp, out = torch.empty(chunk), torch.empty(count)
        mine = base[rank * chunk:(rank + 1) * chunk]
        segments = [(out[k * chunk:(k + 1) * chunk], k * chunk, base[k * chunk:(k + 1) * chunk], 1.0, float(k))
                    for k in range(size)]
    else:
        inp, out = torch.empty(count), torch.empty(chunk)
        mine = base
        segments = [(out, 0, base[rank * chunk:(rank + 1) * chunk], float(size), total)]
    found = 0

    def checked(i: int) -> None:
        nonlocal found
        inp.copy_(mine).add_(rank)
        if out is not inp:
            out.fill_(-1.0)
        run_collective(op, out, inp)
        wrong = _first_wrong(segments)
        if wrong is not None and found < 5 and len(errors) < 20:
            found += 1
            errors.append(f"{op} of {nbytes} bytes, op {i}: output element {wrong[0]} is {wrong[1]}, "
                          f"expected {wrong[2]}")
        if progress:
            progress(f"{op} {nbytes} B op {i} checked")

    for i in range(warm):
        checked(i)
    if dist.is_initialized():
        dist.barrier()
    threads_before = procstat.threads()
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(iters):
        run_collective(op, out, inp)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    by_thread = procstat.cpu_ms_by_name(threads_before, procstat.threads(), iters)
    if progress:
        progress(f"{op} {nbytes} B: {iters} timed ops done")
    checked(warm + iters)
    return {"op": op, "size_bytes": nominal, "bytes": nbytes, "in_count": n_in, "out_count": n_out,
            "mean_s": elapsed / iters, "cpu_s_per_op": cpu / iters,
            "cpu_ms_per_op_by_thread": {name: ms for name, ms in by_thread.items() if ms[0] + ms[1] > 0}}


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
    rank, size = args.rank, args.size
    out = os.fdopen(args.msg_fd, "w", buffering=1)
    commands = os.fdopen(args.cmd_fd, "r")

    def emit(kind: str, **fields) -> None:
        out.write(json.dumps({"kind": kind, "rank": rank, **fields}) + "\n")
        out.flush()

    phase = "start"

    def command(expected: str, name: Optional[str] = None) -> None:
        nonlocal phase
        phase = name or expected
        line = commands.readline()  # blocks in read(): an idle rank's main thread sleeps here
        if not line:  # the launcher is gone or gave up on this job
            os._exit(3)
        if line.strip() != expected:
            emit("error", error=f"expected command {expected!r}, got {line.strip()!r}")
            os._exit(4)

    fd_table_at_start = procstat.fd_table_entries()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.ones(1000).sum()  # let torch start whatever threads it starts before measuring
    threads_torch = _thread_count()
    if args.backend == "reccl":
        import torch_reccl  # noqa: F401 - registers the backend
    emit("start", pid=os.getpid(), threads_torch=threads_torch, threads_imported=_thread_count(),
         fd_table_at_start=fd_table_at_start)
    timeout = datetime.timedelta(seconds=args.timeout)
    errors: List[str] = []

    try:
        command("init")
        t0 = time.perf_counter()
        store = dist.TCPStore("127.0.0.1", args.store_port, size, False, timeout=timeout)
        dist.init_process_group(args.backend, store=store, rank=rank, world_size=size, timeout=timeout)
        emit("init", s=time.perf_counter() - t0, threads=_thread_count())

        command("create")
        t0 = time.perf_counter()
        mine = [("world", list(range(size)), dist.group.WORLD)]
        for name, ranks in group_layout(size):
            pg = dist.new_group(ranks)
            if rank in ranks:
                mine.append((name, ranks, pg))
        emit("create", s=time.perf_counter() - t0, groups=[m[0] for m in mine], threads=_thread_count())

        command("first_use")
        t0 = time.perf_counter()
        per_group = {}
        for name, ranks, pg in mine:
            g0 = time.perf_counter()
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t, group=pg)
            per_group[name] = time.perf_counter() - g0
            emit("progress", step=f"first use of {name} done")
            expected = torch.full((3,), float(sum(r + 1 for r in ranks)))
            if not torch.equal(t, expected):
                errors.append(f"first use of {name}: got {t.tolist()}, expected {expected.tolist()}")
        emit("first_use", s=time.perf_counter() - t0, per_group=per_group, errors=errors,
             threads=_thread_count())
        reported = len(errors)

        command("collectives")
        small = torch.zeros(1)
        want = float(size * (size + 1) // 2)
        times = []
        for i in range(args.warmup + args.small_iters):
            small.fill_(float(rank + 1))
            t0 = time.perf_counter()
            dist.all_reduce(small)
            dt = time.perf_counter() - t0
            if small.item() != want and len(errors) < 20:
                errors.append(f"4-byte all_reduce {i}: got {small.item()}, expected {want}")
            if i >= args.warmup:
                times.append(dt)
        small_median = statistics.median(times)
        emit("progress", step="4-byte all_reduces done")
        emit("collectives", small_median_s=small_median, small_times=times, errors=errors[reported:])
        reported = len(errors)

        for i, (op, nominal, warm, iters) in enumerate(json.loads(args.busbw)):
            command(f"busbw{i}", f"busbw {op} {nominal} B")
            measured = measure_busbw(op, nominal, warm, iters, rank, size, errors,
                                     lambda step: emit("progress", step=step))
            emit(f"busbw{i}", **measured, errors=errors[reported:])
            reported = len(errors)
    except Exception as error:  # noqa: BLE001 - told to the launcher, then the traceback goes to the log
        emit("error", error=f"rank {rank} in phase {phase}: {type(error).__name__}: {error}"[:3000])
        raise

    command("exit")
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
    (PR_SET_PDEATHSIG) and runs rank_main, which imports torch_reccl itself.
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
                            [sys.executable, os.path.abspath(__file__), "--_rank", *spec["argv"]],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            pass_fds=(spec["cmd_fd"], spec["msg_fd"]), env=env, cwd=REPO))
            elif start_method == "fork":
                with open(self.zygote_log, "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--_zygote", json.dumps(specs)],
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


def _per_rank(fn, pids: List[int], phase: str) -> list:
    """fn(pid) for every rank; a rank gone from /proc ends the job as "did not finish"."""
    out = []
    for r, pid in enumerate(pids):
        try:
            out.append(fn(pid))
        except OSError as error:
            raise DidNotFinish(phase, f"rank {r} (pid {pid}) is gone: {error}") from None
    return out


def _median(values):
    return statistics.median(values) if values else None


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
    plan = [entry for op, nbytes in busbw for entry in busbw_plan([op], [nbytes], busbw_iters, warmup)]
    opts = {"op_timeout": op_timeout, "warmup": warmup, "small_iters": small_iters, "busbw": plan}
    groups = group_layout(size)
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
    phase = "start"
    job_start = phase_start = time.monotonic()
    job_deadline = job_start + total_timeout if total_timeout else float("inf")
    result["phase_s"] = phase_times = {}

    def enter(name: str) -> None:
        nonlocal phase, phase_start
        now = time.monotonic()
        phase_times[phase] = now - phase_start
        phase, phase_start = name, now
        proxy.set_phase(name)
        if progress:
            progress(f"{backend} N={size}: {name}")

    def bound(seconds: float) -> float:
        return max(1.0, min(seconds, job_deadline - time.monotonic()))

    try:
        enter("start")
        ranks = _Ranks(backend, size, proxy.port, opts, env, log_dir, start_method)
        started = ranks.wait("start", phase, bound(start_timeout or max(phase_timeout, 3.0 * size)))
        pids = [started[r]["pid"] for r in range(size)]
        result["threads_torch"] = max(m["threads_torch"] for m in started.values())
        result["threads_imported"] = max(m["threads_imported"] for m in started.values())
        result["fd_table_at_start"] = min(m["fd_table_at_start"] for m in started.values())

        enter("init")
        t0 = time.monotonic()
        ranks.send("init")
        replies = ranks.wait("init", phase, bound(phase_timeout))
        result["init_s"] = max(m["s"] for m in replies.values())
        result["init_wall_s"] = time.monotonic() - t0

        enter("create")
        t0 = time.monotonic()
        ranks.send("create")
        replies = ranks.wait("create", phase, bound(phase_timeout))
        result["create_s"] = max(m["s"] for m in replies.values())
        result["create_wall_s"] = time.monotonic() - t0
        result["store_keys_after_create"] = store.num_keys()

        enter("first_use")
        t0 = time.monotonic()
        ranks.send("first_use")
        replies = ranks.wait("first_use", phase, bound(phase_timeout))
        result["first_use_s"] = max(m["s"] for m in replies.values())
        result["first_use_wall_s"] = time.monotonic() - t0
        result["setup_s"] = result["create_s"] + result["first_use_s"]
        result["first_use_per_group_s"] = {
            name: max(m["per_group"].get(name, 0.0) for m in replies.values())
            for name in replies[0]["per_group"]}
        result["errors"] = [f"rank {r}: {e}" for r, m in sorted(replies.items()) for e in m["errors"]]
        result["store_keys_after_first_use"] = store.num_keys()

        enter("settle")
        time.sleep(settle_s)

        # Context switches need a walk over every thread in /proc, slow with thousands of threads
        # on a busy machine: the walks bracket the window from outside (the ranks idle throughout)
        # and the rate uses the time between the walks' midpoints. The window itself has only
        # cheap reads at its ends: CPU times, and the proxy's phase switch.
        a0 = time.monotonic()
        ctxt0 = _per_rank(proc_ctxt_switches, pids, phase)
        a1 = time.monotonic()
        cpu0 = _per_rank(proc_cpu_s, pids, phase)
        w0 = time.monotonic()
        enter("idle")
        time.sleep(max(0.0, w0 + idle_s - time.monotonic()))
        cpu1 = _per_rank(proc_cpu_s, pids, phase)
        window = time.monotonic() - w0
        proxy.set_phase("after_idle")
        idle = proxy.counts("idle")
        b0 = time.monotonic()
        ctxt1 = _per_rank(proc_ctxt_switches, pids, phase)
        b1 = time.monotonic()
        ctxt_span = (b0 + b1) / 2 - (a0 + a1) / 2
        names = _per_rank(proc_threads, pids, phase)
        fds = _per_rank(proc_fds, pids, phase)
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
        result["store_keys_after_idle"] = store.num_keys()

        if not skip_collectives:
            enter("collectives")
            ranks.send("collectives")
            replies = ranks.wait("collectives", phase, bound(phase_timeout))
            result["latency_4b_s"] = max(m["small_median_s"] for m in replies.values())
            result["latency_4b_median_of_ranks_s"] = _median([m["small_median_s"] for m in replies.values()])
            result["errors"] += [f"rank {r}: {e}" for r, m in sorted(replies.items()) for e in m["errors"]]
            result["busbw"] = []
            for i, entry in enumerate(plan):
                enter(f"busbw {entry['op']} {human_bytes(entry['size_bytes'])}")
                ranks.send(f"busbw{i}")
                replies = ranks.wait(f"busbw{i}", phase, bound(phase_timeout))
                per_rank = [replies[r]["mean_s"] for r in range(size)]
                slowest = max(per_rank)
                nbytes = replies[0]["bytes"]
                algbw = nbytes / slowest / 1e9
                # CPU of every thread of every rank per op, against the op's time: how many of
                # the machine's cores the op kept busy (near all of them: the machine is the limit).
                cpu_per_op = sum(replies[r]["cpu_s_per_op"] for r in range(size))
                result["busbw"].append({
                    "cpu_s_per_op": cpu_per_op, "cores_busy": cpu_per_op / slowest,
                    **entry, "bytes": nbytes, "in_count": replies[0]["in_count"],
                    "out_count": replies[0]["out_count"], "time_s": slowest, "mean_s_per_rank": per_rank,
                    "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(entry["op"], size),
                    # Where rank 0's CPU went: [user, system] ms per op by thread name.
                    "rank0_cpu_ms_per_op_by_thread": replies[0].get("cpu_ms_per_op_by_thread", {})})
                result["errors"] += [f"rank {r}: {e}" for r, m in sorted(replies.items()) for e in m["errors"]]
        enter("done")
        ranks.send("exit")
    except DidNotFinish as error:
        phase_times[phase] = time.monotonic() - phase_start
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


# --------------------------------------------------------------------------- report


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
                     "(64: growing it is a set-up cost; docs/scale.md, session 14).")
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


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_rank"]:
        return rank_main(argv[1:])
    if argv[:1] == ["--_zygote"]:
        return zygote_main(argv[1])
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+",
                        help=f"job sizes (even); default: those of {DEFAULT_RANKS} up to 8 x cores")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle window (s)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="quiet time before the window (s)")
    parser.add_argument("--phase-timeout", type=float, default=180.0, help="bound on every phase (s)")
    parser.add_argument("--op-timeout", type=float, default=120.0, help="the process groups' timeout (s)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--small-iters", type=int, default=50, help="timed 4-byte all_reduces")
    parser.add_argument("--busbw-sizes-mib", type=float, nargs="+", default=[16.0], metavar="MIB",
                        help="busbw sizes, MiB (2^20 bytes), as nccl-tests: the largest buffer, the "
                             "all_gather output, the reduce_scatter input (default: 16)")
    parser.add_argument("--busbw-ops", nargs="+", choices=OPS, default=["all_reduce"],
                        help="collectives whose busbw is measured at every size (default: all_reduce)")
    parser.add_argument("--busbw-iters", "--large-iters", dest="busbw_iters", type=int, default=5,
                        help="timed ops at 16 MiB; other sizes scale by 16 MiB / size, within "
                             "min(2, this) .. 4 x this (busbw_counts)")
    parser.add_argument("--ceiling-s", type=float, default=2.0,
                        help="seconds of the loopback ring ceiling (bench/wire_ceiling.py) run for each N "
                             "before its jobs: the busbw plain TCP reaches on this machine; 0 skips it")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="fork: one zygote imports torch and forks the ranks (fast start); "
                             "spawn: one fresh interpreter per rank")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the ranks (repeatable)")
    parser.add_argument("--force", action="store_true", help="run N > 8 x cores too")
    parser.add_argument("--json", help="write the full record here")
    parser.add_argument("--log-dir", help="rank logs (default: a temporary directory)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    sizes = args.ranks or [n for n in DEFAULT_RANKS if n <= 8 * cores]
    if any(mib <= 0 for mib in args.busbw_sizes_mib):
        parser.error("--busbw-sizes-mib: sizes must be > 0")
    busbw = [(op, int(round(mib * (1 << 20)))) for op in args.busbw_ops for mib in args.busbw_sizes_mib]
    notes = []
    runnable = []
    for n in sizes:
        if n < 2 or n % 2:
            parser.error(f"--ranks {n}: must be even and >= 2")
        if n > 8 * cores and not args.force:
            notes.append(f"note: N={n} > 8 x {cores} cores: skipped (--force runs it anyway)")
        else:
            if n > 8 * cores:
                notes.append(f"note: N={n} > 8 x {cores} cores: numbers are limited by the machine")
            runnable.append(n)
    for note in notes:
        print(note, file=sys.stderr)
    extra = dict(kv.split("=", 1) for kv in args.env)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="reccl-scale-")
    os.makedirs(log_dir, exist_ok=True)
    machine = machine_info()
    progress = None if args.quiet else (lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr,
                                                        flush=True))
    runs = []
    ceilings = {}
    record = {"machine": machine, "args": vars(args), "notes": notes, "runs": runs, "ring_ceilings": ceilings}
    for n in runnable:
        if args.ceiling_s > 0 and busbw:
            if progress:
                progress(f"loopback ring ceiling, N={n}")
            ceilings[n] = wire_ceiling.ring_ceiling(n, seconds=args.ceiling_s, timeout=args.phase_timeout)
        for backend in args.backends:
            run = run_job(backend, n, idle_s=args.idle_s, settle_s=args.settle_s,
                          phase_timeout=args.phase_timeout, op_timeout=args.op_timeout, warmup=args.warmup,
                          small_iters=args.small_iters, busbw_iters=args.busbw_iters, busbw=busbw,
                          env=rank_env(backend, extra), log_dir=log_dir,
                          start_method=args.start, progress=progress)
            runs.append(run)
            if progress:
                progress(f"{backend} N={n}: {run['status']}" + (f": {run['detail'][:300]}" if run.get("detail")
                                                                  else ""))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=1)
    print(format_table(runs, machine, args.idle_s))
    if ceilings:
        print()
        print(format_ceilings(runs, ceilings))
    for note in notes:
        print(f"\n{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

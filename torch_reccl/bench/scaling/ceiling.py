"""The loopback ring's ceiling for bench/scale.py and bench/wire_ceiling.py: how fast N
processes on this machine move bytes around a ring of plain TCP sockets, with no
collective library at all (bench/wire_ceiling.py says what the number bounds).

Every rank sends to the next rank and receives from the previous one over `socks`
sockets each (a sender and a receiver thread per socket, 1 MiB writes, recv_into a
reused buffer), all ranks at once, for `seconds`.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import statistics
import sys
import threading
import time
from typing import List

CHUNK = 1 << 20


def _read_line(fd: int, deadline: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("a ring rank did not answer in time")
        part = os.read(fd, 256)
        if not part:
            raise EOFError("a ring rank exited early")
        data += part
    return data


def _rank(listener: socket.socket, successor, socks: int, seconds: float, up: int, go: int,
          timeout: float) -> None:
    """One ring rank (a forked child): dial the successor, accept the predecessor,
    then on `go` stream for `seconds`; reports bytes received and the span."""
    listener.settimeout(timeout)
    outs = [socket.create_connection(successor, timeout=timeout) for _ in range(socks)]
    ins = [listener.accept()[0] for _ in range(socks)]
    for s in outs + ins:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    os.write(up, b"ready\n")
    _read_line(go, time.monotonic() + timeout)
    received = [0] * socks
    payload = b"\x5a" * CHUNK
    start = time.monotonic()
    stop_at = start + seconds

    def send(s):
        while time.monotonic() < stop_at:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)

    def receive(i, s):
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = s.recv_into(view)
            if not n:
                return
            received[i] += n

    threads = [threading.Thread(target=send, args=(s,)) for s in outs]
    threads += [threading.Thread(target=receive, args=(i, s)) for i, s in enumerate(ins)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.monotonic() - start
    os.write(up, f"{sum(received)} {span}\n".encode())


def ring_ceiling(ranks: int, socks: int = 4, seconds: float = 2.0, timeout: float = 60.0) -> dict:
    """Runs the ring once; returns per-rank receive rates (GB/s) and their min/median."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2; got {ranks}")
    if not 1 <= socks <= 64:
        raise ValueError(f"socks must be in 1..64; got {socks}")
    listeners = []
    for _ in range(ranks):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(socks)
        listeners.append(s)
    addresses = [s.getsockname() for s in listeners]
    children: List[int] = []
    ups, gos = [], []
    try:
        for r in range(ranks):
            up_r, up_w = os.pipe()
            go_r, go_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 0
                try:
                    os.close(up_r)
                    os.close(go_w)
                    _rank(listeners[r], addresses[(r + 1) % ranks], socks, seconds, up_w, go_r, timeout)
                except BaseException as error:  # noqa: BLE001 - reported by exit status
                    print(f"ring rank {r}: {type(error).__name__}: {error}", file=sys.stderr)
                    code = 1
                os._exit(code)
            os.close(up_w)
            os.close(go_r)
            children.append(pid)
            ups.append(up_r)
            gos.append(go_w)
        deadline = time.monotonic() + timeout
        for fd in ups:
            _read_line(fd, deadline)
        for fd in gos:
            os.write(fd, b"go\n")
        deadline = time.monotonic() + seconds + timeout
        rates = []
        for fd in ups:
            nbytes, span = _read_line(fd, deadline).split()
            rates.append(int(nbytes) / float(span) / 1e9)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        for fd in ups + gos:
            os.close(fd)
        for s in listeners:
            s.close()
    return {"ranks": ranks, "socks": socks, "seconds": seconds, "GBps_per_rank": rates,
            "min_GBps": min(rates), "median_GBps": statistics.median(rates)}

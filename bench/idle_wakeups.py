#!/usr/bin/env python3
"""Threads and idle wake-ups of N idle connections in one process.

    python bench/idle_wakeups.py                      # IB emulation, 32 connections
    python bench/idle_wakeups.py --kind tcp --connections 8 --heartbeat-ms 4000
    python bench/idle_wakeups.py --json idle.json

Two transports, a and b, in this process (IB: over one verbs emulation with
devices a0, a1, b0, b1; TCP: loopback 127.0.0.1-2 and 127.0.0.3-4), N
connections a -> b, each with its primary and backup path up (so 4 path ends
per connection), one short stream on the first. Then, idle, the voluntary and
involuntary context switches of every thread over --seconds, per thread name:
a thread that sleeps and wakes counts one per wake-up. "per path end" is the I/O
threads' count (reccl-io, and reccl-ib-path where IB paths had threads of their
own) divided by the path ends and seconds. The idle heartbeat (one beat per
RECCL_HEARTBEAT_MS/4) is what remains.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from torch_reccl._native import native, testing
from torch_reccl.bench import procstat

from reccl_bench_runs import write_json

_C = native()
IO_THREADS = ("reccl-io", "reccl-ib-path")


def switches():
    """{tid: (name, context switches, CPU seconds)} of this process's threads."""
    return {tid: (t.name, t.switches, t.cpu_seconds) for tid, t in procstat.threads().items()}


def transports(kind, heartbeat_ms, busy_poll_us=None):
    common = {"RECCL_HEARTBEAT_MS": str(heartbeat_ms)}
    if kind == "ib":
        if busy_poll_us is not None:
            common["RECCL_IB_BUSY_POLL_US"] = str(busy_poll_us)
        emulation = testing().IbEmulation(["a0", "a1", "b0", "b1"])

        def make_ib(devices):
            return _C.IbTransport(emulation, dict(common, RECCL_IB_HCA=devices))

        return emulation, make_ib("a0,a1"), make_ib("b0,b1")

    def make_tcp(nics):
        return _C.Transport(dict(common, RECCL_NICS=nics))

    return None, make_tcp("127.0.0.1,127.0.0.2"), make_tcp("127.0.0.3,127.0.0.4")


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=["ib", "tcp"], default="ib")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--busy-poll-us", type=int, help="IB: RECCL_IB_BUSY_POLL_US (default: the setting's)")
    parser.add_argument("--json", metavar="PATH", help="also write the record here")
    args = parser.parse_args(argv)
    command = f"python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}"
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    emulation, a, b = transports(args.kind, args.heartbeat_ms, args.busy_poll_us)
    listeners, pairs = [], []
    for _ in range(args.connections):
        listener = b.listen(0)
        send = a.connect(0, listener.handle)
        send.wait_ready(10)
        pairs.append((send, listener.accept(10)))
        listeners.append(listener)
    send, recv = pairs[0]
    for size in (0, 1, 64 << 10):
        buf = bytearray(size)
        receive = recv.irecv(buf)
        send.isend(os.urandom(size)).wait(10)
        receive.wait(10)

    def up(c):
        return len(c.paths()) == 2 and all(" up" in p for p in c.paths())

    if not wait_until(lambda: all(up(c) for pair in pairs for c in pair), 30):
        sys.exit("not every path came up within 30 s")
    time.sleep(1.0)

    before = switches()
    time.sleep(args.seconds)
    after = switches()
    wakeups, threads, cpu = collections.Counter(), collections.Counter(), collections.Counter()
    for tid, (name, count, seconds) in after.items():
        threads[name] += 1
        if tid in before:
            wakeups[name] += count - before[tid][1]
            cpu[name] += seconds - before[tid][2]
    path_ends = 4 * args.connections
    print(f"{args.kind}: {args.connections} idle connections ({path_ends} path ends), "
          f"heartbeat {args.heartbeat_ms} ms, {len(after)} threads")
    print(f"{'thread':18s} {'count':>6s} {'wake-ups/s':>11s}")
    for name in sorted(threads):
        print(f"{name:18s} {threads[name]:6d} {wakeups[name] / args.seconds:11.1f}")
    io = sum(wakeups[name] for name in IO_THREADS) / args.seconds
    io_cpu = sum(cpu[name] for name in IO_THREADS) / args.seconds
    print(f"I/O threads: {sum(threads[name] for name in IO_THREADS)}, "
          f"{io:.1f} wake-ups/s, {io / path_ends:.1f} per path end, "
          f"{1000 * io_cpu:.1f} ms CPU per second (a polling thread shows here, not in wake-ups)")
    write_json(args.json, {
        "meta": {"command": command, "date": date, "load": os.getloadavg()[0],
                 "library": _C.__file__},
        "kind": args.kind, "connections": args.connections, "path_ends": path_ends,
        "heartbeat_ms": args.heartbeat_ms, "seconds": args.seconds, "threads": len(after),
        "per_thread_name": {name: {"threads": threads[name],
                                   "wakeups_per_s": wakeups[name] / args.seconds}
                            for name in sorted(threads)},
        "io_threads": sum(threads[name] for name in IO_THREADS),
        "io_wakeups_per_s_per_path_end": io / path_ends,
        "io_cpu_ms_per_s": 1000 * io_cpu, "busy_poll_us": args.busy_poll_us})
    for send, recv in pairs:
        send.close()
        recv.close()
    for listener in listeners:
        listener.close()
    del emulation


if __name__ == "__main__":
    main()

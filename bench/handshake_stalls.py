#!/usr/bin/env python3
"""Loopback handshake latency of the machine itself, no reccl involved: a baseline for set-up times.

    python bench/handshake_stalls.py                 # 4 and 8 processes
    python bench/handshake_stalls.py --procs 4 --rounds 10 --json out.json

Each of N processes listens on 127.0.0.1 and, after all listen, dials every other
process --sockets times per round, one after another: connect, send a 128-byte
greeting, wait for a 16-byte answer (the shape of a reccl HELLO handshake). It
prints the distribution of one handshake's time. A machine whose idle CPUs wake
late (seen on the GPU machine, a VM: 2-4% of handshakes take 10-30 ms) delays any
library's connection set-up by that much per sequential handshake, Gloo's too;
bench/scale.py's set-up times are to be read against it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import selectors
import socket
import sys
import threading
import time

TIMEOUT_S = 120.0
GREETING, ANSWER = 128, 16


def _answer(listener: socket.socket, stop: threading.Event) -> None:
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    received = {}
    while not stop.is_set():
        for key, _ in selector.select(0.2):
            if key.data is None:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                received[conn] = 0
                selector.register(conn, selectors.EVENT_READ, True)
                continue
            conn = key.fileobj
            data = conn.recv(4096)
            if not data:
                selector.unregister(conn)
                conn.close()
                continue
            received[conn] += len(data)
            if received[conn] >= GREETING:
                conn.send(b"a" * ANSWER)
                selector.unregister(conn)


def _proc(rank: int, ports, rounds: int, sockets: int, ready, results, done) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", ports[rank]))
    listener.listen(512)
    listener.setblocking(False)
    stop = threading.Event()
    threading.Thread(target=_answer, args=(listener, stop), daemon=True).start()
    ready.wait(TIMEOUT_S)
    times, keep = [], []
    for _ in range(rounds):
        for peer, port in enumerate(ports):
            if peer == rank:
                continue
            for _ in range(sockets):
                t0 = time.perf_counter()
                conn = socket.create_connection(("127.0.0.1", port), timeout=10)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(b"h" * GREETING)
                got = 0
                while got < ANSWER:
                    chunk = conn.recv(ANSWER - got)
                    if not chunk:
                        raise ConnectionError(f"process {peer} closed the handshake")
                    got += len(chunk)
                times.append(time.perf_counter() - t0)
                keep.append(conn)
    results.put(times)
    done.wait(TIMEOUT_S)   # keep answering until every process has finished dialing
    stop.set()


def _free_ports(count: int):
    held = [socket.socket() for _ in range(count)]
    for s in held:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


def measure(procs: int, rounds: int, sockets: int) -> dict:
    ctx = mp.get_context("fork")
    ready, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    ports = _free_ports(procs)
    workers = [ctx.Process(target=_proc, args=(r, ports, rounds, sockets, ready, results, done))
               for r in range(procs)]
    for w in workers:
        w.start()
    time.sleep(0.5)   # every listener up
    ready.set()
    times = []
    try:
        for _ in workers:
            times += results.get(timeout=TIMEOUT_S)
    finally:
        done.set()
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    times.sort()

    def pick(q):
        return times[min(len(times) - 1, int(q * len(times)))] * 1e3

    return {"procs": procs, "handshakes": len(times), "median_ms": pick(0.5), "p99_ms": pick(0.99),
            "max_ms": times[-1] * 1e3, "over_10ms": sum(t > 0.010 for t in times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sockets", type=int, default=10, help="handshakes per peer per round")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.procs):
        p.error("--procs: every count must be at least 2")
    rows = []
    for n in args.procs:
        row = measure(n, args.rounds, args.sockets)
        rows.append(row)
        print(f"{n} processes: {row['handshakes']} handshakes, median {row['median_ms']:.3f} ms, "
              f"p99 {row['p99_ms']:.2f} ms, max {row['max_ms']:.2f} ms, "
              f"{row['over_10ms']} over 10 ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

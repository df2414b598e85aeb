#!/usr/bin/env python3
"""Point-to-point throughput of one reccl connection against raw TCP, fault-free.

    python bench/p2p_throughput.py                       # 1..256 MiB, loopback "NICs"
    python bench/p2p_throughput.py --backup both         # also RECCL_BACKUP=0 (no standby path)
    python bench/p2p_throughput.py --grey both           # also RECCL_GREY=0 (no busy bookkeeping)
    python bench/p2p_throughput.py --nsocks 8 --json out.json

What runs (all processes from a ``spawn`` multiprocessing context, one machine):

* reccl: a sender process and a receiver process joined by one
  ``torch_reccl.transport`` connection over ``--nics`` (default 127.0.0.1,127.0.0.2:
  primary 127.0.0.1, backup 127.0.0.2). The sender keeps ``--window`` isends in
  flight, the receiver keeps the same number of irecvs posted (so there is always a
  clear-to-send ahead of the sender). A reccl send completes when the receiver has
  acknowledged every byte.
* raw: the baseline, a sender process and a receiver process joined by
  ``RECCL_NSOCKS`` plain TCP sockets (same count as reccl's data sockets per path,
  TCP_NODELAY like reccl, default buffer sizes) plus one control socket, from and to
  the first NIC's address. Every message is split into N equal slices; socket k
  carries slice k of every message. One Python thread per socket does
  ``sock.sendall(memoryview)`` / ``sock.recv_into(view, n, MSG_WAITALL)``; both
  release the GIL and move a whole slice (>= 256 KiB) per call, so the Python
  overhead is one system call per slice and the kernel does the copying, as in reccl.
  The receiver cycles through ``--window`` preallocated buffers. When every slice of
  every message has landed, it sends one byte back on the control socket; the
  sender's clock stops when that byte arrives (the analogue of reccl's ACK).

One trial = ``count`` messages of one size, timed on the sender from the first send
to the last completion (``time.perf_counter``); bytes are message payload bytes,
GB/s = 1e9 bytes/s. For each size: one warm-up trial per variant (discarded), then
``--reps`` rounds, each running every variant once in a fixed order (A, B, A, B, ...),
so drift and background load hit all variants alike. The table gives the median
GB/s per variant and the median of the per-round ratios reccl/raw (min-max in
brackets). CPU columns: sender + receiver process CPU time (all threads, user+sys)
per GB moved. After each trial the receiver compares the last message it received
with the expected bytes (outside the timed region); a mismatch aborts the run.
Every worker freezes and disables Python's cyclic GC after set-up (see quiet_gc).

To measure another build of torch_reccl, put it first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import threading
import time

MiB = 1 << 20
PIPE_TIMEOUT_S = 120.0     # bound on any driver <-> worker exchange
IO_TIMEOUT_S = 120.0       # bound on any single request / socket wait
MAX_INFLIGHT_BYTES = 512 * MiB


# ----------------------------------------------------------------- helpers
def pattern(nbytes: int):
    """Deterministic, cheap, non-constant payload (both ends compute it)."""
    import numpy as np

    words = (nbytes + 7) // 8
    a = np.arange(words, dtype=np.uint64)
    a *= np.uint64(0x9E3779B97F4A7C15)
    a ^= a >> np.uint64(29)
    return a.view(np.uint8)[:nbytes]


def recv_msg(pipe, timeout: float = PIPE_TIMEOUT_S):
    if not pipe.poll(timeout):
        raise TimeoutError(f"no message from the peer process within {timeout:.0f} s")
    return pipe.recv()


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def quiet_gc() -> None:
    """Python's cyclic GC would otherwise rescan torch's large heap (imported with
    torch_reccl) every few thousand allocations: measured at ~7% of a reccl worker's
    CPU at 1 MiB messages. Freeze what exists after set-up; trials run with the GC off
    (they make no cycles). Done in every worker, reccl and raw alike."""
    gc.collect()
    gc.freeze()
    gc.disable()


def reccl_env(cfg: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith("RECCL_")}
    env.update({
        "RECCL_NICS": cfg["nics"],
        "RECCL_NSOCKS": str(cfg["nsocks"]),
        "RECCL_CHUNK_BYTES": str(cfg["chunk"]),
        "RECCL_BACKUP": str(cfg["backup"]),
    })
    if "grey" in cfg:
        env["RECCL_GREY"] = str(cfg["grey"])
    return env


def windows_for(size: int, window: int) -> int:
    return max(1, min(window, MAX_INFLIGHT_BYTES // size))


# ------------------------------------------------------- shared worker loops
def trials(pipe):
    """The driver's trial commands, one ``(size, count, window)`` each, until it
    says quit."""
    while True:
        cmd, arg = recv_msg(pipe, 3600)
        if cmd == "quit":
            return
        yield arg


def serve_receiver(pipe, cfg, receive) -> None:
    """The receiving end of every variant, once connected.

    For each trial, ``receive(bufs, count, prepped)`` takes ``count`` messages into
    ``bufs`` (the trial's ``window`` slices of one preallocated pool, in turn) and
    calls ``prepped()`` as soon as the first receives are posted, so the driver can
    start the sender. Reported per trial: the process CPU time ``receive`` took and
    whether the last message holds the expected bytes (checked outside the timing).
    """
    import numpy as np

    expected = pattern(cfg["max_size"])
    pool = np.empty(cfg["pool_bytes"], np.uint8)
    pool.fill(0)   # touch every page now, not inside a timed trial
    quiet_gc()
    for size, count, window in trials(pipe):
        bufs = [pool[i * size:(i + 1) * size] for i in range(window)]
        c0 = cpu_s()
        receive(bufs, count, lambda: pipe.send(("prepped", None)))
        cpu = cpu_s() - c0
        ok = bool(np.array_equal(bufs[(count - 1) % window], expected[:size]))
        pipe.send(("done", (cpu, ok)))


def serve_sender(pipe, cfg, send) -> None:
    """The sending end of every variant, once connected.

    For each trial, ``send(payload, size, count, window)`` sends ``count`` messages
    of ``payload[:size]`` and returns the ``time.perf_counter()`` at which the
    receiver had acknowledged the last one. Reported per trial: seconds from the
    start of ``send`` to that instant, and the process CPU time ``send`` took.
    """
    payload = pattern(cfg["max_size"])
    quiet_gc()
    for size, count, window in trials(pipe):
        c0 = cpu_s()
        t0 = time.perf_counter()
        t1 = send(payload, size, count, window)
        pipe.send(("done", (t1 - t0, cpu_s() - c0)))


# ------------------------------------------------------------- reccl workers
def reccl_receiver(pipe, cfg):
    from torch_reccl.transport import Transport

    try:
        transport = Transport(reccl_env(cfg))
        listener = transport.listen(0)
        pipe.send(("handle", listener.handle))
        conn = listener.accept(timeout=30)
        pipe.send(("ready", None))

        def receive(bufs, count, prepped):
            window = len(bufs)
            reqs = [conn.irecv(bufs[i]) for i in range(min(window, count))]
            prepped()
            size = len(bufs[0])
            for i in range(count):
                got = reqs[i % window].wait(IO_TIMEOUT_S)
                if got != size:
                    raise RuntimeError(f"received {got} bytes, expected {size}")
                if i + window < count:
                    reqs[i % window] = conn.irecv(bufs[i % window])

        serve_receiver(pipe, cfg, receive)
        conn.close()
    except BaseException as e:  # reported to the driver
        pipe.send(("error", f"reccl receiver: {type(e).__name__}: {e}"))


def reccl_sender(pipe, cfg):
    from torch_reccl.transport import Transport

    try:
        transport = Transport(reccl_env(cfg))
        _, handle = recv_msg(pipe)
        conn = transport.connect(0, handle)
        conn.wait_ready(30)
        pipe.send(("ready", conn.paths()))

        def send(payload, size, count, window):
            msg = payload[:size]
            reqs = []
            for i in range(count):
                if i >= window:
                    reqs[i % window].wait(IO_TIMEOUT_S)
                    reqs[i % window] = conn.isend(msg)
                else:
                    reqs.append(conn.isend(msg))
            for r in reqs:
                r.wait(IO_TIMEOUT_S)
            return time.perf_counter()

        serve_sender(pipe, cfg, send)
        conn.close()
    except BaseException as e:
        pipe.send(("error", f"reccl sender: {type(e).__name__}: {e}"))


# --------------------------------------------------------------- raw workers
def _blocking_with_timeouts(s: socket.socket) -> None:
    """Blocking socket (so MSG_WAITALL / sendall are one system call per slice)
    whose every send/recv is still bounded, by SO_SNDTIMEO / SO_RCVTIMEO."""
    s.settimeout(None)
    tv = struct.pack("ll", int(IO_TIMEOUT_S), 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(s: socket.socket, view: memoryview) -> None:
    while len(view):
        got = s.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionError("peer closed the socket")
        view = view[got:]


def _slices(size: int, n: int):
    return [(k * size // n, (k + 1) * size // n) for k in range(n)]


def _run_per_socket(n: int, fn, join_timeout: float):
    """Starts ``fn(k)`` for k in 0..n-1, one thread per data socket, and returns
    ``join``: ``join()`` waits for the threads (each at most ``join_timeout`` s) and
    returns the errors they raised, plus 'thread hung' for each one still running."""
    errors = []

    def run(k):
        try:
            fn(k)
        except BaseException as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()

    def join():
        for t in threads:
            t.join(join_timeout)
        return errors + ["thread hung" for t in threads if t.is_alive()]

    return join


def raw_receiver(pipe, cfg):
    try:
        n = cfg["nsocks"]
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((cfg["raw_addr"], 0))
        lsock.listen(n + 1)
        lsock.settimeout(30)
        pipe.send(("handle", lsock.getsockname()))
        socks = [None] * (n + 1)
        for _ in range(n + 1):
            s, _ = lsock.accept()
            _blocking_with_timeouts(s)
            idx = s.recv(1, socket.MSG_WAITALL)[0]
            socks[idx] = s
        lsock.close()
        ctrl, data = socks[0], socks[1:]
        pipe.send(("ready", None))

        def receive(bufs, count, prepped):
            window = len(bufs)
            views = [memoryview(b) for b in bufs]
            parts = _slices(len(bufs[0]), n)

            def receive_slices(k):
                lo, hi = parts[k]
                for i in range(count):
                    _recv_exact(data[k], views[i % window][lo:hi])

            join = _run_per_socket(n, receive_slices, IO_TIMEOUT_S * 2)
            prepped()
            errors = join()
            if errors:
                raise RuntimeError(f"raw receive failed: {errors}")
            ctrl.sendall(b"!")

        serve_receiver(pipe, cfg, receive)
        for s in socks:
            s.close()
    except BaseException as e:
        pipe.send(("error", f"raw receiver: {type(e).__name__}: {e}"))


def raw_sender(pipe, cfg):
    try:
        n = cfg["nsocks"]
        _, addr = recv_msg(pipe)
        socks = []
        for k in range(n + 1):
            s = socket.create_connection(addr, timeout=30,
                                         source_address=(cfg["raw_addr"], 0))
            _blocking_with_timeouts(s)
            s.sendall(bytes([k]))
            socks.append(s)
        ctrl, data = socks[0], socks[1:]
        pipe.send(("ready", [f"raw {len(data)} sockets {cfg['raw_addr']} -> {addr}"]))

        def send(payload, size, count, window):
            views = [memoryview(payload)[lo:hi] for lo, hi in _slices(size, n)]

            def send_slices(k):
                v, s = views[k], data[k]
                for _ in range(count):
                    s.sendall(v)

            join = _run_per_socket(n, send_slices, IO_TIMEOUT_S)
            ack = ctrl.recv(1)
            t1 = time.perf_counter()
            errors = join()
            if errors or ack != b"!":
                raise RuntimeError(f"raw send failed: {errors or 'no ack'}")
            return t1

        serve_sender(pipe, cfg, send)
        for s in socks:
            s.close()
    except BaseException as e:
        pipe.send(("error", f"raw sender: {type(e).__name__}: {e}"))


# -------------------------------------------------------------------- driver
class Pair:
    """One sender process and one receiver process of a variant."""

    def __init__(self, ctx, name: str, kind: str, cfg: dict):
        self.name, self.kind, self.cfg = name, kind, cfg
        send_fn, recv_fn = ((reccl_sender, reccl_receiver) if kind == "reccl"
                            else (raw_sender, raw_receiver))
        self.rpipe, rchild = ctx.Pipe()
        self.spipe, schild = ctx.Pipe()
        self.rproc = ctx.Process(target=recv_fn, args=(rchild, cfg), daemon=True,
                                 name=f"{name}-recv")
        self.sproc = ctx.Process(target=send_fn, args=(schild, cfg), daemon=True,
                                 name=f"{name}-send")
        self.paths = None

    def _get(self, pipe, want: str, timeout: float = PIPE_TIMEOUT_S):
        tag, val = recv_msg(pipe, timeout)
        if tag == "error":
            raise RuntimeError(f"[{self.name}] {val}")
        if tag != want:
            raise RuntimeError(f"[{self.name}] expected {want!r}, got {tag!r}")
        return val

    def start(self):
        self.rproc.start()
        self.sproc.start()
        handle = self._get(self.rpipe, "handle")
        self.spipe.send(("handle", handle))
        self.paths = self._get(self.spipe, "ready")
        self._get(self.rpipe, "ready")

    def trial(self, size: int, count: int, window: int) -> dict:
        self.rpipe.send(("trial", (size, count, window)))
        self._get(self.rpipe, "prepped")
        self.spipe.send(("trial", (size, count, window)))
        seconds, cpu_send = self._get(self.spipe, "done")
        cpu_recv, ok = self._get(self.rpipe, "done")
        if not ok:
            raise RuntimeError(f"[{self.name}] payload mismatch at {size} bytes")
        nbytes = size * count
        return {"variant": self.name, "size": size, "count": count, "window": window,
                "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                "cpu_send_s": cpu_send, "cpu_recv_s": cpu_recv,
                "cpu_s_per_gb": (cpu_send + cpu_recv) / (nbytes / 1e9)}

    def stop(self):
        for pipe in (self.spipe, self.rpipe):
            try:
                pipe.send(("quit", None))
            except (OSError, ValueError):
                pass
        for proc in (self.sproc, self.rproc):
            if proc.pid is None:
                continue
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def first_nic_address(nics: str) -> str:
    from torch_reccl._native import native

    first = native().discover_nics({"RECCL_NICS": nics})[0]
    return first["address"]


def extension_info() -> str:
    """Which build of the extension ran (others may rebuild it in place)."""
    import torch_reccl._native as nat

    path = getattr(nat.native(), "__file__", "?")
    try:
        st = os.stat(path)
        when = datetime.datetime.fromtimestamp(st.st_mtime).isoformat(timespec="seconds")
        return f"{path} ({st.st_size} bytes, built {when})"
    except OSError:
        return path


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


def summarize(results, variants, sizes):
    rows = []
    for size in sizes:
        row = {"size": size}
        per = {v: [r for r in results if r["variant"] == v and r["size"] == size]
               for v in variants}
        for v in variants:
            row[v] = statistics.median(r["gbps"] for r in per[v])
            row[v + "_cpu"] = statistics.median(r["cpu_s_per_gb"] for r in per[v])
        for v in variants:
            if v == "raw":
                continue
            ratios = [a["gbps"] / b["gbps"] for a, b in zip(per[v], per["raw"])]
            row[v + "/raw"] = statistics.median(ratios)
            row[v + "/raw_range"] = (min(ratios), max(ratios))
        rows.append(row)
    return rows


def print_table(rows, variants, out=sys.stdout):
    names = [v for v in variants if v != "raw"]
    head = ["size"] + [f"{v} GB/s" for v in names] + ["raw GB/s"]
    head += [f"{v}/raw [min-max]" for v in names]
    head += [f"{v} cpu s/GB" for v in variants]
    lines = [head]
    for row in rows:
        line = [fmt_size(row["size"])]
        line += [f"{row[v]:.2f}" for v in names] + [f"{row['raw']:.2f}"]
        for v in names:
            lo, hi = row[v + "/raw_range"]
            line.append(f"{row[v + '/raw']:.2f} [{lo:.2f}-{hi:.2f}]")
        line += [f"{row[v + '_cpu']:.2f}" for v in variants]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for j, row in enumerate(lines):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nics", default=os.environ.get("RECCL_NICS", "127.0.0.1,127.0.0.2"),
                    help="RECCL_NICS for both ends (default 127.0.0.1,127.0.0.2)")
    ap.add_argument("--sizes", default="1,4,16,64,256",
                    help="message sizes in MiB, comma separated (default 1,4,16,64,256)")
    # Defaults: the environment's RECCL_* value, else the setting's own default.
    from torch_reccl.settings import settings
    setting = {s["name"]: os.environ.get(s["name"], s["default"]) for s in settings()}
    # RECCL_NSOCKS=0: a Transport's own default, 4 (csrc/transport/tcp/tcp_transport.cc).
    nsocks = int(setting["RECCL_NSOCKS"]) or 4
    ap.add_argument("--nsocks", type=int, default=nsocks,
                    help=f"RECCL_NSOCKS and the raw baseline's socket count (default {nsocks})")
    ap.add_argument("--chunk", type=int, default=int(setting["RECCL_CHUNK_BYTES"]),
                    help=f"RECCL_CHUNK_BYTES (default {setting['RECCL_CHUNK_BYTES']})")
    ap.add_argument("--backup", choices=["0", "1", "both"], default="1",
                    help="RECCL_BACKUP for the reccl variant; 'both' runs reccl (backup=1) "
                         "and reccl-nobk (backup=0) side by side (default 1)")
    ap.add_argument("--grey", choices=["1", "both"], default="1",
                    help="'both' runs reccl with RECCL_GREY=1 and =0 side by side (the "
                         "detector's busy bookkeeping on and off; with --backup 1 or 0)")
    ap.add_argument("--window", type=int, default=4,
                    help="messages in flight (default 4; capped at 512 MiB in flight)")
    ap.add_argument("--reps", type=int, default=5, help="rounds per size (default 5)")
    ap.add_argument("--trial-mib", type=int, default=512,
                    help="bytes per trial in MiB (count = max(4, this/size); default 512)")
    ap.add_argument("--json", metavar="FILE", help="also write every trial and the "
                    "summary as JSON ('-' for stdout)")
    args = ap.parse_args(argv)

    sizes = [int(float(s) * MiB) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0:
        ap.error("--sizes needs positive sizes")
    if not 1 <= args.nsocks <= 16:
        ap.error("--nsocks must be in 1..16 (RECCL_NSOCKS range)")
    max_size = max(sizes)
    pool = max(windows_for(s, args.window) * s for s in sizes)
    base = {"nics": args.nics, "nsocks": args.nsocks, "chunk": args.chunk,
            "max_size": max_size, "pool_bytes": pool}
    base["raw_addr"] = first_nic_address(args.nics)

    variants = []
    if args.grey == "both":
        # the grey-failure detector's per-message busy bookkeeping, on and off
        variants.append(("reccl-grey", "reccl", dict(base, backup=0 if args.backup == "0" else 1, grey=1)))
        variants.append(("reccl-nogrey", "reccl", dict(base, backup=0 if args.backup == "0" else 1, grey=0)))
        variants.append(("raw", "raw", dict(base, backup=1)))
    elif args.backup in ("1", "both"):
        variants.append(("reccl", "reccl", dict(base, backup=1)))
    if args.grey != "both" and args.backup in ("0", "both"):
        variants.append(("reccl-nobk" if args.backup == "both" else "reccl", "reccl",
                         dict(base, backup=0)))
    if args.grey != "both":
        variants.append(("raw", "raw", dict(base, backup=1)))
    names = [v[0] for v in variants]

    command = " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    meta = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "kernel": platform.release(), "loadavg_start": os.getloadavg(),
        "nics": args.nics, "nsocks": args.nsocks, "chunk_bytes": args.chunk,
        "backup": args.backup, "grey": args.grey, "window": args.window, "reps": args.reps,
        "trial_mib": args.trial_mib, "raw_addr": base["raw_addr"],
        "extension": extension_info(),
    }
    print(f"# {command}")
    print(f"# {meta['date']}  host {meta['host']}  {meta['cpus']} cpus  "
          f"load {meta['loadavg_start'][0]:.2f}  kernel {meta['kernel']}")
    print(f"# extension {meta['extension']}")
    print(f"# NICS {args.nics}  NSOCKS {args.nsocks}  CHUNK {args.chunk}  "
          f"window {args.window}  reps {args.reps}  variants {', '.join(names)}")

    ctx = mp.get_context("spawn")
    pairs = []
    results = []
    t_start = time.monotonic()
    try:
        for name, kind, cfg in variants:
            p = Pair(ctx, name, kind, cfg)
            pairs.append(p)
            p.start()
            print(f"# {name}: {'; '.join(p.paths)}")
        for size in sizes:
            count = max(4, args.trial_mib * MiB // size)
            window = windows_for(size, args.window)
            for p in pairs:                        # warm-up, discarded
                p.trial(size, max(window, count // 4), window)
            for rep in range(args.reps):
                for p in pairs:
                    r = p.trial(size, count, window)
                    r["rep"] = rep
                    results.append(r)
            line = "  ".join(
                f"{n} " + "/".join(f"{r['gbps']:.2f}" for r in results
                                   if r["variant"] == n and r["size"] == size)
                for n in names)
            print(f"# {fmt_size(size):>8} x{count} w{window}: {line}", flush=True)
    finally:
        for p in pairs:
            p.stop()
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = os.getloadavg()
    rows = summarize(results, names, sizes)
    print(f"# {meta['elapsed_s']} s; load at end {meta['loadavg_end'][0]:.2f}")
    print()
    print_table(rows, names)
    if args.json:
        doc = {"meta": meta, "trials": results, "summary": rows}
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

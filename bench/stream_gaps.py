#!/usr/bin/env python3
"""Steady-state completion gaps of one streaming reccl connection (a regression check).

    python bench/stream_gaps.py                    # 64 KiB and 1 MiB messages, 8 s each
    python bench/stream_gaps.py --sizes 1024 --seconds 20 --json gaps.json

A sender process streams messages to a receiver process over one connection
(loopback "NICs" by default), ``--window`` sends in flight and twice as many
receives posted, and records ``time.monotonic()`` at every send completion. It
prints the rate and the distribution of the gaps between completions. On a healthy
build the stream has no long gaps; a stall in the protocol shows up as gaps of a
fixed size (e.g. ~40 ms, the Linux delayed-ACK timer, when a control socket runs
with Nagle on: seen at commit 9807306, fixed in 9668532).
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
import time

from reccl_bench_runs import write_json

TIMEOUT_S = 60.0


def receiver(nics, size, window, handles, stop):
    import numpy as np

    from torch_reccl.transport import TimeoutError as RTimeout, Transport

    transport = Transport({"RECCL_NICS": nics})
    listener = transport.listen(0)
    handles.put(listener.handle)
    conn = listener.accept(30)
    depth = 2 * window
    bufs = [np.empty(size, np.uint8) for _ in range(depth)]
    reqs = [conn.irecv(b) for b in bufs]
    gc.collect()
    gc.freeze()
    gc.disable()
    i = 0
    deadline = time.monotonic() + 600
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            reqs[i % depth].wait(0.1)
        except RTimeout:
            continue
        except Exception:
            break   # the sender closed
        reqs[i % depth] = conn.irecv(bufs[i % depth])
        i += 1
    conn.close()


def run(nics: str, size: int, window: int, seconds: float) -> dict:
    """One size's record: rate and the gaps between send completions."""
    import numpy as np

    from torch_reccl.transport import Transport

    ctx = mp.get_context("spawn")
    handles, stop = ctx.Queue(), ctx.Event()
    peer = ctx.Process(target=receiver, args=(nics, size, window, handles, stop), daemon=True)
    peer.start()
    try:
        transport = Transport({"RECCL_NICS": nics})
        conn = transport.connect(0, handles.get(timeout=TIMEOUT_S))
        conn.wait_ready(30)
        msg = np.ones(size, np.uint8)
        reqs = [conn.isend(msg) for _ in range(window)]
        gc.collect()
        gc.freeze()
        gc.disable()
        times = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            reqs[i % window].wait(TIMEOUT_S)
            times.append(time.monotonic())
            reqs[i % window] = conn.isend(msg)
            i += 1
        for r in reqs:
            r.wait(TIMEOUT_S)
        gc.enable()
        conn.close()
    finally:
        stop.set()
        peer.join(10)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
    g = np.diff(np.array(times)) * 1e3
    return {"bytes": size, "messages": len(times), "seconds": seconds,
            "msgs_per_s": len(times) / seconds, "gb_per_s": len(times) * size / seconds / 1e9,
            "gap_ms_p50": float(np.median(g)), "gap_ms_p99": float(np.percentile(g, 99)),
            "gap_ms_max": float(g.max()), "gaps_over_10ms": int((g > 10).sum()),
            "gaps_over_30ms": int((g > 30).sum()),
            "percent_of_time_in_gaps_over_10ms": float(g[g > 10].sum() / seconds / 10)}


def line(r: dict) -> str:
    return (f"{r['bytes']:>9} B: {r['msgs_per_s']:8.0f} msgs/s {r['gb_per_s']:6.2f} GB/s"
            f"  gap ms p50 {r['gap_ms_p50']:.3f} p99 {r['gap_ms_p99']:.2f} max {r['gap_ms_max']:.1f}"
            f"  gaps >10 ms: {r['gaps_over_10ms']} (>30 ms: {r['gaps_over_30ms']}),"
            f" {r['percent_of_time_in_gaps_over_10ms']:.1f}% of the time")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nics", default=os.environ.get("RECCL_NICS", "127.0.0.1,127.0.0.2"))
    ap.add_argument("--sizes", default="65536,1048576", help="message bytes, comma list")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0, help="per size (default 8)")
    ap.add_argument("--json", metavar="PATH", help="also write every size's record here")
    args = ap.parse_args(argv)
    command = f"python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}"
    date = time.strftime('%Y-%m-%dT%H:%M:%S%z')
    print(f"# {command}")
    print(f"# {date}  {os.cpu_count()} cpus  "
          f"load {os.getloadavg()[0]:.2f}  window {args.window}  NICS {args.nics}")
    records = []
    for size in (int(s) for s in args.sizes.split(",") if s.strip()):
        records.append(run(args.nics, size, args.window, args.seconds))
        print(line(records[-1]), flush=True)
    write_json(args.json, {"meta": {"command": command, "date": date, "window": args.window,
                                    "nics": args.nics}, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Time to recover from a fault, for a streaming reccl connection, on the emulated fabric.

    sudo python bench/failover_latency.py                         # link, bh:200, bh:1000
    sudo python bench/failover_latency.py --faults 100 --scenarios link --fault-host 1

Needs root (network namespaces; see docs/fabric.md), pyroute2, and `nft` for the
blackhole scenarios.

Set-up: ``Fabric(hosts=2, rails=2)``, a sender process in host 0 and a receiver
process in host 1 (both started with ``Fabric.popen``; ``RECCL_NICS=eth0,eth1``, so
the primary path is eth0->eth0 on rail 0 and the backup eth1->eth1 on rail 1). The
sender streams ``--msg-kib`` messages continuously with ``--window`` isends in
flight; the receiver keeps twice as many irecvs posted. A send completes when the
receiver has acknowledged all of it. At every completion the sender notes
``time.monotonic()`` and the connection's active path; it reports the first
completion after every change of path (and the last one before it).

One fault: the driver (root namespace) waits until the stream runs on the primary
with the backup path up, then injects the fault and takes ``t_fault =
time.monotonic()`` right after the call that applies it returns (for ``nic_down``
the netlink request that downs the bridge-side veth, ``wait=False``; for
``blackhole`` the ``nft`` run that installs the drop rules; the call's own duration
is reported as the uncertainty of ``t_fault``). It then waits for the sender's
first completion on the backup path:

    recovery = t(first send completion on the backup) - t_fault

i.e. from the fault to the first message acknowledged over the backup path (a
message finished by the resync counts: the receiver reported it over the backup).
``--hold-s`` later it heals the fault (``nic_up`` / blackhole off) and waits until
completions run on the primary again (failback) and both paths are up, then the
next fault. Also reported: the interruption, the library's own ``failover`` event ``duration_s`` on
both ends (detection -> traffic resumed, as measured inside the library) and the
detection delay (t of the sender's ``path_down`` event for the primary - t_fault;
event times are wall-clock, mapped to monotonic with each process's own offset).

Clocks: CLOCK_MONOTONIC is not per network namespace (only a time namespace would
change it), so the driver's and the workers' ``time.monotonic()`` are one clock.
The script checks this at start: each worker's reading must fall between the
driver's readings just before and after the request, and its /proc/self/ns/time
must be the driver's.

Both workers freeze and disable Python's cyclic GC once streaming starts, so no GC
pass over torch's heap (imported with torch_reccl) shifts a timestamp. To measure
another build of torch_reccl, put it first on PYTHONPATH.

Scenarios (``--scenarios``): ``link`` = ``nic_down(h, 0)`` / ``nic_up`` (carrier
loss, detected by netlink), ``bh:MS`` = ``blackhole(h, 0)`` on/off with
RECCL_HEARTBEAT_MS=MS (silent drops, detected by heartbeat timeout). ``h`` is
``--fault-host`` (0 = the sender's host, 1 = the receiver's, ``alt`` = alternate).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import platform
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EVENT_KINDS = ["path_down", "path_up", "failover", "failback", "nic_down", "nic_up",
               "connection_failed"]


# ===================================================================== workers
class Out:
    """JSON lines on stdout, from several threads."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, **rec):
        line = json.dumps(rec)
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def worker_common(role: str) -> Out:
    """Says hello (pid, clocks, namespaces, extension) and forwards the library's
    events; returns the worker's output."""
    import torch_reccl
    from torch_reccl._native import native

    out = Out()
    so = native().__file__
    built = datetime.datetime.fromtimestamp(os.stat(so).st_mtime).isoformat(timespec="seconds")
    wall_minus_mono = time.time() - time.monotonic()
    out(ev="hello", role=role, pid=os.getpid(), mono=time.monotonic(),
        wall_minus_mono=wall_minus_mono,
        netns=os.readlink("/proc/self/ns/net"), timens=os.readlink("/proc/self/ns/time"),
        extension=f"{so} (built {built})")

    def on_event(e):
        out(ev="lib", kind=e.kind, reason=e.reason, mono=e.time - wall_minus_mono,
            duration_s=e.duration_s, bytes_replayed=e.bytes_replayed,
            from_path=e.from_path, to_path=e.to_path, nic=e.nic, detail=e.detail)

    torch_reccl.on_event(on_event, kinds=EVENT_KINDS)
    return out


def stdin_commands(handler):
    """Reads JSON commands from stdin on a thread; EOF means stop."""
    def run():
        for line in sys.stdin:
            line = line.strip()
            if line:
                handler(json.loads(line))
        handler({"cmd": "stop"})
    threading.Thread(target=run, name="stdin", daemon=True).start()


def quiet_gc() -> None:
    """No GC pass over torch's heap (imported with torch_reccl) in the middle of a
    timed stream: freeze what exists, then leave the GC off."""
    gc.collect()
    gc.freeze()
    gc.disable()


def stream(reqs: collections.deque, post_next, stop: threading.Event,
           max_run_s: float):
    """The loop of both workers: waits for the oldest request in ``reqs`` and, when
    it completes, replaces it with ``post_next(n)``, n being the completions so
    far. Ends on ``stop``, after ``max_run_s``, or when the connection fails.
    Returns ``(n, error)``, error None unless the connection failed."""
    from torch_reccl.transport import TimeoutError as RTimeout

    n = 0
    deadline = time.monotonic() + max_run_s
    error = None
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            reqs[0].wait(0.05)
        except RTimeout:
            continue
        except Exception as e:  # the connection failed: report it
            error = f"{type(e).__name__}: {e}"
            break
        n += 1
        posted = post_next(n)
        reqs.popleft()
        reqs.append(posted)
    return n, error


def worker_receiver(args) -> int:
    import numpy as np

    from torch_reccl.transport import Transport

    out = worker_common("receiver")
    stop = threading.Event()

    def handle(cmd):
        if cmd["cmd"] == "stop":
            stop.set()
        elif cmd["cmd"] == "clock":
            out(ev="clock", mono=time.monotonic(), seq=cmd["seq"])

    transport = Transport()
    listener = transport.listen(0)
    out(ev="handle", handle=listener.handle.hex())
    stdin_commands(handle)
    conn = listener.accept(30)
    out(ev="accepted")
    size = args.msg_kib * 1024
    depth = 2 * args.window
    bufs = [np.empty(size, np.uint8) for _ in range(depth)]
    reqs = collections.deque(conn.irecv(b) for b in bufs)
    quiet_gc()
    # the buffer of the n-th completed receive is free again: post the next one there
    n, error = stream(reqs, lambda done: conn.irecv(bufs[(done - 1) % depth]), stop,
                      args.max_run_s)
    out(ev="stopped", received=n, error=error)
    conn.close()
    return 0 if error is None else 1


def worker_sender(args) -> int:
    import numpy as np

    from torch_reccl.transport import Transport

    out = worker_common("sender")
    stop = threading.Event()
    box = {}
    handle_q = queue.Queue()

    def handle(cmd):
        c = cmd["cmd"]
        if c == "stop":
            stop.set()
            handle_q.put(None)
        elif c == "connect":
            handle_q.put(bytes.fromhex(cmd["handle"]))
        elif c == "clock":
            out(ev="clock", mono=time.monotonic(), seq=cmd["seq"])
        elif c == "paths":
            conn = box.get("conn")
            out(ev="paths", seq=cmd["seq"], paths=conn.paths() if conn else [],
                active=conn.active_path if conn else None, n=box.get("n", 0))

    stdin_commands(handle)
    transport = Transport()
    h = handle_q.get(timeout=60)
    if h is None:
        return 1
    conn = transport.connect(0, h)
    conn.wait_ready(30)
    box["conn"] = conn
    out(ev="ready", paths=conn.paths(), active=conn.active_path)
    msg = (np.arange(args.msg_kib * 1024, dtype=np.uint32) % 251).astype(np.uint8)
    reqs = collections.deque(conn.isend(msg) for _ in range(args.window))
    quiet_gc()
    last = {"path": conn.active_path, "t": time.monotonic()}

    def note_and_send(n):
        """Time and path of the n-th completion (reported on a change of path),
        then the next send."""
        t = time.monotonic()
        path = conn.active_path
        box["n"] = n
        if path != last["path"]:
            out(ev="switch", t=t, path=path, prev_path=last["path"], prev_t=last["t"], n=n)
            last["path"] = path
        last["t"] = t
        return conn.isend(msg)

    n, error = stream(reqs, note_and_send, stop, args.max_run_s)
    for r in reqs:   # let the tail finish (bounded), so the receiver is not cut mid-message
        try:
            r.wait(2)
        except Exception:
            break
    out(ev="stopped", sent=n, error=error)
    conn.close()
    return 0 if error is None else 1


# ====================================================================== driver
class Worker:
    def __init__(self, fab, host: int, role: str, env: dict, args, log_dir: str):
        self.role = role
        self.q: "queue.Queue" = queue.Queue()
        self.records = []
        self.log_path = os.path.join(log_dir, f"{role}.stderr")
        self.stderr = open(self.log_path, "w")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", role,
                "--msg-kib", str(args.msg_kib), "--window", str(args.window),
                "--max-run-s", str(args.max_run_s)]
        full_env = dict(os.environ)
        full_env.update(env)
        # an explicit PYTHONPATH (another build of torch_reccl) comes first
        full_env["PYTHONPATH"] = os.pathsep.join(
            x for x in (full_env.get("PYTHONPATH", ""), REPO) if x)
        full_env["PYTHONUNBUFFERED"] = "1"
        self.proc = fab.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=self.stderr, text=True, env=full_env, bufsize=1)
        threading.Thread(target=self._read, daemon=True, name=f"read-{role}").start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"ev": "junk", "line": line}
            self.q.put(rec)
        self.q.put({"ev": "eof"})

    def send(self, **cmd):
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def pump(self, timeout: float = 0.0):
        """Moves records from the queue into self.records; returns new ones."""
        new = []
        try:
            rec = self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait()
            new.append(rec)
            while True:
                new.append(self.q.get_nowait())
        except queue.Empty:
            pass
        self.records.extend(new)
        return new

    def wait_for(self, pred, timeout: float, what: str, since: int = None):
        """First record matching pred: among those already pumped from index
        ``since`` on (if given), else among new ones."""
        if since is not None:
            for rec in self.records[since:]:
                if pred(rec):
                    return rec
        deadline = time.monotonic() + timeout
        while True:
            for rec in self.pump(min(0.05, max(0.0, deadline - time.monotonic()))):
                if rec.get("ev") == "eof":
                    raise RuntimeError(f"{self.role} exited while waiting for {what}; "
                                       f"stderr: {self.stderr_tail()}")
                if pred(rec):
                    return rec
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role}: no {what} within {timeout:.1f} s")

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return "?"

    def stop(self):
        self.send(cmd="stop")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.pump()
        self.stderr.close()


def pct(values, p):
    """Nearest-rank percentile."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(p / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def clock_check(driver_ns: str, workers, probes: int = 5) -> dict:
    res = {}
    for w in workers:
        hello = next(r for r in w.records if r.get("ev") == "hello")
        inside = 0
        widths = []
        for seq in range(probes):
            t0 = time.monotonic()
            w.send(cmd="clock", seq=seq)
            rec = w.wait_for(lambda r, s=seq: r.get("ev") == "clock" and r.get("seq") == s,
                             10, "clock reply")
            t1 = time.monotonic()
            inside += t0 <= rec["mono"] <= t1
            widths.append(t1 - t0)
        res[w.role] = {"inside": inside, "probes": probes, "max_window_ms": max(widths) * 1e3,
                       "same_timens": hello["timens"] == driver_ns, "netns": hello["netns"]}
    return res


def set_fault(fab, kind: str, host: int, on: bool) -> None:
    """Applies (``on``) or heals the scenario's fault on NIC 0 of ``host``: carrier
    loss for "link" (the netlink request only, not waiting for it to take effect),
    silent drops for "blackhole"."""
    if kind == "link":
        if on:
            fab.nic_down(host, 0, wait=False)
        else:
            fab.nic_up(host, 0, wait=False)
    else:
        fab.blackhole(host, 0, on)


def run_scenario(fab, sc: dict, args, log_dir: str, out_rows: list, raw: list):
    kind, hb = sc["kind"], sc["hb"]
    env = {"RECCL_NICS": "eth0,eth1", "RECCL_HEARTBEAT_MS": str(hb),
           "RECCL_NSOCKS": str(args.nsocks)}
    if args.debug:
        env["RECCL_DEBUG"] = "INFO"
    if args.connect_timeout_ms:
        env["RECCL_CONNECT_TIMEOUT_MS"] = str(args.connect_timeout_ms)
    sdir = os.path.join(log_dir, sc["name"].replace(":", "_"))
    os.makedirs(sdir, exist_ok=True)
    recv = Worker(fab, 1, "receiver", env, args, sdir)
    send = None
    try:
        h = recv.wait_for(lambda r: r.get("ev") == "handle", 60, "listen handle")
        send = Worker(fab, 0, "sender", env, args, sdir)
        send.wait_for(lambda r: r.get("ev") == "hello", 60, "start")
        send.send(cmd="connect", handle=h["handle"])
        ready = send.wait_for(lambda r: r.get("ev") == "ready", 60, "connection")
        if sc is args.scenarios_parsed[0]:
            cc = clock_check(os.readlink("/proc/self/ns/time"), [send, recv])
            for role, c in cc.items():
                print(f"  clock check {role}: monotonic inside the driver's [before, after] "
                      f"window {c['inside']}/{c['probes']} (window <= {c['max_window_ms']:.2f} ms); "
                      f"same time namespace as driver: {c['same_timens']}; netns {c['netns']} "
                      f"(driver {os.readlink('/proc/self/ns/net')})")
                if c["inside"] != c["probes"] or not c["same_timens"]:
                    raise RuntimeError("CLOCK_MONOTONIC is not shared with the workers; "
                                       "timestamps would not be comparable")
        print(f"  {sc['name']}: {'; '.join(ready['paths'])}", flush=True)
        for w in (send, recv):
            hello = next(r for r in w.records if r.get("ev") == "hello")
            print(f"  {w.role} pid {hello['pid']} extension {hello['extension']}")
            sc.setdefault("extension", {})[w.role] = hello["extension"]
        seq = [0]

        def paths_now():
            seq[0] += 1
            s = seq[0]
            send.send(cmd="paths", seq=s)
            return send.wait_for(lambda r: r.get("ev") == "paths" and r.get("seq") == s,
                                 10, "paths reply")

        def wait_healthy(timeout):
            deadline = time.monotonic() + timeout
            while True:
                p = paths_now()
                if (p["active"] == 0 and len(p["paths"]) >= 2
                        and all(" up" in x for x in p["paths"][:2])):
                    return p
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not back to healthy (primary active, backup up) "
                                       f"within {timeout:.0f} s: {p}")
                time.sleep(0.02)

        wait_healthy(30)
        hosts = [0, 1] if args.fault_host == "alt" else [int(args.fault_host)]
        detect_timeout = 10.0 + 3 * hb / 1000.0
        for i in range(args.faults):
            host = hosts[i % len(hosts)]
            time.sleep(args.settle_s + random.uniform(0, args.settle_s))
            n_before = paths_now()["n"]
            mark_s, mark_r = len(send.records), len(recv.records)
            t_call = time.monotonic()
            set_fault(fab, kind, host, True)
            t_fault = time.monotonic()
            try:
                sw = send.wait_for(lambda r: r.get("ev") == "switch" and r["path"] == 1
                                   and r["t"] > t_call, detect_timeout, "completion on backup",
                                   since=mark_s)
            except TimeoutError:
                diagnose(send, recv, mark_s, mark_r, t_fault, paths_now)
                raise
            finally:
                time.sleep(args.hold_s)
                t_heal0 = time.monotonic()
                set_fault(fab, kind, host, False)
                t_heal = time.monotonic()
            fb = send.wait_for(lambda r: r.get("ev") == "switch" and r["path"] == 0
                               and r["t"] > t_heal0, 30, "failback to primary", since=mark_s)
            wait_healthy(30)
            try:   # events reach the workers' callbacks every 20 ms: give them time
                send.wait_for(lambda r: r.get("ev") == "lib" and r["kind"] == "failback",
                              1.0, "failback event", since=mark_s)
            except TimeoutError:
                pass
            recv.pump(0.05)
            ev_s = [r for r in send.records[mark_s:] if r.get("ev") == "lib"]
            ev_r = [r for r in recv.records[mark_r:] if r.get("ev") == "lib"]

            def first(evs, kind_, pred=lambda r: True):
                return next((r for r in evs if r["kind"] == kind_ and pred(r)), None)

            def ms(v):
                return None if v is None else v * 1e3

            def rel(ev):
                return None if ev is None else (ev["mono"] - t_fault_est) * 1e3

            # When did the fault hit the stream? The drop/carrier loss happens inside
            # the fault call; the last completion on the primary before the switch
            # (clamped to the call's window) is the best estimate of that instant.
            t_fault_est = min(max(sw["prev_t"], t_call), t_fault)
            fo_s = first(ev_s, "failover")
            fo_r = first(ev_r, "failover")
            pd_s = first(ev_s, "path_down", lambda r: r["from_path"] == 0)
            pd_r = first(ev_r, "path_down", lambda r: r["from_path"] == 0)
            fbk_s = first(ev_s, "failback")
            row = {
                "scenario": sc["name"], "fault": i, "host": host,
                "t_call": t_call, "t_fault": t_fault, "t_fault_est": t_fault_est,
                "fault_call_ms": (t_fault - t_call) * 1e3,
                "recovery_ms": (sw["t"] - t_fault_est) * 1e3,
                "recovery_from_call_end_ms": (sw["t"] - t_fault) * 1e3,
                "recovery_from_call_start_ms": (sw["t"] - t_call) * 1e3,
                "stall_ms": (sw["t"] - sw["prev_t"]) * 1e3,
                "last_primary_vs_call_end_ms": (sw["prev_t"] - t_fault) * 1e3,
                "sender_detect_ms": rel(pd_s), "receiver_detect_ms": rel(pd_r),
                "sender_failover_event_ms": rel(fo_s), "receiver_failover_event_ms": rel(fo_r),
                "sender_reason": pd_s["reason"] if pd_s else None,
                "receiver_reason": pd_r["reason"] if pd_r else None,
                "lib_failover_sender_ms": ms(fo_s and fo_s["duration_s"]),
                "lib_failover_receiver_ms": ms(fo_r and fo_r["duration_s"]),
                "bytes_replayed": fo_s["bytes_replayed"] if fo_s else None,
                "failback_ms": (fb["t"] - t_heal0) * 1e3,
                "lib_failback_sender_ms": ms(fbk_s and fbk_s["duration_s"]),
                "heal_call_ms": (t_heal - t_heal0) * 1e3,
                "msgs_before": n_before,
                "switches": [{k: (round((v - t_fault_est) * 1e3, 2) if k in ("t", "prev_t") else v)
                              for k, v in r.items() if k != "ev"}
                             for r in send.records[mark_s:] if r.get("ev") == "switch"],
            }
            raw.append(row)
            if args.verbose:
                print("   ", json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                        for k, v in row.items() if not k.startswith("t_")}),
                      flush=True)
            elif (i + 1) % 10 == 0:
                print(f"    {i + 1}/{args.faults} faults", flush=True)
        rows = [r for r in raw if r["scenario"] == sc["name"]]
        out_rows.append(summarize(sc, rows))
    finally:
        for w in (send, recv):
            if w is not None:
                w.stop()
        for w in (send, recv):
            if w is not None:
                stopped = [r for r in w.records if r.get("ev") == "stopped"]
                if (stopped and stopped[-1].get("error")
                        and "closed the connection" not in stopped[-1]["error"]):
                    print(f"  WARNING {w.role}: {stopped[-1]['error']}")


def diagnose(send, recv, mark_s, mark_r, t_fault, paths_now):
    """What the workers said since the fault, for a report."""
    print(f"  STUCK: fault at t={t_fault:.3f}; now {time.monotonic() - t_fault:.1f} s later",
          file=sys.stderr)
    try:
        p = paths_now()
        print(f"  sender paths now: {p['paths']} active {p['active']} sends completed {p['n']}",
              file=sys.stderr)
    except Exception as e:
        print(f"  sender paths: {e}", file=sys.stderr)
    recv.pump()
    for w, mark in ((send, mark_s), (recv, mark_r)):
        for r in w.records[mark:]:
            r = dict(r)
            for k in ("mono", "t", "prev_t"):
                if isinstance(r.get(k), float):
                    r[k] = f"{(r[k] - t_fault) * 1e3:+.1f} ms"
            print(f"  {w.role}: {json.dumps(r)}", file=sys.stderr)
        print(f"  {w.role} stderr tail: {w.stderr_tail(1500)}", file=sys.stderr)


def summarize(sc, rows) -> dict:
    def stat(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        if not vals:
            return None
        return {"n": len(vals), "p50": statistics.median(vals), "p99": pct(vals, 99),
                "min": min(vals), "max": max(vals)}

    reasons = collections.Counter(r["sender_reason"] for r in rows)
    fast = sum(r["recovery_ms"] <= 10 for r in rows) / max(1, len(rows))
    return {"scenario": sc["name"], "kind": sc["kind"], "heartbeat_ms": sc["hb"],
            "extension": sc.get("extension"),
            "faults": len(rows), "hosts": sorted({r["host"] for r in rows}),
            "share_le_10ms": fast,
            "recovery_ms": stat("recovery_ms"), "stall_ms": stat("stall_ms"),
            "recovery_from_call_end_ms": stat("recovery_from_call_end_ms"),
            "recovery_from_call_start_ms": stat("recovery_from_call_start_ms"),
            "sender_detect_ms": stat("sender_detect_ms"),
            "receiver_detect_ms": stat("receiver_detect_ms"),
            "lib_failover_sender_ms": stat("lib_failover_sender_ms"),
            "lib_failover_receiver_ms": stat("lib_failover_receiver_ms"),
            "failback_ms": stat("failback_ms"), "fault_call_ms": stat("fault_call_ms"),
            "sender_reasons": dict(reasons)}


def print_table(rows):
    def f(s, k="p50"):
        return "-" if s is None else f"{s[k]:.1f}"

    head = ["scenario", "fault host", "hb ms", "faults", "recovery p50", "p99", "max", "<=10ms",
            "from call end p50/p99", "lib failover snd p50/p99 (n)", "detect snd p50",
            "fault call p50", "failback p50", "sender saw"]
    lines = [head]
    for r in rows:
        lf = r["lib_failover_sender_ms"]
        lines.append([
            r["scenario"], ",".join(map(str, r["hosts"])), str(r["heartbeat_ms"]),
            str(r["faults"]),
            f(r["recovery_ms"]), f(r["recovery_ms"], "p99"),
            f(r["recovery_ms"], "max"), f"{r['share_le_10ms']:.0%}",
            f"{f(r['recovery_from_call_end_ms'])}/{f(r['recovery_from_call_end_ms'], 'p99')}",
            f"{f(lf)}/{f(lf, 'p99')} ({lf['n'] if lf else 0})",
            f(r["sender_detect_ms"]), f(r["fault_call_ms"]), f(r["failback_ms"]),
            ",".join(f"{k}:{v}" for k, v in r["sender_reasons"].items()),
        ])
    w = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for j, row in enumerate(lines):
        print("  ".join(c.rjust(x) for c, x in zip(row, w)))
        if j == 0:
            print("  ".join("-" * x for x in w))
    print("(ms; recovery = first send completion on the backup - fault, the fault instant "
          "taken as the last completion on the primary within the fault call's window; "
          "'from call end' = measured from the return of the fault call instead)")


def parse_scenarios(text: str):
    out = []
    for item in text.split(","):
        item = item.strip()
        if item == "link":
            out.append({"name": "link", "kind": "link", "hb": None})
        elif item.startswith("bh:"):
            hb = int(item[3:])
            out.append({"name": f"bh:{hb}", "kind": "blackhole", "hb": hb})
        else:
            raise argparse.ArgumentTypeError(f"unknown scenario {item!r}: use link or bh:MS")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--scenarios", default="link,bh:200,bh:1000",
                    help="comma list of link | bh:HEARTBEAT_MS (default link,bh:200,bh:1000)")
    ap.add_argument("--faults", type=int, default=50, help="faults per scenario (default 50)")
    ap.add_argument("--fault-host", choices=["0", "1", "alt"], default="0",
                    help="host whose NIC 0 fails: 0 sender, 1 receiver, alt (default 0)")
    ap.add_argument("--link-heartbeat-ms", type=int, default=1000,
                    help="RECCL_HEARTBEAT_MS in the link scenario (default 1000)")
    ap.add_argument("--msg-kib", type=int, default=64, help="message size (default 64 KiB)")
    ap.add_argument("--window", type=int, default=4, help="sends in flight (default 4)")
    ap.add_argument("--nsocks", type=int, default=4, help="RECCL_NSOCKS (default 4)")
    ap.add_argument("--rate-mbit", type=float, default=1000,
                    help="per-NIC rate cap, as the test bed (default 1000; 0 = uncapped)")
    ap.add_argument("--hold-s", type=float, default=0.02,
                    help="how long the fault stays after the failover is seen (default 0.02)")
    ap.add_argument("--settle-s", type=float, default=0.05,
                    help="quiet time before each fault, plus up to as much again at random "
                         "(default 0.05)")
    ap.add_argument("--connect-timeout-ms", type=int, default=0,
                    help="RECCL_CONNECT_TIMEOUT_MS for the workers (default: library default)")
    ap.add_argument("--name", default="bfl", help="fabric name (default bfl)")
    ap.add_argument("--max-run-s", type=float, default=900,
                    help="workers stop streaming after this long whatever happens (default 900)")
    ap.add_argument("--json", metavar="FILE", help="write every fault and the summary as JSON")
    ap.add_argument("--verbose", action="store_true", help="print every fault")
    ap.add_argument("--debug", action="store_true",
                    help="RECCL_DEBUG=INFO in the workers (logs kept on failure)")
    args = ap.parse_args(argv)

    if args.worker == "sender":
        return worker_sender(args)
    if args.worker == "receiver":
        return worker_receiver(args)

    try:
        args.scenarios_parsed = parse_scenarios(args.scenarios)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    for sc in args.scenarios_parsed:
        if sc["kind"] == "link":
            sc["hb"] = args.link_heartbeat_ms
    if args.faults < 1:
        ap.error("--faults must be >= 1")

    if os.geteuid() != 0:
        print("failover_latency.py needs root: it builds an emulated fabric from network "
              "namespaces (docs/fabric.md). Run it as root, e.g. sudo python "
              "bench/failover_latency.py", file=sys.stderr)
        return 2
    sys.path.append(REPO)
    from torch_reccl.fabric import Fabric, FabricError, require_root

    try:
        require_root()
    except FabricError as e:
        print(f"failover_latency.py: {e}", file=sys.stderr)
        return 2
    if any(sc["kind"] == "blackhole" for sc in args.scenarios_parsed) and not (
            shutil.which("nft") or os.path.exists("/usr/sbin/nft")):
        print("failover_latency.py: blackhole scenarios need the nft command "
              "(apt-get install -y nftables), or run --scenarios link", file=sys.stderr)
        return 2

    # a SIGTERM must still run the finally below (fabric down)
    main_pid = os.getpid()

    def on_term(signum, frame):
        if os.getpid() != main_pid:   # a forked helper (pyroute2 netns sockets): just die
            os._exit(128 + signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    command = " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"# {command}")
    print(f"# {date}  host {platform.node()}  {os.cpu_count()} cpus  load "
          f"{os.getloadavg()[0]:.2f}  kernel {platform.release()}")
    print(f"# fabric {args.name}: 2 hosts x 2 rails, rate "
          f"{args.rate_mbit or 'uncapped'} Mbit; {args.msg_kib} KiB messages, window "
          f"{args.window}, NSOCKS {args.nsocks}; fault host {args.fault_host}; hold "
          f"{args.hold_s} s", flush=True)

    import importlib.util

    spec = importlib.util.find_spec("torch_reccl")
    print(f"# torch_reccl from {os.path.dirname(spec.origin)} (each worker prints the "
          f"extension it loaded)")
    fab = Fabric(hosts=2, rails=2, rate_mbit=args.rate_mbit or None, name=args.name)
    rows, raw = [], []
    log_dir = tempfile.mkdtemp(prefix="reccl-failover-bench-")
    t0 = time.monotonic()
    status = 0
    try:
        fab.up()
        for sc in args.scenarios_parsed:
            print(f"# scenario {sc['name']} (RECCL_HEARTBEAT_MS={sc['hb']}), "
                  f"{args.faults} faults", flush=True)
            run_scenario(fab, sc, args, log_dir, rows, raw)
    except (Exception, KeyboardInterrupt) as e:
        print(f"failover_latency.py: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"worker logs in {log_dir}", file=sys.stderr)
        status = 1
    finally:
        try:
            fab.down()
        except FabricError as e:
            print(f"failover_latency.py: fabric teardown: {e}", file=sys.stderr)
            status = 1
    elapsed = time.monotonic() - t0
    print(f"# {elapsed:.0f} s; load at end {os.getloadavg()[0]:.2f}; fabric {args.name} down")
    if rows:
        print()
        print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"command": command, "date": date, "host": platform.node(),
                                "cpus": os.cpu_count(), "kernel": platform.release(),
                                "elapsed_s": elapsed, "args": {k: v for k, v in vars(args).items()
                                                               if k != "scenarios_parsed"}},
                       "summary": rows, "faults": raw}, f, indent=1)
    if status == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

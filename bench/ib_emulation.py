#!/usr/bin/env python3
"""The IB transport on the in-process verbs emulation: fault-free throughput and
the time to recover from each kind of fault.

    python bench/ib_emulation.py                       # 5 faults per scenario
    python bench/ib_emulation.py --faults 20 --json out.json

THESE ARE NOT RDMA NUMBERS. The emulation moves bytes with memcpy on one
progress thread; throughput here says how much CPU the transport's staging
copies and its event loops cost on this machine, nothing about an HCA. The
recovery times do reflect the detection logic (port event, retry budget,
heartbeat) and the resync, which are the transport's own.

Set-up: one IbEmulation with devices a0, a1 (sender host) and b0, b1 (receiver
host), one connection a0->b0 (primary) with backup a1->b1. The sender streams
--msg-kib messages with --window isends in flight; the receiver keeps twice as
many irecvs posted (one stream for the whole run). At every send completion the sender notes time.monotonic() and the
active path. A fault is injected while the stream runs on the primary (t_fault
taken right after the call returns):

    recovery = t(first send completion on the backup) - t_fault

Small messages, busy polling on and off (--busy-poll-us, default 0 and the
default setting, each on a fresh emulation in the same invocation): ping-pong
round-trip latency of --small-bytes messages over a connection each way (one
thread posts both receives ahead, sends, waits, answers), throughput with
--small-window messages in flight, and the completion-channel events per
completion polled (the emulation's counters: what would be an interrupt and a
wake-up each on a real HCA) and the I/O threads' CPU seconds per 1000 messages.
`--small-only` skips the rest.

Scenarios: port_down_sender (PORT_ERR on a0), port_down_receiver (PORT_ERR on b0:
the receiver notifies the sender over the backup), blackhole (a0 drops all
packets; detected by the QP retry budget, RECCL_IB_TIMEOUT=14 here: 67 ms x 8 tries
= 537 ms, or by heartbeat silence, RECCL_HEARTBEAT_MS=1000). After each fault the
fault is healed and the stream returns to the primary before the next one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time

from torch_reccl import settings
from torch_reccl._native import native, testing
from torch_reccl.bench import procstat

_C = native()


def env(devices, args):
    return {
        "RECCL_IB_HCA": ",".join(devices),
        "RECCL_HEARTBEAT_MS": "1000",
        "RECCL_CHUNK_BYTES": str(args.chunk_kib << 10),
        "RECCL_IB_TIMEOUT": "14",
        "RECCL_IB_RETRY_CNT": "7",
    }


class Stream:
    """Streams until stopped; records (time, active path) per send completion."""

    def __init__(self, send, recv, msg_bytes, window):
        self.send, self.recv = send, recv
        self.payload = os.urandom(msg_bytes)
        self.window = window
        self.stop = threading.Event()
        self.marks = []
        self.errors = []
        self.threads = [threading.Thread(target=self._send, daemon=True),
                        threading.Thread(target=self._recv, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _send(self):
        pending = collections.deque()
        try:
            while not self.stop.is_set() or pending:
                while len(pending) < self.window and not self.stop.is_set():
                    pending.append(self.send.isend(self.payload))
                if not pending:
                    break
                pending.popleft().wait(30)
                self.marks.append((time.monotonic(), self.send.active_path))
        except Exception as error:  # reported by the driver
            self.errors.append(repr(error))

    def _recv(self):
        # Kept by the Stream, not the thread: this thread may stop before the
        # sender has drained, and receives still posted must keep their
        # buffers until the connection is closed.
        pending = self.posted = collections.deque()
        try:
            while not self.stop.is_set():
                while len(pending) < 2 * self.window:
                    buf = bytearray(len(self.payload))
                    pending.append((self.recv.irecv(buf), buf))
                request, buf = pending.popleft()
                request.wait(30)
                if bytes(buf) != self.payload:
                    self.errors.append("received bytes differ")
        except Exception as error:
            if not self.stop.is_set():  # after stop, close() fails what is still posted
                self.errors.append(repr(error))

    def finish(self):
        """Stops sending, then closes both ends (failing the receives still posted)."""
        self.stop.set()
        self.threads[0].join(60)
        closer = threading.Thread(target=self.send.close, daemon=True)
        closer.start()
        self.recv.close()
        closer.join(30)
        self.threads[1].join(30)


def io_cpu_seconds():
    return sum(t.cpu_seconds for t in procstat.threads().values() if t.name == "reccl-io")


def small_messages(args, busy_poll_us):
    """Latency and throughput of small messages with RECCL_IB_BUSY_POLL_US=busy_poll_us."""
    emu = testing().IbEmulation(["a0", "a1", "b0", "b1"])
    overrides = {"RECCL_IB_BUSY_POLL_US": str(busy_poll_us)}
    a = _C.IbTransport(emu, {**env(["a0", "a1"], args), **overrides})
    b = _C.IbTransport(emu, {**env(["b0", "b1"], args), **overrides})
    forward_listener, backward_listener = b.listen(0), a.listen(0)
    forward = a.connect(0, forward_listener.handle)
    backward = b.connect(0, backward_listener.handle)
    forward.wait_ready(10)
    backward.wait_ready(10)
    forward_recv, backward_recv = forward_listener.accept(10), backward_listener.accept(10)
    payload = os.urandom(args.small_bytes)
    result = {"busy_poll_us": busy_poll_us}

    def measure(run):
        counters, cpu = emu.counters(), io_cpu_seconds()
        messages = run()
        after = emu.counters()
        polled = after["completions_polled"] - counters["completions_polled"]
        return ((after["cq_events"] - counters["cq_events"]) / max(1, polled),
                1000 * (io_cpu_seconds() - cpu) / max(1, messages))

    def ping_pong():
        buf_b, buf_a = bytearray(len(payload)), bytearray(len(payload))
        samples = []
        end = time.monotonic() + args.small_seconds
        while time.monotonic() < end:
            at_b, at_a = forward_recv.irecv(buf_b), backward_recv.irecv(buf_a)
            start = time.perf_counter()
            forward.isend(payload)
            at_b.wait(10)
            backward.isend(payload)
            at_a.wait(10)
            samples.append(time.perf_counter() - start)
            if buf_a != payload:
                raise SystemExit("ping-pong: received bytes differ")
        samples.sort()
        result["rtt_us_median"] = 1e6 * samples[len(samples) // 2]
        result["rtt_us_p99"] = 1e6 * samples[int(len(samples) * 0.99)]
        result["round_trips"] = len(samples)
        return 4 * len(samples)  # two messages, each completed at both ends

    result["rtt_events_per_completion"], result["rtt_io_cpu_s_per_1k"] = measure(ping_pong)

    def streaming():
        stream = Stream(forward, forward_recv, args.small_bytes, args.small_window)
        time.sleep(args.small_seconds)
        marks = list(stream.marks)
        stream.finish()  # closes both ends and joins both threads
        if stream.errors:
            raise SystemExit(f"small-message stream: {stream.errors}")
        result["msgs_per_s"] = (len(marks) - 1) / (marks[-1][0] - marks[0][0])
        return 2 * len(marks)

    result["stream_events_per_completion"], result["stream_io_cpu_s_per_1k"] = measure(streaming)
    closers = [threading.Thread(target=backward.close, daemon=True)]
    closers[0].start()
    backward_recv.close()
    closers[0].join(30)
    forward_listener.close()
    backward_listener.close()
    return result


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--msg-kib", type=int, default=256)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="fault-free throughput run")
    parser.add_argument("--json")
    parser.add_argument("--busy-poll-us", type=int, nargs="+", default=[0, None],
                        help="RECCL_IB_BUSY_POLL_US values for the small-message runs "
                             "(default: 0 and the setting's default)")
    parser.add_argument("--small-bytes", type=int, default=8)
    parser.add_argument("--small-window", type=int, default=32)
    parser.add_argument("--small-seconds", type=float, default=3.0)
    parser.add_argument("--small-only", action="store_true")
    args = parser.parse_args()
    print("command:", " ".join([sys.executable] + sys.argv))
    print("date:", time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load average:", os.getloadavg())
    print("library:", _C.__file__)

    results = {"args": vars(args), "small": []}
    default_busy_poll = next(s["default"] for s in settings.settings() if s["name"] == "RECCL_IB_BUSY_POLL_US")
    for value in args.busy_poll_us:
        small = small_messages(args, int(default_busy_poll) if value is None else value)
        results["small"].append(small)
        print(f"busy poll {small['busy_poll_us']:5d} us: {args.small_bytes} B round trip median "
              f"{small['rtt_us_median']:7.1f} us (p99 {small['rtt_us_p99']:7.1f}), "
              f"{small['msgs_per_s']:8.0f} msg/s (window {args.small_window}); channel events per "
              f"completion {small['rtt_events_per_completion']:.2f} / {small['stream_events_per_completion']:.2f}, "
              f"I/O CPU s per 1k msgs {small['rtt_io_cpu_s_per_1k']:.3f} / {small['stream_io_cpu_s_per_1k']:.3f} "
              "(ping-pong / stream)")
    if len(results["small"]) > 1:
        base = results["small"][0]
        for other in results["small"][1:]:
            print(f"  {other['busy_poll_us']} us vs {base['busy_poll_us']} us: round trip x"
                  f"{other['rtt_us_median'] / base['rtt_us_median']:.2f}, msg/s x"
                  f"{other['msgs_per_s'] / base['msgs_per_s']:.2f}")
    if args.small_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return

    emu = testing().IbEmulation(["a0", "a1", "b0", "b1"])
    a = _C.IbTransport(emu, env(["a0", "a1"], args))
    b = _C.IbTransport(emu, env(["b0", "b1"], args))
    listener = b.listen(0)
    send = a.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)

    stream = Stream(send, recv, args.msg_kib << 10, args.window)
    time.sleep(args.seconds)
    marks = list(stream.marks)
    elapsed = marks[-1][0] - marks[0][0]
    mbps = (len(marks) - 1) * (args.msg_kib << 10) / elapsed / 1e6
    results["throughput_MBps"] = mbps
    print(f"fault-free throughput (emulation, memcpy-bound): {mbps:.0f} MB/s over {len(marks)} messages")

    scenarios = {
        "port_down_sender": (lambda: emu.port_down("a0"), lambda: emu.port_up("a0")),
        "port_down_receiver": (lambda: emu.port_down("b0"), lambda: emu.port_up("b0")),
        "blackhole": (lambda: emu.drop("a0", True), lambda: emu.drop("a0", False)),
    }
    for name, (inject, heal) in scenarios.items():
        samples = []
        for _ in range(args.faults):
            if not wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 20):
                raise SystemExit(f"{name}: no failback to the primary: {send.paths()}")
            seen = len(stream.marks)
            if not wait_until(lambda: len(stream.marks) > seen + 20, 10) or stream.errors:
                raise SystemExit(f"{name}: stream stalled on the primary: {stream.errors}")
            inject()
            t_fault = time.monotonic()
            ok = wait_until(lambda: any(t > t_fault and p == 1 for t, p in stream.marks[-50:]), 20)
            heal()
            if not ok or stream.errors:
                raise SystemExit(f"{name}: no completion on the backup; errors {stream.errors}")
            samples.append(min(t for t, p in stream.marks if t > t_fault and p == 1) - t_fault)
        results[name] = samples
        print(f"{name:20s} recovery ms: median {1000 * statistics.median(samples):7.1f}  "
              f"min {1000 * min(samples):7.1f}  max {1000 * max(samples):7.1f}  (n={len(samples)})")
    stream.finish()
    if stream.errors:
        raise SystemExit(f"stream errors: {stream.errors}")
    results["counters"] = emu.counters()
    print("emulation counters:", results["counters"])
    listener.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

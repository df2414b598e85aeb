"""One emulated host of a spreading run (inside the host's netns).

NCCL's pattern over the NCCL net plugin's tables (--driver plugin, dlopened by
torch_reccl.bench.nccl_net) or the transport's Python API (--driver
transport): one connection per channel, channel c on NIC c mod --nics; every
step gives each channel an equal share of --step-bytes in --message-bytes
messages, --window in flight per channel, all polled from one thread as NCCL's proxy does, and the step
ends when the slowest channel ends. The receiver checks every byte of every
message.

The run is a list of phases (--phases free,down1,...). Before each, the sender
writes <dir>/want-<phase> and waits for the driver's <dir>/go-<phase> (the driver
applies that phase's fault first); it then runs --warmup steps and --steps timed
steps. Per phase it records each step's time, busbw (step bytes / step time), the
bytes each local NIC sent, the host's TCP retransmissions and timeouts and the
connections spreading at its end (with --per-step also each step's channel end
times, bytes per NIC and TCP timeouts); everything
goes to <dir>/result-<role>.json. Used by tests/fabric/test_spread_fabric.py and
bench/plugin_spread.py: python -m torch_reccl.bench.spread_peer --role ...
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import numpy as np

POOL = np.random.default_rng(5).integers(0, 256, (64 << 20) + 4096, dtype=np.uint8)


def fill(out: np.ndarray, channel: int, index: int) -> np.ndarray:
    """Writes message `index` of `channel` (len(out) bytes) into `out`: a slice
    of POOL that depends on both, its first 8 bytes a stamp of both. In place:
    a fresh megabyte per message would cost the harness page faults, CPU that
    the NICs' traffic needs on a small machine."""
    offset = (channel * 7919 + index * 104729) % 4096
    np.copyto(out, POOL[offset:offset + out.size])
    stamp = np.frombuffer(np.int64(index * 100 + channel).tobytes(), np.uint8)
    out[:min(8, out.size)] = stamp[:min(8, out.size)]
    return out


def matches(data: np.ndarray, channel: int, index: int, scratch: np.ndarray) -> bool:
    """Whether `data` is message `index` of `channel`, compared in place (`scratch`:
    a bool buffer at least as long)."""
    offset = (channel * 7919 + index * 104729) % 4096
    stamp = np.frombuffer(np.int64(index * 100 + channel).tobytes(), np.uint8)
    head = min(8, data.size)
    if not np.array_equal(data[:head], stamp[:head]):
        return False
    same = scratch[:data.size - head]
    np.equal(data[head:], POOL[offset + head:offset + data.size], out=same)
    return bool(same.all())


class PluginDriver:
    """The plugin's v11 table, as NCCL's proxy calls it."""

    def __init__(self, channels: int):
        from torch_reccl.bench.nccl_net import Plugin

        self.plugin = Plugin(11)
        self.mhandles = {}

    def listen(self, channel):
        return self.plugin.listen(channel)

    def accept(self, listen):
        comm = self.plugin.accept(listen)
        self.plugin.check(self.plugin.table.closeListen(listen), "closeListen")  # as NCCL does
        return comm

    def connect(self, channel, handle):
        return self.plugin.connect(channel, handle)

    def register(self, comm, array):
        code, mhandle = self.plugin.reg_mr(comm, array)
        self.plugin.check(code, "regMr")
        self.mhandles[comm.value] = mhandle

    def isend(self, comm, array):
        request = self.plugin.isend(comm, array, self.mhandles[comm.value])
        return request if request.value else None  # NULL: NCCL retries later

    def irecv(self, comm, array):
        _, request = self.plugin.irecv(comm, [array], self.mhandles[comm.value])
        return request if request.value else None

    def test(self, request):
        code, done, size = self.plugin.test(request)
        self.plugin.check(code, "test")
        return done, size

    def close(self, comm, role):
        close = self.plugin.table.closeSend if role == "send" else self.plugin.table.closeRecv
        self.plugin.check(close(comm), "close")


class TransportDriver:
    """The transport's own connections (what the CPU engine uses)."""

    def __init__(self, channels: int):
        from torch_reccl.transport import Transport

        self.transport = Transport({k: v for k, v in os.environ.items() if k.startswith("RECCL_")})

    def listen(self, channel):
        listener = self.transport.listen(channel)
        return listener.handle, listener

    def accept(self, listen):
        return listen.accept(30)

    def connect(self, channel, handle):
        connection = self.transport.connect(channel, handle)
        connection.wait_ready(30)
        return connection

    def register(self, comm, array):
        pass

    def isend(self, comm, array):
        return comm.isend(array)

    def irecv(self, comm, array):
        return comm.irecv(array)

    def test(self, request):
        return request.test()

    def close(self, comm, role):
        comm.close()


def wait_file(path: str, deadline: float) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited for {os.path.basename(path)} in vain")
        time.sleep(0.005)


def publish(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def pump(driver, comms, post, check, counts, deadline, window):
    """Keeps up to `window` requests in flight per channel until channel c has
    finished counts[c] messages; polls every channel from this one thread.
    Returns each channel's finish time."""
    channels = len(comms)
    inflight = [[] for _ in range(channels)]
    posted = [0] * channels
    done = [0] * channels
    finished = [None] * channels
    while any(f is None for f in finished):
        if time.monotonic() > deadline:
            raise TimeoutError(f"stuck: done {done} of {counts}, posted {posted}")
        progressed = False
        for c in range(channels):
            while posted[c] < counts[c] and len(inflight[c]) < window:
                request = post(c, posted[c])
                if request is None:
                    break
                inflight[c].append((posted[c], request))
                posted[c] += 1
                progressed = True
            while inflight[c]:
                index, request = inflight[c][0]
                ok, size = driver.test(request)
                if not ok:
                    break
                inflight[c].pop(0)
                check(c, index, size)
                done[c] += 1
                progressed = True
            if done[c] == counts[c] and finished[c] is None:
                finished[c] = time.perf_counter()
        if not progressed:
            time.sleep(0.0002)  # NCCL's proxy spins; two processes on few cores must not
    return finished


def nic_bytes(key: str) -> dict:
    import torch_reccl

    return {name: s[key] for name, s in torch_reccl.stats()["nics"].items()}


def tcp_counters() -> dict:
    """This netns's TCP retransmission counters (Linux /proc), or {} elsewhere."""
    wanted = {"RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans"}
    out = {}
    for name in ("snmp", "netstat"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.read().splitlines()
        except OSError:
            return {}
        for keys, values in zip(lines[::2], lines[1::2]):
            for key, value in zip(keys.split()[1:], values.split()[1:]):
                if key in wanted:
                    out[key] = int(value)
    return out


def main() -> int:
    faulthandler.enable()
    parser = argparse.ArgumentParser()
    parser.add_argument("--driver", choices=["plugin", "transport"], required=True)
    parser.add_argument("--role", choices=["send", "recv"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--nics", type=int, default=4, help="channel c goes on NIC c mod this")
    parser.add_argument("--phases", default="free")
    parser.add_argument("--step-bytes", type=int, default=64 << 20)
    parser.add_argument("--message-bytes", type=int, default=512 << 10)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--phase-warmup", default="",
                        help="untimed steps of some phases instead of --warmup: name=count,... "
                             "(a slow NIC needs load for a few seconds before it is found)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=300)
    parser.add_argument("--per-step", action="store_true",
                        help="also record each timed step's channel end times and bytes per NIC")
    args = parser.parse_args()

    import torch_reccl

    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()))
    deadline = time.monotonic() + args.deadline
    phases = args.phases.split(",")
    per_channel = args.step_bytes // args.channels
    per_step = -(-per_channel // args.message_bytes)  # messages per channel and step
    sizes = [min(args.message_bytes, per_channel - i * args.message_bytes) for i in range(per_step)]
    warmups = {phase: args.warmup for phase in phases}
    for item in filter(None, args.phase_warmup.split(",")):
        name, _, count = item.partition("=")
        if name not in warmups or not count.isdigit():
            parser.error(f"--phase-warmup {item!r}: want name=count with a name of --phases {phases}")
        warmups[name] = int(count)
    total = per_step * sum(warmups[phase] + args.steps for phase in phases)
    result = {"role": args.role, "error": None, "phases": []}
    driver = (PluginDriver if args.driver == "plugin" else TransportDriver)(args.channels)
    comms = []
    try:
        if args.role == "recv":
            for c in range(args.channels):
                handle, listen = driver.listen(c % args.nics)
                publish(os.path.join(args.dir, f"handle-{c}"), handle)
                comms.append(driver.accept(listen))
            buffers = [[np.zeros(args.message_bytes, np.uint8) for _ in range(args.window)]
                       for _ in range(args.channels)]
            for c, comm in enumerate(comms):
                arena = np.concatenate(buffers[c])  # one registration per channel, as NCCL
                driver.register(comm, arena)
                buffers[c] = [arena[i * args.message_bytes:(i + 1) * args.message_bytes]
                              for i in range(args.window)]
            bad = []

            def post(c, index):
                size = sizes[index % per_step]
                return driver.irecv(comms[c], buffers[c][index % args.window][:size])

            scratch = np.empty(args.message_bytes, bool)

            def check(c, index, size):
                want = sizes[index % per_step]
                if size != want or not matches(buffers[c][index % args.window][:size], c, index, scratch):
                    bad.append((c, index, size))

            tcp_before = tcp_counters()
            pump(driver, comms, post, check, [total] * args.channels, deadline, args.window)
            result["tcp"] = {k: v - tcp_before.get(k, 0) for k, v in tcp_counters().items()}
            result["messages"] = total * args.channels
            result["bad"] = bad[:20]
            result["bad_count"] = len(bad)
            result["bytes_received"] = nic_bytes("bytes_received")
        else:
            for c in range(args.channels):
                wait_file(os.path.join(args.dir, f"handle-{c}"), deadline)
                with open(os.path.join(args.dir, f"handle-{c}"), "rb") as f:
                    comms.append(driver.connect(c % args.nics, f.read()))
            for comm in comms:  # NCCL registers its buffers once; TCP stages from any address
                driver.register(comm, np.zeros(args.message_bytes, np.uint8))
            base = [0]
            # Message i of a channel goes from slot i % window, free again since
            # message i - window completed (at most `window` in flight, done in order).
            slots = [[np.empty(args.message_bytes, np.uint8) for _ in range(args.window)]
                     for _ in range(args.channels)]
            filled = [[None] * args.window for _ in range(args.channels)]

            def post(c, index):
                i = base[0] + index
                slot = i % args.window
                data = slots[c][slot][:sizes[i % per_step]]
                if filled[c][slot] != i:  # not on a retry of the same message
                    fill(data, c, i)
                    filled[c][slot] = i
                return driver.isend(comms[c], data)

            def check(c, index, size):
                i = base[0] + index
                if size != sizes[i % per_step]:
                    raise AssertionError(f"send {c}/{i}: {size} bytes, sent {sizes[i % per_step]}")

            for phase in phases:
                publish(os.path.join(args.dir, f"want-{phase}"), b"")
                wait_file(os.path.join(args.dir, f"go-{phase}"), deadline)
                times, channel_s, step_nic_bytes, step_timeouts = [], [], [], []
                for step in range(warmups[phase] + args.steps):
                    if step == warmups[phase]:
                        before = nic_bytes("bytes_sent")
                        tcp_before = tcp_counters()
                        started, wall_started = time.perf_counter(), time.time()
                    step_before = nic_bytes("bytes_sent") if args.per_step else None
                    step_tcp = tcp_counters() if args.per_step else None
                    t0 = time.perf_counter()
                    ends = pump(driver, comms, post, check, [per_step] * args.channels, deadline,
                                args.window)
                    base[0] += per_step
                    if step >= warmups[phase]:
                        times.append(max(ends) - t0)
                        if args.per_step:  # ACKed by the step's end: exact per step
                            channel_s.append([end - t0 for end in ends])
                            step_after = nic_bytes("bytes_sent")
                            step_nic_bytes.append({n: step_after[n] - step_before.get(n, 0)
                                                   for n in step_after})
                            step_timeouts.append(tcp_counters().get("TCPTimeouts", 0)
                                                 - step_tcp.get("TCPTimeouts", 0))
                elapsed = time.perf_counter() - started
                after = nic_bytes("bytes_sent")
                tcp_after = tcp_counters()
                result["phases"].append({
                    "phase": phase, "step_s": times, "timed_from": wall_started, "timed_to": time.time(),
                    "busbw_gbps": args.step_bytes * len(times) / elapsed / 1e9,
                    "nic_bytes_sent": {n: after[n] - before.get(n, 0) for n in after},
                    "channel_s": channel_s, "step_nic_bytes": step_nic_bytes,
                    "step_tcp_timeouts": step_timeouts,
                    "tcp": {k: v - tcp_before.get(k, 0) for k, v in tcp_after.items()},
                    "spreading": torch_reccl.stats()["spreading"]})
            publish(os.path.join(args.dir, "want-end"), b"")
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    for comm in comms:
        try:
            driver.close(comm, args.role)
        except Exception as error:
            result["error"] = result["error"] or f"close: {error}"
    torch_reccl.events.flush_events()
    result["events"] = events
    with open(os.path.join(args.dir, f"result-{args.role}.json"), "w") as f:
        json.dump(result, f)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())

"""One end of ``reccl soak``'s plugin stream: checked messages through the NCCL
net plugin library (libnccl-net-reccl.so), driven as NCCL's proxy drives it
(torch_reccl/plugin_driver.py; no torch, no NCCL in the process).

    python -m torch_reccl.soak.plugin_stream --role recv --handle FILE --duration S
    python -m torch_reccl.soak.plugin_stream --role send --handle FILE --duration S

The receiver listens on device 0, writes the listen handle to ``--handle``
(whole, by rename), accepts and closes the listen comm (as NCCL does); the
sender waits for the file and connects. Message i has ``size_of(seed, i)``
bytes (log-uniform in ``--min-bytes``..``--max-bytes``) of ``message(seed, i,
size)``. The sender keeps up to ``--window`` requests in flight (NCCL's
requests per connection), each posted when the one before it has had its time
at ``--rate`` bytes/s; after ``--duration`` it sends ``--window`` empty
messages, the end: the receiver, which keeps ``--window`` receives of
``--max-bytes`` posted, has at most that many posted beyond the last message,
so every receive is matched and both ends close with nothing in flight. Both
ends test the oldest request first, as NCCL's proxy does; the receiver checks
every message's size and every byte.

Messages (``@reccl`` lines, torch_reccl.cli.launch.report): ``start``
(connected), ``tick`` (once a second: messages and bytes done, wrong, in
flight, the longest time without a request completing and when it ended; at
the receiver that is the longest time without a message, a message's time at
``--rate`` included),
``wrong`` (a message whose size or bytes differ: index, sizes, first differing
byte), ``error`` (a call returned an error, or a bound ran out: the stream
stops), ``done`` (the totals). Exit status 0 only with neither wrong nor error.
Every wait is bounded: connecting by ``--start-timeout``, the rest by
``--duration`` plus ``--finish-timeout``. SIGUSR1 prints the Python stacks
(faulthandler), as the soak's ranks do when the soak sees a stall.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import math
import os
import random
import signal
import sys
import time
from typing import Optional

import numpy as np

from torch_reccl.bench.cli import parse_size
from torch_reccl.cli.launch import report
from torch_reccl.plugin_driver import HANDLE_BYTES, VERSIONS, Plugin, message

ROLES = ("send", "recv")
TICK_S = 1.0
POLL_S = 0.001       # between test() rounds that found nothing done (NCCL's proxy spins)
HANDLE_POLL_S = 0.05
MAX_WINDOW = 32      # NCCL_NET_MAX_REQUESTS
MAX_REPORTED = 10    # wrong messages reported one by one; the ticks count them all


def size_of(seed: int, index: int, min_bytes: int, max_bytes: int) -> int:
    """Message ``index``'s size: log-uniform, so small and large ones both come often."""
    draw = random.Random(seed * 1_000_003 + index).uniform(math.log(min_bytes), math.log(max_bytes + 1))
    return min(max_bytes, int(math.exp(draw)))


@dataclasses.dataclass
class Counts:
    messages: int = 0            # intact messages (the end's empty ones not counted)
    bytes: int = 0
    wrong: int = 0
    longest_gap_s: float = 0.0   # the longest time without a request completing
    longest_gap_end: Optional[float] = None  # its end, seconds since the epoch

    def fields(self) -> dict:
        return dataclasses.asdict(self)


class Stream:
    """One end's loop: keep requests posted, test the oldest, check, tick."""

    def __init__(self, plugin: Plugin, comm, args, deadline: float):
        self.plugin, self.comm, self.args, self.deadline = plugin, comm, args, deadline
        self.counts = Counts()
        self.inflight = collections.deque()  # (index, size, request), oldest first
        self.next_index = 0
        self.end: Optional[int] = None       # index of the first empty message
        # one slot of --max-bytes per request in flight, written now so that RSS
        # is at its final level from the start (calloc'ed pages count once touched)
        self.arena = np.full(args.window * args.max_bytes, 0xA5, np.uint8)
        code, self.mhandle = plugin.reg_mr(comm, self.arena)
        plugin.check(code, "regMr")
        self.next_tick = time.monotonic() + TICK_S
        self.last_done = time.monotonic()

    def slot(self, index: int, size: int) -> np.ndarray:
        # slot i % window is free when request i is posted: the oldest are tested first
        start = (index % self.args.window) * self.args.max_bytes
        return self.arena[start:start + size]

    def size_of(self, index: int) -> int:
        return size_of(self.args.seed, index, self.args.min_bytes, self.args.max_bytes)

    def wrong(self, index: int, **what) -> None:
        self.counts.wrong += 1
        if self.counts.wrong <= MAX_REPORTED:
            report("wrong", role=self.args.role, index=index, **what)

    def run(self) -> Counts:
        while True:
            now = time.monotonic()
            if now > self.deadline:
                raise TimeoutError(f"{self.args.role}: not finished {self.args.duration:g} s + "
                                   f"--finish-timeout {self.args.finish_timeout:g} s after connecting, "
                                   f"{len(self.inflight)} requests in flight at message {self.next_index}")
            self.post(now)
            progressed = False
            while self.inflight:
                index, size, request = self.inflight[0]
                code, done, got = self.plugin.test(request)
                self.plugin.check(code, f"test({self.args.role} {index})")
                if not done:
                    break
                self.inflight.popleft()
                self.completed(index, size, got)
                progressed = True
                if now - self.last_done > self.counts.longest_gap_s:
                    self.counts.longest_gap_s = now - self.last_done
                    self.counts.longest_gap_end = time.time()
                self.last_done = now
            if self.finished():
                return self.counts
            if now >= self.next_tick:
                self.tick()
            if not progressed:
                time.sleep(POLL_S)

    def tick(self) -> None:
        self.next_tick = time.monotonic() + TICK_S
        print_log(self.plugin)
        report("tick", role=self.args.role, t=time.time(), in_flight=len(self.inflight),
               **self.counts.fields())

    def close(self) -> None:
        self.plugin.check(self.plugin.table.deregMr(self.comm, self.mhandle), "deregMr")


class Sender(Stream):
    def __init__(self, *args):
        super().__init__(*args)
        self.started = time.monotonic()
        self.next_post = self.started  # when the next message may go, paced to --rate

    def post(self, now: float) -> None:
        window = self.args.window
        while len(self.inflight) < window:
            if self.end is None:
                if now - self.started >= self.args.duration:
                    self.end = self.next_index
                elif now < self.next_post:
                    return
            if self.end is not None and self.next_index >= self.end + window:
                return
            index = self.next_index
            size = 0 if self.end is not None else self.size_of(index)
            data = self.slot(index, size)
            data[:] = message(self.args.seed, index, size)
            request = self.plugin.isend(self.comm, data, self.mhandle)
            if not request.value:
                return  # NCCL retries a NULL request later
            self.inflight.append((index, size, request))
            self.next_index += 1
            # never ahead of the rate, and no catching up after the network held it back
            self.next_post = max(self.next_post, now) + size / self.args.rate

    def completed(self, index: int, size: int, got: int) -> None:
        if got != size:
            self.wrong(index, what="test() reports another size than was sent", size=got, expected_size=size)
        elif size:
            self.counts.messages += 1
            self.counts.bytes += size

    def finished(self) -> bool:
        return self.end is not None and self.next_index == self.end + self.args.window and not self.inflight

    def close(self) -> None:
        super().close()
        self.plugin.check(self.plugin.table.closeSend(self.comm), "closeSend")


class Receiver(Stream):
    def post(self, now: float) -> None:
        window = self.args.window
        while len(self.inflight) < window and (self.end is None or self.next_index < self.end + window):
            index = self.next_index
            _, request = self.plugin.irecv(self.comm, [self.slot(index, self.args.max_bytes)], self.mhandle)
            if not request.value:
                return  # NCCL retries a NULL request later
            self.inflight.append((index, self.args.max_bytes, request))
            self.next_index += 1

    def completed(self, index: int, _posted: int, got: int) -> None:
        if got == 0 and self.end is None:
            self.end = index
        size = 0 if self.end is not None else self.size_of(index)
        if got != size:
            self.wrong(index, what="size", size=got, expected_size=size)
            return
        if not size:
            return
        data, expected = self.slot(index, size), message(self.args.seed, index, size)
        if not np.array_equal(data, expected):
            first = int(np.flatnonzero(data != expected)[0])
            self.wrong(index, what="bytes", size=size, first_byte=first, got=int(data[first]),
                       expected=int(expected[first]))
            return
        self.counts.messages += 1
        self.counts.bytes += size

    def finished(self) -> bool:
        return self.end is not None and self.next_index == self.end + self.args.window and not self.inflight

    def close(self) -> None:
        super().close()
        self.plugin.check(self.plugin.table.closeRecv(self.comm), "closeRecv")


def print_log(plugin: Plugin) -> None:
    """Moves the plugin's log lines (NCCL's logger) into this process's output."""
    lines = plugin.messages[:]
    del plugin.messages[:len(lines)]  # the logger only appends: none is lost
    for line in lines:
        print(line, flush=True)


def connect(plugin: Plugin, args, start_deadline: float):
    """The sender's or the receiver's comm, within --start-timeout."""
    if args.role == "recv":
        handle, listen_comm = plugin.listen(0)
        with open(args.handle + ".tmp", "wb") as out:
            out.write(handle)
        os.replace(args.handle + ".tmp", args.handle)  # the sender never reads half a handle
        comm = plugin.accept(listen_comm, timeout=max(0.0, start_deadline - time.monotonic()))
        plugin.check(plugin.table.closeListen(listen_comm), "closeListen")  # as NCCL does
        return comm
    while not os.path.exists(args.handle):
        if time.monotonic() > start_deadline:
            raise TimeoutError(f"no listen handle in {args.handle} within --start-timeout "
                               f"{args.start_timeout:g} s (is the receiver running?)")
        time.sleep(HANDLE_POLL_S)
    with open(args.handle, "rb") as handle_file:
        handle = handle_file.read()
    if len(handle) != HANDLE_BYTES:
        raise RuntimeError(f"{args.handle} holds {len(handle)} bytes, not a {HANDLE_BYTES}-byte listen handle")
    return plugin.connect(0, handle, timeout=max(0.0, start_deadline - time.monotonic()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.soak.plugin_stream",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--handle", required=True, metavar="FILE",
                        help="the receiver writes its listen handle here, the sender reads it")
    parser.add_argument("--duration", type=float, required=True, help="seconds of messages after connecting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-bytes", type=parse_size, default=4 << 10, help="smallest message (default 4K)")
    parser.add_argument("--max-bytes", type=parse_size, default=4 << 20, help="largest message (default 4M)")
    parser.add_argument("--rate", type=parse_size, default=16 << 20,
                        help="bytes/s the sender paces itself to, at most (default 16M)")
    parser.add_argument("--window", type=int, default=8, help="requests in flight (default 8, as NCCL)")
    parser.add_argument("--version", type=int, choices=VERSIONS, default=11, help="ncclNetPlugin_vN table")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="bound on connecting (s)")
    parser.add_argument("--finish-timeout", type=float, default=120.0,
                        help="bound on ending after --duration (s)")
    args = parser.parse_args(argv)
    if args.min_bytes < 1:
        parser.error(f"--min-bytes must be at least 1 (an empty message is the end); got {args.min_bytes}")
    if args.rate < 1:
        parser.error(f"--rate must be at least 1 byte/s; got {args.rate}")
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} exceeds --max-bytes {args.max_bytes}")
    if args.max_bytes > 1 << 30:
        parser.error(f"--max-bytes must be at most 1G (the plugin's maxP2pBytes); got {args.max_bytes}")
    if not 1 <= args.window <= MAX_WINDOW:
        parser.error(f"--window must be in 1..{MAX_WINDOW}; got {args.window}")
    for name in ("duration", "start_timeout", "finish_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name):g}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    start_deadline = time.monotonic() + args.start_timeout
    try:
        plugin = Plugin(args.version, require_init=False)
    except (ImportError, OSError) as error:  # the library is not built, or does not load
        report("error", role=args.role, what=f"cannot load the plugin library: {error}")
        return 1
    try:
        if plugin.init_code:
            raise RuntimeError(f"init returned ncclResult {plugin.init_code}: {' '.join(plugin.messages)}")
        comm = connect(plugin, args, start_deadline)
        report("start", role=args.role, t=time.time())
        deadline = time.monotonic() + args.duration + args.finish_timeout
        stream = (Sender if args.role == "send" else Receiver)(plugin, comm, args, deadline)
        counts = stream.run()
        stream.close()
    except (RuntimeError, TimeoutError) as error:  # an ncclResult other than success, or a bound
        print_log(plugin)
        report("error", role=args.role, what=str(error))
        return 1
    print_log(plugin)
    report("done", role=args.role, t=time.time(), **counts.fields())
    return 0 if not counts.wrong else 1


if __name__ == "__main__":
    sys.exit(main())

"""The NCCL net plugin driven as NCCL's proxy drives it.

On top of torch_reccl.plugin_driver (the ctypes mirror of the `ncclNetPlugin_vN`
tables, ``Plugin``), a sender and a receiver exchange messages with many requests
in flight, polling `test()` (``send_stream``, ``receive_stream``, ``run_pair``).
As a program it runs one side of a cross-host stream inside an emulated host:

    python -m torch_reccl.bench.nccl_net --role recv|send --dir DIR

Shared by the plugin's tests and by bench/outage_fabric.py and bench/plugin_spread.py
(through torch_reccl.bench.spread_peer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from torch_reccl.plugin_driver import (  # noqa: F401 (the driver, for this module's users)
    HANDLE_BYTES,
    INTERNAL_ERROR,
    INVALID_ARGUMENT,
    PTR_CUDA,
    PTR_DMABUF,
    PTR_HOST,
    REMOTE_ERROR,
    SUCCESS,
    VERSIONS,
    Plugin,
    library_path,
    message,
)


def message_sizes(seed: int, count: int, max_bytes: int):
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(0, np.log(max_bytes), count)).astype(np.int64)
    sizes[0], sizes[1] = 0, max_bytes
    return [int(s) for s in sizes]


def pump_requests(plugin: Plugin, what: str, count: int, post, on_done, window: int,
                  deadline: float) -> None:
    """One side of NCCL's proxy loop: keep up to `window` requests posted (`post(i)`
    returns request i; a NULL one is retried later), poll test(), and call
    `on_done(i, size)` as each completes."""
    inflight, next_index = [], 0
    while next_index < count or inflight:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} stuck with {len(inflight)} in flight at {next_index}")
        while next_index < count and len(inflight) < window:
            request = post(next_index)
            if not request.value:
                break  # NCCL retries a NULL request later
            inflight.append((next_index, request))
            next_index += 1
        still = []
        for index, request in inflight:
            code, done, size = plugin.test(request)
            plugin.check(code, f"test({what} {index})")
            if done:
                on_done(index, size)
            else:
                still.append((index, request))
        inflight = still


def send_stream(plugin: Plugin, comm, sizes, seed: int, window: int, deadline: float):
    """Sender half of NCCL's proxy: post isends (retrying NULL requests), poll test()."""
    arrays = [message(seed, i, s) for i, s in enumerate(sizes)]
    _, mhandle = plugin.reg_mr(comm, arrays[1])

    def done(index, size):
        if size != sizes[index]:
            raise AssertionError(f"send {index}: test says {size} bytes, sent {sizes[index]}")

    pump_requests(plugin, "sender", len(sizes), lambda i: plugin.isend(comm, arrays[i], mhandle),
                  done, window, deadline)


def receive_stream(plugin: Plugin, comm, sizes, seed: int, window: int, deadline: float,
                   progress: list | None = None):
    """Receiver half; checks every byte; appends each intact message's index to `progress`."""
    buffers = [np.zeros(s, np.uint8) for s in sizes]
    _, mhandle = plugin.reg_mr(comm, buffers[1])
    good = []

    def done(index, size):
        if size != sizes[index] or not np.array_equal(buffers[index], message(seed, index, sizes[index])):
            raise AssertionError(f"message {index} differs ({size} bytes)")
        good.append(index)
        buffers[index] = None
        if progress is not None:
            progress.append(index)

    pump_requests(plugin, "receiver", len(sizes),
                  lambda i: plugin.irecv(comm, [buffers[i]], mhandle)[1], done, window, deadline)
    return len(good)


def connect_pair(plugin: Plugin):
    """listen, connect and accept on device 0 as NCCL's setup does: (send, recv) comms."""
    handle, listen_comm = plugin.listen(0)
    send_comm_box = []

    def connect():
        send_comm_box.append(plugin.connect(0, handle))

    connector = threading.Thread(target=connect)
    connector.start()
    recv_comm = plugin.accept(listen_comm)  # setup thread and "proxy" run concurrently
    # NCCL closes the listen comm as soon as accept returns; the backup path and
    # every later re-dial must still be admitted.
    assert plugin.table.closeListen(listen_comm) == SUCCESS
    connector.join(timeout=30)
    return send_comm_box[0], recv_comm


def run_pair(version: int, sizes, window: int = 8, fault=None, progress: list | None = None):
    """One plugin talks to itself (connect_pair), then a sender and a receiver
    "proxy" thread stream `sizes`; `fault()` runs on the calling thread meanwhile
    (`progress` gets each intact message's index as it arrives). Returns (errors,
    [messages received intact])."""
    plugin = Plugin(version)
    errors, good = [], []
    send_comm, recv_comm = connect_pair(plugin)
    deadline = time.monotonic() + 60

    def sender():
        try:
            send_stream(plugin, send_comm, sizes, 3, window, deadline)
        except Exception as error:
            errors.append(f"send: {error}")

    def receiver():
        try:
            good.append(receive_stream(plugin, recv_comm, sizes, 3, window, deadline, progress))
        except Exception as error:
            errors.append(f"recv: {error}")

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    if fault is not None:
        fault()
    for t in threads:
        t.join(timeout=70)
    assert not any(t.is_alive() for t in threads), "a proxy thread hung"
    for close, comm in ((plugin.table.closeSend, send_comm), (plugin.table.closeRecv, recv_comm)):
        assert close(comm) == SUCCESS
    return errors, good


def main() -> int:
    """One side of a cross-host run: --role recv|send, the handle passed through --dir."""
    parser = argparse.ArgumentParser(description="one side of a cross-host stream through the NCCL net plugin")
    parser.add_argument("--role", choices=["recv", "send"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--version", type=int, default=11)
    parser.add_argument("--messages", type=int, default=150)
    parser.add_argument("--max-bytes", type=int, default=8 << 20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--deadline", type=float, default=60)
    parser.add_argument("--inject-down", help="NIC to fail (inject_fault) before anything else")
    args = parser.parse_args()
    import torch_reccl

    plugin_first = Plugin(args.version) if args.inject_down else None
    if args.inject_down:
        torch_reccl.inject_fault(args.inject_down, "down")

    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()))
    deadline = time.monotonic() + args.deadline
    plugin = plugin_first or Plugin(args.version)
    sizes = message_sizes(args.seed, args.messages, args.max_bytes)
    result = {"role": args.role, "error": None}
    handle_path = os.path.join(args.dir, "handle")
    progress_path = os.path.join(args.dir, f"progress-{args.role}")
    try:
        if args.role == "recv":
            handle, listen_comm = plugin.listen(0)
            with open(handle_path + ".tmp", "wb") as f:
                f.write(handle)
            os.rename(handle_path + ".tmp", handle_path)
            comm = plugin.accept(listen_comm)
            plugin.check(plugin.table.closeListen(listen_comm), "closeListen")  # as NCCL does
            open(progress_path, "w").close()
            result["good"] = receive_stream(plugin, comm, sizes, args.seed, 8, deadline)
            plugin.check(plugin.table.closeRecv(comm), "closeRecv")
        else:
            while not os.path.exists(handle_path):
                if time.monotonic() > deadline:
                    raise TimeoutError("no handle")
                time.sleep(0.01)
            with open(handle_path, "rb") as f:
                comm = plugin.connect(0, f.read())
            open(progress_path, "w").close()
            send_stream(plugin, comm, sizes, args.seed, 8, deadline)
            plugin.check(plugin.table.closeSend(comm), "closeSend")
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    torch_reccl.events.flush_events()
    result["events"] = events
    with open(os.path.join(args.dir, f"result-{args.role}.json"), "w") as f:
        json.dump(result, f)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())

"""Two processes stream data over two NICs; the sender's primary NIC dies mid-stream.

Run:  python examples/failover_demo.py
Every byte is checked; the transfer goes on over the backup NIC and returns to the
primary when it heals. On one host the two "NICs" are 127.0.0.1 and 127.0.0.2
(override with RECCL_NICS) and the fault is injected in-process; `reccl fabric`
gives real links to break (see docs/fabric.md).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np

MESSAGES = 48
MESSAGE_BYTES = 8 << 20
NICS = os.environ.get("RECCL_NICS", "127.0.0.1,127.0.0.2")


def payload(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, MESSAGE_BYTES, dtype=np.uint8)


def receiver(handle_queue, result_queue):
    from torch_reccl.transport import Transport

    transport = Transport({"RECCL_NICS": NICS, "RECCL_HEARTBEAT_MS": "500"})
    listener = transport.listen(0)
    handle_queue.put(listener.handle)
    connection = listener.accept(timeout=30)
    good = 0
    for index in range(MESSAGES):
        buffer = np.zeros(MESSAGE_BYTES, np.uint8)
        connection.irecv(buffer).wait(timeout=60)
        good += bool(np.array_equal(buffer, payload(index)))
    result_queue.put(good)
    connection.close()


def main() -> int:
    import torch_reccl
    from torch_reccl.transport import Transport

    ctx = mp.get_context("spawn")
    handles, results = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=receiver, args=(handles, results), daemon=True)
    peer.start()
    events = []
    torch_reccl.on_event(events.append, kinds=["failover", "failback", "nic_down", "nic_up"])

    transport = Transport({"RECCL_NICS": NICS, "RECCL_HEARTBEAT_MS": "500"})
    connection = transport.connect(0, handles.get(timeout=60))
    connection.wait_ready(timeout=30)
    primary = transport.nics()[0]["name"]
    print(f"streaming {MESSAGES} x {MESSAGE_BYTES >> 20} MiB; primary NIC {primary}")
    start = time.time()
    for index in range(MESSAGES):
        if index == MESSAGES // 3:
            print(f"  message {index}: NIC {primary} goes DOWN")
            torch_reccl.inject_fault(primary, "down")
        if index == 2 * MESSAGES // 3:
            print(f"  message {index}: NIC {primary} comes back UP")
            torch_reccl.inject_fault(primary, "up")
        connection.isend(payload(index)).wait(timeout=60)
    good = results.get(timeout=60)
    elapsed = time.time() - start
    peer.join(timeout=30)
    connection.close()
    torch_reccl.events.flush_events()
    for event in events:
        took = f" in {event.duration_s * 1e3:.2f} ms" if event.duration_s is not None else ""
        print(f"  event: {event.kind:9s} {event.detail}{took}")
    ok = good == MESSAGES and any(e.kind == "failover" for e in events)
    verdict = "survived the NIC failure" if ok else "FAILED"
    print(f"{good}/{MESSAGES} messages bit-exact in {elapsed:.1f} s: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One emulated host in a failover scenario (run inside the host's netns).

Every host connects to every other host and streams a deterministic plan of
messages (random sizes, random contents, the message index stamped in the first
bytes) while receiving the plans of its peers; every received message is checked
byte for byte and in order. Progress goes to <dir>/progress-<host>, the outcome to
<dir>/result-<host>.json. Used by tests/fabric/test_failover_fabric.py.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time

import numpy as np

POOL_BYTES = 64 << 20
STAMP = 8


def plan_sizes(seed: int, src: int, dst: int, count: int, max_bytes: int, big_every: int):
    rng = np.random.default_rng([seed, src, dst])
    sizes = np.exp(rng.uniform(0, np.log(max(2, max_bytes // 4)), count)).astype(np.int64)
    sizes[::big_every] = max_bytes  # some messages at the maximum size
    sizes[1] = 0                     # an empty message
    sizes[2] = 1
    return [int(s) for s in sizes]


class Plan:
    def __init__(self, seed: int):
        self.pool = np.random.default_rng(seed).integers(0, 256, POOL_BYTES + 4096, dtype=np.uint8)

    def message(self, src: int, dst: int, index: int, size: int) -> np.ndarray:
        offset = (src * 7919 + dst * 104729 + index * 1299709) % 4096
        data = self.pool[offset:offset + size].copy()
        stamp = np.frombuffer(np.int64(index * 1000 + src * 10 + dst).tobytes(), np.uint8)
        data[:min(STAMP, size)] = stamp[:min(STAMP, size)]
        return data


def main() -> int:
    faulthandler.enable()  # a native crash leaves a stack in the host's log
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--rails", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--messages", type=int, default=60)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--big-every", type=int, default=25)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=90.0)
    args = parser.parse_args()

    import torch_reccl
    from torch_reccl.transport import Transport

    start = time.monotonic()
    deadline = start + args.deadline
    me, peers = args.host, [h for h in range(args.hosts) if h != args.host]
    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()))
    nics = ",".join(f"eth{r}" for r in range(args.rails))
    transport = Transport({**{k: v for k, v in os.environ.items() if k.startswith("RECCL_")},
                           "RECCL_NICS": nics})
    listener = transport.listen(0)
    with open(os.path.join(args.dir, f"handle-{me}.tmp"), "wb") as f:
        f.write(listener.handle)
    os.rename(os.path.join(args.dir, f"handle-{me}.tmp"), os.path.join(args.dir, f"handle-{me}"))

    def read_handle(peer: int) -> bytes:
        path = os.path.join(args.dir, f"handle-{peer}")
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no handle from host {peer}")
            time.sleep(0.01)
        with open(path, "rb") as f:
            return f.read()

    senders = {}
    for peer in peers:
        senders[peer] = transport.connect(0, read_handle(peer))
    receivers = {}
    while len(receivers) < len(peers):
        conn = listener.accept(timeout=max(0.1, deadline - time.monotonic()))
        receivers[len(receivers)] = conn
    for conn in senders.values():
        conn.wait_ready(timeout=max(0.1, deadline - time.monotonic()))
    setup_s = time.monotonic() - start

    plan = Plan(args.seed)
    errors = []
    received = {}
    progress = {"sent": 0, "received": 0}
    lock = threading.Lock()
    # The path that carried the end of each stream (read after every completion:
    # once a peer closes, the connection has no active path any more).
    final_paths = {}
    # Paths seen after the driver marked the fault, with the wall time they were
    # seen: a stream that ended before the fault took effect says nothing about
    # failover.
    fault_marker = os.path.join(args.dir, "fault")
    after_fault = {}

    def note_path(key, conn) -> None:
        path = conn.active_path
        if path >= 0:
            final_paths[key] = path
            if os.path.exists(fault_marker):
                after_fault[key] = (path, time.time())

    def send_all(peer: int, conn) -> None:
        try:
            sizes = plan_sizes(args.seed, me, peer, args.messages, args.max_bytes, args.big_every)
            inflight = []
            for index, size in enumerate(sizes):
                data = plan.message(me, peer, index, size)
                inflight.append((conn.isend(data), data))
                if len(inflight) >= args.window:
                    request, _ = inflight.pop(0)
                    request.wait(timeout=max(0.1, deadline - time.monotonic()))
                    note_path(("send", peer), conn)
                    with lock:
                        progress["sent"] += 1
            for request, _ in inflight:
                request.wait(timeout=max(0.1, deadline - time.monotonic()))
                note_path(("send", peer), conn)
                with lock:
                    progress["sent"] += 1
        except Exception as error:  # reported, not raised: the test reads the result
            errors.append(f"send {me}->{peer}: {type(error).__name__}: {error}")

    def receive_all(conn) -> None:
        src = None
        try:
            posted = []
            # The sender is unknown until the first message: stamps name it.
            first = np.zeros(8, np.uint8)
            # Message 0 of any plan is at most max_bytes; post for the largest.
            sizes_by_src = {p: plan_sizes(args.seed, p, me, args.messages, args.max_bytes,
                                          args.big_every) for p in peers}
            buffer0 = np.zeros(args.max_bytes, np.uint8)
            nbytes = conn.irecv(buffer0).wait(timeout=max(0.1, deadline - time.monotonic()))
            first[:] = buffer0[:8]
            tag = int(np.frombuffer(first.tobytes(), np.int64)[0])
            src = (tag % 1000) // 10
            sizes = sizes_by_src[src]
            expected = plan.message(src, me, 0, sizes[0])
            if nbytes != sizes[0] or not np.array_equal(buffer0[:nbytes], expected):
                errors.append(f"recv {src}->{me} message 0 differs")
            count = 1
            next_post = 1
            while count < len(sizes):
                while next_post < len(sizes) and len(posted) < args.window:
                    buffer = np.zeros(sizes[next_post], np.uint8)
                    posted.append((next_post, conn.irecv(buffer), buffer))
                    next_post += 1
                index, request, buffer = posted.pop(0)
                nbytes = request.wait(timeout=max(0.1, deadline - time.monotonic()))
                note_path(("recv", id(conn)), conn)
                if nbytes != sizes[index] or not np.array_equal(buffer, plan.message(src, me, index, sizes[index])):
                    errors.append(f"recv {src}->{me} message {index} differs ({nbytes} bytes)")
                count += 1
                with lock:
                    progress["received"] += 1
            received[src] = count
        except Exception as error:
            errors.append(f"recv {src}->{me}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=send_all, args=(p, c)) for p, c in senders.items()]
    threads += [threading.Thread(target=receive_all, args=(c,)) for c in receivers.values()]
    for t in threads:
        t.start()
    progress_path = os.path.join(args.dir, f"progress-{me}")
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline + 5:
        with lock:
            line = json.dumps(progress)
        with open(progress_path + ".tmp", "w") as f:
            f.write(line)
        os.replace(progress_path + ".tmp", progress_path)
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=1)
    if any(t.is_alive() for t in threads):
        errors.append("a transfer thread did not finish by the deadline")
    # Idle connections move too: the state now beats the last completion's, unless
    # the peer has already closed the connection.
    for peer, conn in senders.items():
        note_path(("send", peer), conn)
    for conn in receivers.values():
        note_path(("recv", id(conn)), conn)
    result = {
        "host": me,
        "setup_s": setup_s,
        "elapsed_s": time.monotonic() - start,
        "received": {str(k): v for k, v in received.items()},
        "errors": errors,
        "send_active_paths": {str(p): final_paths.get(("send", p), -1) for p in senders},
        "send_paths_after_fault": {str(p): after_fault[("send", p)]
                                   for p in senders if ("send", p) in after_fault},
        "recv_active_paths": [final_paths.get(("recv", id(c)), -1) for c in receivers.values()],
        "paths": {str(p): c.paths() for p, c in senders.items()},
    }
    for conn in list(senders.values()) + list(receivers.values()):
        conn.close()
    torch_reccl.events.flush_events()
    result["events"] = events
    result["stats"] = torch_reccl.stats()
    with open(os.path.join(args.dir, f"result-{me}.json"), "w") as f:
        json.dump(result, f)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())

"""The fault-tolerant TCP transport (s-Bond) end to end on loopback NICs.

Two loopback addresses play two NICs (127.0.0.1 = rail 0, 127.0.0.2 = rail 1).
Faults are injected with torch_reccl.inject_fault (process-global health); the
``healed_nics`` fixture heals them after every test. Tests that need a fault seen
by one end only run that end in a spawned child (conftest.peer_main).
"""
from __future__ import annotations

import gc
import json
import os
import threading
import time

import numpy as np
import pytest

import torch_reccl
from torch_reccl.events import EVENT_KINDS, Event, flush_events, on_event
from torch_reccl.transport import (ConfigError, ProtocolError, RecclError, Transport,
                                   TimeoutError as RecclTimeoutError, _C)

from conftest import (BACKUP, PRIMARY, close_both, in_thread, plan_sizes, reccl_env,
                      run_receiver, run_sender, stream, wait_until)

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("healed_nics")]


def thread_count():
    return len(os.listdir("/proc/self/task"))


def settled_thread_count() -> bool:
    """True when no thread started or exited over the last 0.1 s."""
    before = thread_count()
    time.sleep(0.1)
    return thread_count() == before


def switch_events(events, kind, conn):
    """(sender's, receiver's) events of `kind` for connection `conn`."""
    found = events.of(kind, connection=conn.id)
    return ([e for e in found if e.detail.startswith("sender:")],
            [e for e in found if e.detail.startswith("receiver:")])


# --------------------------------------------------------------------------- fault-free


@pytest.mark.timeout(60)
def test_bidirectional_random_stream_is_exact():
    """200 messages each way, 0 B..8 MiB plus three of 64 MiB, random contents,
    two connections A->B and B->A at once, 8 in flight on each."""
    env = reccl_env()
    ta, tb = Transport(env), Transport(env)
    la, lb = ta.listen(0), tb.listen(1)
    a_to_b, b_to_a = ta.connect(0, lb.handle), tb.connect(1, la.handle)
    a_to_b.wait_ready(10)
    b_to_a.wait_ready(10)
    at_b, at_a = lb.accept(10), la.accept(10)
    try:
        sizes_ab = plan_sizes(11, 200, 8 << 20)
        sizes_ab[60] = sizes_ab[120] = 64 << 20
        sizes_ba = plan_sizes(12, 200, 8 << 20)
        sizes_ba[60] = 64 << 20
        joins = [
            in_thread(run_receiver, at_b, sizes_ab, 11, 8, 30.0, 7),  # buffers 7 B larger
            in_thread(run_receiver, at_a, sizes_ba, 12, 8, 30.0, 0),
            in_thread(run_sender, a_to_b, sizes_ab, 11, 8, 30.0),
            in_thread(run_sender, b_to_a, sizes_ba, 12, 8, 30.0),
        ]
        totals = [join(55) for join in joins]
        assert totals == [sum(sizes_ab), sum(sizes_ba), sum(sizes_ab), sum(sizes_ba)]
        assert a_to_b.error == b_to_a.error == at_a.error == at_b.error == ""
    finally:
        close_both(a_to_b, at_b)
        close_both(b_to_a, at_a)


@pytest.mark.timeout(20)
def test_zero_byte_messages_and_buffer_kinds(pair_factory):
    _t, _l, send, recv = pair_factory()
    # 0-byte sends into 0-byte and larger buffers, interleaved with data
    bufs = [bytearray(0), bytearray(16), bytearray(5), bytearray(0)]
    payloads = [b"", b"", b"hello", b""]
    reqs = [recv.irecv(b) for b in bufs]
    sends = [send.isend(p) for p in payloads]
    assert [s.wait(10) for s in sends] == [0, 0, 5, 0]
    assert [r.wait(10) for r in reqs] == [0, 0, 5, 0]
    assert bytes(bufs[2]) == b"hello" and bytes(bufs[1]) == bytes(16)
    # numpy arrays and memoryview slices are accepted as contiguous buffers
    src = np.arange(1000, dtype=np.uint32).reshape(10, 100)
    dst = np.zeros(4000, dtype=np.uint8)
    window = bytearray(64)
    r1, r2 = recv.irecv(dst), recv.irecv(memoryview(window)[8:40])
    assert send.isend(src).wait(10) == 4000
    assert send.isend(memoryview(b"x" * 100)[10:42]).wait(10) == 32
    assert r1.wait(10) == 4000 and r2.wait(10) == 32
    assert np.array_equal(dst.view(np.uint32), src.ravel())
    assert window == bytearray(8) + b"x" * 32 + bytearray(24)
    with pytest.raises(ConfigError, match="contiguous"):
        send.isend(np.arange(100, dtype=np.uint8)[::2])
    done, nbytes = send.isend(b"abc").test()
    assert (done, nbytes) == (False, 0)  # no receive posted yet


@pytest.mark.timeout(30)
def test_a_lone_zero_byte_message_is_not_held_back(pair_factory):
    """Regression: a data header went out with MSG_MORE even when no payload
    followed, so a lone 0-byte message sat in the kernel until the 200 ms cork
    timer (or the peer's next delayed ACK): NCCL's 0-byte sends cost ~40 ms each
    on the GPU machine. Each round trip must now end long before the cork timer
    (the median of 10 is compared, so one slow scheduling blip cannot fail it)."""
    _t, _l, send, recv = pair_factory()
    latencies = []
    for _ in range(10):
        start = time.perf_counter()
        posted = recv.irecv(bytearray(0))
        assert send.isend(b"").wait(10) == 0
        assert posted.wait(10) == 0
        latencies.append(time.perf_counter() - start)
    assert sorted(latencies)[5] < 0.1, [f"{x * 1e3:.1f} ms" for x in latencies]


@pytest.mark.timeout(20)
def test_send_larger_than_posted_receive_fails_the_send(pair_factory):
    _t, _l, send, recv = pair_factory()
    small = bytearray(10)
    r = recv.irecv(small)
    s = send.isend(b"x" * 20)
    with pytest.raises(RecclError) as info:
        s.wait(5)
    assert "20" in str(info.value) and "10" in str(info.value), str(info.value)
    with pytest.raises(RecclError, match="larger than this posted receive"):
        r.wait(5)  # the receive fails too (CANCEL), rather than waiting forever
    # the connection stays usable: the next message matches the next receive
    buf = bytearray(8)
    r2 = recv.irecv(buf)
    assert send.isend(b"12345678").wait(5) == 8
    assert r2.wait(5) == 8 and bytes(buf) == b"12345678"
    assert send.error == "" and recv.error == ""


@pytest.mark.timeout(20)
def test_send_larger_than_posted_receive_also_fails_the_receive(pair_factory):
    _t, _l, send, recv = pair_factory()
    r = recv.irecv(bytearray(10))
    with pytest.raises(RecclError):
        send.isend(b"x" * 20).wait(5)
    with pytest.raises(RecclError):
        r.wait(1.5)


@pytest.mark.timeout(20)
def test_irecv_needs_a_writable_buffer(pair_factory):
    _t, _l, send, recv = pair_factory()
    for readonly in (b"0123456789", memoryview(bytearray(10)).toreadonly(),
                     np.frombuffer(b"0123456789", dtype=np.uint8)):
        with pytest.raises((BufferError, RecclError, ValueError)):
            recv.irecv(readonly)
    # the failed posts consumed nothing: the next receive matches the next send
    buf = bytearray(3)
    r = recv.irecv(buf)
    assert send.isend(b"abc").wait(5) == 3 and r.wait(5) == 3 and buf == b"abc"


@pytest.mark.timeout(20)
def test_request_wait_times_out_with_a_timeout_error(pair_factory):
    _t, _l, _send, recv = pair_factory()
    r = recv.irecv(bytearray(4))
    start = time.monotonic()
    with pytest.raises(RecclTimeoutError):
        r.wait(0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    with pytest.raises(ConfigError):
        r.wait(-1)


@pytest.mark.timeout(20)
def test_connection_uses_primary_and_backup_only(pair_factory):
    _t, _l, send, recv = pair_factory()
    assert send.active_path == 0 and recv.active_path == 0
    paths = send.paths()
    assert paths[0].startswith(f"primary {PRIMARY}") and "active" in paths[0]
    assert paths[1].startswith(f"backup {BACKUP}")
    assert len(paths) == 2


@pytest.mark.timeout(20)
def test_cross_rail_connection_does_not_dial_last_resort_rails():
    """Regression: the last-resort rails were dialed at connect time (nothing was
    "up" yet while primary and backup were still dialing): 4 paths instead of 2."""
    t = Transport(reccl_env())
    listener = t.listen(1)  # primary 0->1, backup 1->0; rails 0->0 and 1->1 are last resorts
    send = t.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)
    try:
        time.sleep(0.3)
        assert len(send.paths()) == 2, send.paths()
        assert len(recv.paths()) == 2, recv.paths()
    finally:
        close_both(send, recv)


@pytest.mark.timeout(20)
def test_backup_off_opens_only_the_primary(pair_factory):
    _t, _l, send, recv = pair_factory(reccl_env(RECCL_BACKUP="0"))
    time.sleep(0.2)
    assert len(send.paths()) == 1 and send.paths()[0].startswith("primary")
    stream(send, recv, plan_sizes(5, 10, 1 << 16), 5)


# --------------------------------------------------------------------------- failover


@pytest.mark.timeout(30)
def test_failover_mid_stream_then_failback(pair_factory, events):
    _t, _l, send, recv = pair_factory()
    before = torch_reccl.stats()["nics"][PRIMARY]
    sizes = plan_sizes(21, 60, 2 << 20)
    fault = {}

    def on_sent(index):
        if index == 15:
            fault["t"] = time.time()
            torch_reccl.inject_fault(PRIMARY, "down")

    assert send.active_nic == 0 and recv.active_nic == 0  # NVL routes by the active NIC
    stream(send, recv, sizes, 21, window=8, on_sent=on_sent)
    assert send.active_path == 1 and recv.active_path == 1
    assert send.active_nic == 1 and recv.active_nic == 1
    assert wait_until(lambda: all(switch_events(events, "failover", send)), 3)
    senders, receivers = switch_events(events, "failover", send)
    assert len(senders) == 1, [e.to_dict() for e in events.all()]
    for event in senders + receivers[:1]:
        assert event.nic == PRIMARY  # the NIC that failed
        assert (event.from_path, event.to_path) == (0, 1)
        assert event.reason in ("injected", "error", "peer")
        assert event.time >= fault["t"] - 0.01
    assert senders[0].reason == "injected"
    assert senders[0].duration_s is not None and 0 <= senders[0].duration_s < 2.0
    assert senders[0].bytes_replayed is not None and senders[0].bytes_replayed >= 0
    assert events.of("nic_down", nic=PRIMARY)
    assert events.of("path_down", connection=send.id)
    after = torch_reccl.stats()["nics"][PRIMARY]
    assert after["failovers"] >= before["failovers"] + 1
    assert after["up"] is False and after["paths_down"] > before["paths_down"]

    # failback when the primary heals
    torch_reccl.inject_fault(PRIMARY, "up")
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 5), send.paths()
    assert wait_until(lambda: all(switch_events(events, "failback", send)), 3)
    back = switch_events(events, "failback", send)[0][0]
    assert (back.from_path, back.to_path) == (1, 0) and back.reason == "healed"
    assert torch_reccl.stats()["nics"][PRIMARY]["failbacks"] >= before["failbacks"] + 1
    stream(send, recv, plan_sizes(22, 20, 1 << 20), 22)  # and traffic flows on the primary
    assert send.active_path == 0 and send.active_nic == 0


@pytest.mark.timeout(30)
def test_every_connection_on_a_dead_nic_moves_at_once(pair_factory, events):
    """NIC health is process-global: idle connections fail over immediately,
    without waiting for their own heartbeat timeout (1 s here)."""
    env = reccl_env(RECCL_HEARTBEAT_MS="1000")
    pairs = [pair_factory(env)[2:] for _ in range(3)]
    start = time.monotonic()
    torch_reccl.inject_fault(PRIMARY, "down")
    assert wait_until(lambda: all(s.active_path == 1 and r.active_path == 1 for s, r in pairs), 2)
    assert time.monotonic() - start < 0.4  # far below the 1 s heartbeat
    for send, recv in pairs:
        assert events.wait_for(2, "failover", connection=send.id, count=2)
        stream(send, recv, plan_sizes(35, 5, 1 << 16), 35)
    closers = [threading.Thread(target=close_both, args=pair) for pair in pairs]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(20)


@pytest.mark.timeout(30)
def test_outstanding_requests_are_bounded(pair_factory):
    _t, _l, send, recv = pair_factory()
    # Each bound on its own: receives posted while sends wait would complete them.
    bufs = [bytearray(1) for _ in range(1024)]
    recvs = [recv.irecv(b) for b in bufs]  # no send for any
    with pytest.raises(RecclError, match="1024"):
        recv.irecv(bytearray(1))
    assert all(send.isend(b"").wait(10) == 0 for _ in range(1024))
    assert all(r.wait(10) == 0 for r in recvs)
    sends = [send.isend(b"") for _ in range(1024)]  # no receive posted for any
    with pytest.raises(RecclError, match="1024"):
        send.isend(b"")
    recvs = [recv.irecv(b) for b in bufs]
    assert all(s.wait(10) == 0 for s in sends)
    assert all(r.wait(10) == 0 for r in recvs)
    buf = bytearray(2)  # room again
    r = recv.irecv(buf)
    assert send.isend(b"ok").wait(5) == 2 and r.wait(5) == 2 and buf == b"ok"


@pytest.mark.timeout(30)
def test_no_failback_when_disabled(pair_factory, events):
    _t, _l, send, recv = pair_factory(reccl_env(RECCL_FAILBACK="0"))
    torch_reccl.inject_fault(PRIMARY, "down")
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 3)
    stream(send, recv, plan_sizes(31, 20, 1 << 20), 31)
    torch_reccl.inject_fault(PRIMARY, "up")
    # the primary is re-established but not used
    assert wait_until(lambda: send.paths()[0].endswith(" up"), 5), send.paths()
    time.sleep(0.6)
    assert send.active_path == 1 and recv.active_path == 1
    stream(send, recv, plan_sizes(32, 20, 1 << 20), 32)
    assert send.active_path == 1
    assert not events.of("failback", connection=send.id)


@pytest.mark.timeout(30)
def test_blackhole_is_detected_by_timeout(pair_factory, events):
    """A silent drop during a stream. Only timeouts can see it, and both ends run
    the same RECCL_HEARTBEAT_MS clock, so which end notices first is a race:
    - the sending end (its data writes stall, or its heartbeat silence expires):
      its failover carries reason "timeout";
    - the receiving end (heartbeat silence): it fails the path with "timeout" and
      NOTIFYs the sender over the backup, whose failover carries reason "peer".
    Either way a path_down with reason "timeout" precedes the failover."""
    _t, _l, send, recv = pair_factory()
    sizes = plan_sizes(41, 40, 1 << 20)
    fault = {}

    def on_sent(index):
        if index == 5:
            fault["t"] = time.time()
            torch_reccl.inject_fault(PRIMARY, "blackhole")

    stream(send, recv, sizes, 41, window=6, on_sent=on_sent)
    assert wait_until(lambda: all(switch_events(events, "failover", send)), 3)
    senders, receivers = switch_events(events, "failover", send)
    assert senders, [e.to_dict() for e in events.of(connection=send.id)]
    first = senders[0]
    assert (first.from_path, first.to_path, first.nic) == (0, 1, PRIMARY)
    assert (receivers[0].from_path, receivers[0].to_path) == (0, 1)
    assert first.reason in ("timeout", "peer"), first
    # detection took about one heartbeat (300 ms), not a socket error
    assert 0.2 <= first.time - fault["t"] <= 2.0, first.time - fault["t"]
    downs = [e for e in events.of("path_down", connection=send.id) if e.time <= first.time]
    assert any(e.reason == "timeout" for e in downs), [e.to_dict() for e in downs]
    if first.reason == "peer":  # the receiving end saw the silence and told the sender
        assert any(e.reason == "peer" and "peer saw timeout" in e.detail for e in downs), downs
    assert torch_reccl.stats()["nics"][PRIMARY]["blackholed"] is True
    torch_reccl.inject_fault(PRIMARY, "up")
    assert torch_reccl.stats()["nics"][PRIMARY]["blackholed"] is False
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 5)


@pytest.mark.timeout(30)
def test_sustained_blackhole_settles_on_the_backup(pair_factory, events):
    _t, _l, send, recv = pair_factory()
    torch_reccl.inject_fault(PRIMARY, "blackhole")
    stream(send, recv, plan_sizes(42, 20, 1 << 20), 42)
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 3)
    seen = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        seen.add((send.active_path, recv.active_path))
        time.sleep(0.01)
    assert seen == {(1, 1)}, f"active paths seen while blackholed: {seen} {[(e.kind,e.reason,e.detail,e.time) for e in events.of(connection=send.id)]}"
    assert not events.of("path_up", connection=send.id)


@pytest.mark.timeout(30)
def test_all_paths_dead_fails_pending_requests_within_the_bound(pair_factory, events):
    _t, _l, send, recv = pair_factory(reccl_env(RECCL_NO_PATH_TIMEOUT_MS="1000"))
    # Both paths up at both ends first, so the error names both (under load the
    # backup can still be dialing when the faults land).
    assert wait_until(lambda: all(len(c.paths()) >= 2 and all(" up" in p for p in c.paths()[:2])
                                  for c in (send, recv)), 10), (send.paths(), recv.paths())
    buf = bytearray(10)
    r = recv.irecv(buf)
    start = time.monotonic()
    torch_reccl.inject_fault(PRIMARY, "down")
    torch_reccl.inject_fault(BACKUP, "down")
    s = send.isend(b"0123456789")
    for request, conn in ((s, send), (r, recv)):
        with pytest.raises(RecclError) as info:
            try:
                request.wait(5)
            except RecclTimeoutError:
                raise AssertionError(f"not failed after 5 s: error={conn.error!r} "
                                     f"paths={conn.paths()} active={conn.active_path}")
        assert not isinstance(info.value, RecclTimeoutError)
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert "RECCL_NO_PATH_TIMEOUT_MS" in message, message
        assert PRIMARY in message and BACKUP in message  # names every path
        assert 0.9 <= elapsed <= 1.0 + 1.5, elapsed
    assert "RECCL_NO_PATH_TIMEOUT_MS" in send.error
    assert "RECCL_NO_PATH_TIMEOUT_MS" in recv.error
    with pytest.raises(RecclError, match="failed connection"):
        send.isend(b"x")
    with pytest.raises(RecclError, match="failed connection"):
        recv.irecv(bytearray(1))
    assert wait_until(lambda: len(events.of("connection_failed", connection=send.id)) >= 2, 2)
    with pytest.raises(RecclError):
        send.wait_ready(1)


@pytest.mark.timeout(30)
def test_flap_drill_during_a_stream(pair_factory, events):
    """10 down/up cycles at 5 Hz while messages flow: every byte arrives."""
    _t, _l, send, recv = pair_factory()
    before = torch_reccl.stats()["nics"][PRIMARY]["failovers"]
    sizes = plan_sizes(51, 100, 1 << 20)
    flap = torch_reccl.inject_fault(PRIMARY, "flap", period=0.2, count=10)
    start = time.monotonic()
    stream(send, recv, sizes, 51, window=8, on_sent=lambda i: time.sleep(0.022))
    assert time.monotonic() - start > 1.5  # the stream spans the drill
    assert flap.join(5)
    assert len(events.wait_for(2, "nic_down", count=10, nic=PRIMARY)) == 10
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 5)
    time.sleep(0.1)
    flush_events()
    senders, _receivers = switch_events(events, "failover", send)
    assert 5 <= len(senders) <= 10, len(senders)
    assert torch_reccl.stats()["nics"][PRIMARY]["failovers"] - before >= len(senders)
    stream(send, recv, plan_sizes(52, 10, 1 << 20), 52)


# --------------------------------------------------------------------------- one-sided faults


def one_sided(spawn_peer, events, child_role, kind="down", settle=0.8):
    """The child (the faulty end) injects `kind` on its primary NIC after 10
    messages; this process runs the other end and sees no local fault."""
    env = reccl_env(NO_PATH_TIMEOUT_MS=5000)
    seed = 61 if child_role == "recv" else 62
    sizes = plan_sizes(seed, 40, 1 << 20)
    plan = {"seed": seed, "sizes": sizes, "window": 6, "settle": settle}
    peer = spawn_peer(child_role, env, plan, {"at": 10, "nic": PRIMARY, "kind": kind})
    t = Transport(env)
    if child_role == "recv":
        conn = t.connect(0, peer.get("handle", 30))
        conn.wait_ready(10)
        total = run_sender(conn, sizes, seed, 6)
    else:
        listener = t.listen(0)
        peer.put("handle", listener.handle)
        conn = listener.accept(30)
        total = run_receiver(conn, sizes, seed, 6)
    result = peer.get("done", 30)
    assert result["ok"], result["error"]
    assert total == result["bytes"] == sum(sizes)
    return t, conn, result, peer


def child_events(result, kind):
    return [e for e in result["events"] if e["kind"] == kind and e["connection"] == result["connection"]]


@pytest.mark.timeout(40)
def test_fault_seen_only_by_the_receiver_process(spawn_peer, events):
    _t, conn, result, peer = one_sided(spawn_peer, events, "recv", settle=1.0)
    try:
        # Regression: the receiver used to accept the sender's re-dial of the primary
        # on its dead NIC, so the connection failed back onto it. It stays on the backup.
        assert result["active_path"] == 1, result["paths"]
        assert conn.active_path == 1, conn.paths()
        # the child (receiver) saw its NIC die and failed over
        assert [e["nic"] for e in result["events"] if e["kind"] == "nic_down"] == [PRIMARY]
        assert result["nic_stats"][PRIMARY]["up"] is False
        moved = child_events(result, "failover")
        assert moved and (moved[0]["from_path"], moved[0]["to_path"]) == (0, 1)
        assert moved[0]["detail"].startswith("receiver:")
        # this process (sender) never saw a local fault, yet failed over too
        assert torch_reccl.stats()["nics"][PRIMARY]["up"] is True
        assert not events.of("nic_down")
        assert events.wait_for(3, "failover", connection=conn.id)
        sender = events.of("failover", connection=conn.id)[0]
        assert sender.detail.startswith("sender:") and sender.reason in ("error", "peer")
        assert events.of("path_down", connection=conn.id)
    finally:
        peer.put("finish")  # the child closes its end while we close ours
        conn.close()


@pytest.mark.timeout(40)
def test_fault_seen_only_by_the_sender_process(spawn_peer, events):
    _t, conn, result, peer = one_sided(spawn_peer, events, "send")
    try:
        assert result["nic_stats"][PRIMARY]["up"] is False
        moved = child_events(result, "failover")
        assert moved and moved[0]["detail"].startswith("sender:")
        assert moved[0]["reason"] == "injected" and moved[0]["duration_s"] is not None
        assert result["nic_stats"][PRIMARY]["failovers"] >= 1
        # the child's NIC stays down: it stays on the backup
        assert result["active_path"] == 1, result["paths"]
        assert conn.active_path == 1, conn.paths()
        # this process (receiver) saw no local fault but followed the switch
        assert torch_reccl.stats()["nics"][PRIMARY]["up"] is True
        assert not events.of("nic_down")
        assert events.wait_for(3, "failover", connection=conn.id)
        receiver = events.of("failover", connection=conn.id)[0]
        assert receiver.detail.startswith("receiver:")
        assert (receiver.from_path, receiver.to_path) == (0, 1)
        assert receiver.reason == "injected"  # carried over from the sender's ACTIVATE
    finally:
        peer.put("finish")  # the child closes its end while we close ours
        conn.close()


# --------------------------------------------------------------------------- lifecycle / API


@pytest.mark.timeout(30)
def test_close_leaves_no_threads_behind():
    """Paths have no threads of their own: every connection's sockets share the
    NICs' I/O threads, so three connections cost what one does, and closing
    everything gives every thread back (I/O threads retire after 1 s idle)."""
    gc.collect()
    # Threads of earlier tests may still be exiting: count from a settled baseline.
    assert wait_until(lambda: torch_reccl.stats()["io_threads"] == 0, 5)
    assert wait_until(settled_thread_count, 5)
    baseline = thread_count()
    t = Transport(reccl_env())
    listener = t.listen(0)
    with_transport = thread_count()
    assert with_transport > baseline
    pairs = []
    for seed in (71, 72, 73):
        send = t.connect(0, listener.handle)
        send.wait_ready(10)
        recv = listener.accept(10)
        stream(send, recv, plan_sizes(seed, 10, 1 << 20), seed)
        # The backup path comes up beside the primary, not before wait_ready returns.
        assert wait_until(lambda: all(p.split()[-1].startswith("up") for p in send.paths()), 5), send.paths()
        pairs.append((send, recv))
        io_threads = torch_reccl.stats()["io_threads"]
        assert 2 <= io_threads <= 2 * 2, io_threads  # a pool of 1 or 2 per NIC, 2 NICs
        # Dial threads come and go; nothing else grows with the connections.
        assert wait_until(lambda: thread_count() <= with_transport + io_threads, 3), (
            thread_count(), with_transport, io_threads)
    start = time.monotonic()
    for send, recv in pairs:
        close_both(send, recv)
    assert time.monotonic() - start < 2.0 * len(pairs)
    for send, recv in pairs:
        with pytest.raises(RecclError, match="closed"):
            send.isend(b"x")
        with pytest.raises(RecclError, match="closed"):
            recv.irecv(bytearray(1))
        send.close()  # idempotent
    listener.close()
    del send, recv, listener, t, pairs
    gc.collect()
    assert wait_until(lambda: thread_count() <= baseline, 5), (thread_count(), baseline)
    assert torch_reccl.stats()["io_threads"] == 0


@pytest.mark.timeout(30)
def test_close_of_a_healthy_pair_is_prompt():
    t = Transport(reccl_env(RECCL_HEARTBEAT_MS="1000"))
    listener = t.listen(0)
    for order in ("send first", "recv first", "together"):
        send = t.connect(0, listener.handle)
        send.wait_ready(10)
        recv = listener.accept(10)
        start = time.monotonic()
        if order == "send first":
            send.close()
            recv.close()
        elif order == "recv first":
            recv.close()
            send.close()
        else:
            close_both(send, recv)
        assert time.monotonic() - start < 0.5, order
    listener.close()


@pytest.mark.timeout(20)
def test_close_fails_pending_requests(pair_factory):
    _t, _l, send, recv = pair_factory()
    r, s1 = recv.irecv(bytearray(8)), send.isend(b"x" * 8)
    assert s1.wait(5) == 8 and r.wait(5) == 8
    r2, s2 = recv.irecv(bytearray(8)), send.isend(b"y" * 8)
    s3 = send.isend(b"z" * 8)  # no receive posted for it: waits for a CTS
    assert s2.wait(5) == 8 and r2.wait(5) == 8
    send.close()
    with pytest.raises(RecclError, match="closed"):
        s3.wait(3)
    r4 = recv.irecv(bytearray(8))
    with pytest.raises(RecclError, match="closed"):
        r4.wait(3)  # the sender closed: the receive fails instead of hanging
    recv.close()
    with pytest.raises(RecclError, match="closed"):
        recv.irecv(bytearray(8))


@pytest.mark.timeout(20)
def test_connect_with_a_corrupted_handle_is_a_protocol_error():
    t = Transport(reccl_env())
    listener = t.listen(0)
    good = listener.handle
    assert len(good) == _C.HANDLE_BYTES == 128
    corrupt = [
        b"\x00" * 128,
        bytes([good[0] ^ 0xFF]) + good[1:],               # magic
        good[:4] + b"\x07\x00" + good[6:],                 # version
        good[:6] + b"\x00" + good[7:],                     # no NICs
        good[:6] + b"\x0d" + good[7:],                     # 13 NICs
        good[:7] + b"\x05" + good[8:],                     # listener NIC out of range
        good[:8] + b"\x09" + good[9:],                     # backup NIC out of range
        good[:36] + b"\x00\x00\x00\x00" + good[40:],       # chunk size 0
        good[:36] + b"\x00\x00\x00\x10" + good[40:],       # chunk size 256 MiB
        good[:50],                                         # truncated
        b"",
    ]
    for handle in corrupt:
        with pytest.raises(ProtocolError):
            t.connect(0, handle)
        with pytest.raises(ProtocolError):
            _C.decode_handle(handle)
    listener.close()


@pytest.mark.timeout(20)
def test_connect_with_a_wrong_secret_is_refused(events):
    t = Transport(reccl_env(RECCL_NO_PATH_TIMEOUT_MS="1000", RECCL_CONNECT_TIMEOUT_MS="500"))
    listener = t.listen(0)
    handle = bytearray(listener.handle)
    handle[20] ^= 0x01  # the secret starts at byte 20
    rejected = torch_reccl.stats()["rejected_handshakes"]
    send = t.connect(0, bytes(handle))
    start = time.monotonic()
    with pytest.raises(RecclError) as info:
        send.wait_ready(5)
    assert time.monotonic() - start < 3.0
    assert "RECCL_NO_PATH_TIMEOUT_MS" in str(info.value) or "refused" in str(info.value)
    assert torch_reccl.stats()["rejected_handshakes"] > rejected
    assert events.wait_for(2, "handshake_rejected")
    assert any("secret" in e.detail for e in events.of("handshake_rejected"))
    with pytest.raises(RecclTimeoutError):
        listener.accept(0.1)
    send.close()
    listener.close()


@pytest.mark.timeout(10)
def test_on_event_rejects_unknown_kinds_and_non_callables():
    with pytest.raises(ValueError, match="valid kinds"):
        on_event(print, kinds=["failover", "explosion"])
    with pytest.raises(ValueError):
        on_event(print, kinds="nope")
    with pytest.raises(TypeError):
        on_event(42)
    handle = on_event(print, kinds=list(EVENT_KINDS))
    handle.remove()
    handle.remove()  # idempotent


@pytest.mark.timeout(10)
def test_event_json_round_trip():
    event = Event(kind="failover", time=1700000000.25, rank=3, nic=PRIMARY, peer="127.0.0.1",
                  reason="timeout", detail='sender: "quoted" \u00e9', connection=2**64 - 1,
                  from_path=0, to_path=1, duration_s=0.0123, bytes_replayed=4096)
    text = event.to_json()
    assert Event(**json.loads(text)) == event
    assert json.loads(text)["connection"] == 2**64 - 1
    empty = Event(kind="nic_up", time=0.0, rank=None, nic="x", peer="", reason="", detail="")
    assert Event(**json.loads(empty.to_json())) == empty


@pytest.mark.timeout(20)
def test_live_events_round_trip_through_json(pair_factory, events):
    _t, _l, send, _recv = pair_factory()
    torch_reccl.inject_fault(PRIMARY, "down")
    assert events.wait_for(3, "failover", connection=send.id)
    for event in events.all():
        assert event.kind in EVENT_KINDS
        assert Event(**json.loads(event.to_json())) == event

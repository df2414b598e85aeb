"""The transport contract: one set of tests, run over TCP and over the IB verbs
emulation alike (as Gloo runs each algorithm over every transport).

The ``bed`` fixture is parametrized over ["tcp", "tcp-sockets", "ib"] and yields
make(**RECCL_overrides) -> conftest.Fabric: two hosts, a and b, each a transport
with a primary and a backup NIC (rail 0 and rail 1); ``pair()`` connects a -> b
(``reverse`` b -> a). Host a's NICs are ``nics_a`` (primary, backup), host b's
``nics_b``. Both hosts live in this process but their NICs have different names,
so a fault on one host's NIC is seen by that host only: that is how "seen by one
side" is tested, for both transports, without a second process. "tcp" carries
bulk payloads by same-host reads (both hosts share this process's kernel, the
DATA_REF frames of transport/same_host.h), "tcp-sockets" (the setting
RECCL_SAME_HOST_READS=0) every byte through the sockets, as between hosts.

How each fault is made, per transport:
- link down/up: IB, an emulated port event (PORT_ERR/PORT_ACTIVE, reason
  "link down", the GID table is rebuilt); TCP, ``inject_fault(nic, "down")``
  (reason "injected"). A real TCP link down needs a network namespace (root):
  test_failover_fabric.py does that, not this suite.
- blackhole: IB, the emulation drops every packet of the device, which the QP's
  own retry budget detects (retry-exceeded after ~134 ms; the heartbeat is set to
  5 s so that nothing else can); TCP, ``inject_fault(nic, "blackhole")``, which
  only the heartbeat (300 ms) detects. The detection differs by design; the
  outcome checked is the same.
- flap: ``inject_fault(nic, "flap")`` for TCP; for IB a thread cycles the port
  with the same period (the drill's process-level health flap is not a port
  event, so it would not exercise the IB event path).
Not uniform, and why: nothing else.

Transport-specific checks (handles, secrets, RDMA registration and placement,
GID choice, corrupted deliveries, bootstrap) stay in test_transport.py and
test_ib_transport.py.
"""
from __future__ import annotations

import collections
import gc
import os
import threading
import time

import numpy as np
import pytest

import torch_reccl
from torch_reccl.bench import procstat
from torch_reccl.transport import ConfigError, RecclError, TimeoutError as RecclTimeoutError

from conftest import close_both, fabrics, in_thread, plan_sizes, run_receiver, run_sender, stream, wait_until

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("healed_nics")]

KINDS = ["tcp", "tcp-sockets", "ib"]


@pytest.fixture(params=KINDS)
def bed(request):
    yield from fabrics(request.param)


def switch_events(events, kind, conn):
    """(sender's, receiver's) events of `kind` for connection `conn`."""
    found = events.of(kind, connection=conn.id)
    return ([e for e in found if e.detail.startswith("sender:")],
            [e for e in found if e.detail.startswith("receiver:")])


def same_host_bytes(nics):
    """Bytes the named NICs' paths received by same-host reads (process-wide counters)."""
    counters = torch_reccl.stats()["nics"]
    return sum(counters[nic]["same_host_bytes"] for nic in nics if nic in counters)


def both_on(send, recv, path, timeout):
    return wait_until(lambda: send.active_path == path and recv.active_path == path, timeout)


def streamed_fault(send, recv, seed, at, act, count=50, max_bytes=256 << 10, window=8):
    """Streams `count` random messages; act() runs once `at` sends completed.
    Returns the wall time of the fault."""
    fired = {}

    def on_sent(index):
        if index == at and not fired:
            fired["t"] = time.time()
            act()

    stream(send, recv, plan_sizes(seed, count, max_bytes, big=1), seed, window=window,
           on_sent=on_sent)
    assert fired, "the fault never fired"
    return fired["t"]


# --------------------------------------------------------------------------- fault-free


def test_a_connection_has_a_primary_and_a_backup_path(bed):
    f = bed()
    for transport, nics in ((f.a, f.nics_a), (f.b, f.nics_b)):
        listed = transport.nics()
        assert [n["name"] for n in listed] == nics
        assert [n["backup"] for n in listed] == nics[::-1]
        assert all(n["up"] for n in listed)
    send, recv = f.pair()
    assert send.active_path == 0 and recv.active_path == 0
    assert send.active_nic == 0 and recv.active_nic == 0
    assert wait_until(lambda: all(len(c.paths()) == 2 and all(" up" in p for p in c.paths())
                                  for c in (send, recv)), 5), (send.paths(), recv.paths())
    time.sleep(0.2)  # no third path (last-resort rails) appears later
    paths = send.paths()
    assert len(paths) == 2, paths
    assert paths[0].startswith(f"primary {f.nics_a[0]}") and "active" in paths[0], paths
    assert paths[1].startswith(f"backup {f.nics_a[1]}"), paths
    assert recv.paths()[0].startswith(f"primary {f.nics_b[0]}"), recv.paths()
    assert recv.paths()[1].startswith(f"backup {f.nics_b[1]}"), recv.paths()


@pytest.mark.timeout(60)
def test_random_streams_both_ways_are_bit_exact(bed):
    """Two connections a -> b and one b -> a at once, 8 in flight on each, random
    contents, 0 B .. 512 KiB plus two of 4 MiB; one receiver posts buffers 7 B
    larger than the messages."""
    f = bed()
    read_before = same_host_bytes(f.nics_a + f.nics_b)
    forward = [f.pair() for _ in range(2)]
    back_send, back_recv = f.pair(1, reverse=True)
    plans = [plan_sizes(10 + i, 80, 512 << 10, big=2) for i in range(3)]
    joins = []
    for i, (send, recv) in enumerate(forward + [(back_send, back_recv)]):
        joins.append(in_thread(run_receiver, recv, plans[i], 10 + i, 8, 30.0, 7 if i == 0 else 0))
        joins.append(in_thread(run_sender, send, plans[i], 10 + i, 8, 30.0))
    totals = [join(55) for join in joins]
    assert totals == [sum(p) for p in plans for _ in (0, 1)]
    for send, recv in forward + [(back_send, back_recv)]:
        assert send.error == recv.error == ""
        assert send.active_path == recv.active_path == 0
    # The bulk went the way the bed says: read from the sender's memory (most of
    # it: only chunks under 16 KiB stay inline) or all through the sockets.
    read = same_host_bytes(f.nics_a + f.nics_b) - read_before
    if f.same_host_reads:
        assert read > sum(totals) // 4, (read, sum(totals))
    else:
        assert read == 0, read


def test_zero_byte_messages_and_buffer_kinds(bed):
    send, recv = bed().pair()
    # 0-byte sends into 0-byte and larger buffers, interleaved with data
    bufs = [bytearray(0), bytearray(16), bytearray(5), bytearray(0)]
    payloads = [b"", b"", b"hello", b""]
    reqs = [recv.irecv(b) for b in bufs]
    sends = [send.isend(p) for p in payloads]
    assert [s.wait(10) for s in sends] == [0, 0, 5, 0]
    assert [r.wait(10) for r in reqs] == [0, 0, 5, 0]
    assert bytes(bufs[2]) == b"hello" and bytes(bufs[1]) == bytes(16)
    # a run of 0-byte messages alone
    reqs = [recv.irecv(bytearray(0)) for _ in range(20)]
    assert [send.isend(b"").wait(10) for _ in range(20)] == [0] * 20
    assert [r.wait(10) for r in reqs] == [0] * 20
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


# --------------------------------------------------------------------------- link down


@pytest.mark.parametrize("side", ["sender", "receiver", "both"])
def test_link_down_mid_stream_fails_over_then_back(bed, events, side):
    """The primary NIC of the sending host, of the receiving host, or of both,
    loses its link mid-stream: every byte arrives, both ends move to the backup
    and stay there while the NIC is down, and return when it heals. A host whose
    own NIC did not fail sees no nic_down, yet follows the switch."""
    # The IB retry budget is ~34 s here: a fault at the far end is known only
    # from the notice over the backup, never by a timeout.
    f = bed(RECCL_IB_TIMEOUT=20)
    send, recv = f.pair()
    faulty = {"sender": [f.nics_a[0]], "receiver": [f.nics_b[0]],
              "both": [f.nics_a[0], f.nics_b[0]]}[side]
    healthy = [n for n in f.nics_a + f.nics_b if n not in faulty]
    before = {n: dict(torch_reccl.stats()["nics"][n]) for n in faulty}

    def fault():
        for nic in faulty:
            f.link(nic, up=False)

    fault_t = streamed_fault(send, recv, 21, 12, fault)
    assert both_on(send, recv, 1, 5), (send.paths(), recv.paths())
    assert send.active_nic == 1 and recv.active_nic == 1
    assert wait_until(lambda: all(switch_events(events, "failover", send)), 3), \
        [e.to_dict() for e in events.of(connection=send.id)]
    senders, receivers = switch_events(events, "failover", send)
    assert len(senders) == 1, [e.to_dict() for e in senders]
    for event in senders + receivers[:1]:
        assert (event.from_path, event.to_path) == (0, 1)
        assert event.time >= fault_t - 0.01
    assert senders[0].duration_s is not None and 0 <= senders[0].duration_s < 2.0
    assert senders[0].bytes_replayed is not None and senders[0].bytes_replayed >= 0
    if side in ("sender", "both"):
        assert senders[0].nic == f.nics_a[0]
    if side == "sender":  # the receiver only hears of it: the sender's reason travels along
        assert senders[0].reason == f.link_down_reason
        assert receivers[0].reason == f.link_down_reason, receivers[0]
    if side == "receiver":
        assert any(e.nic == f.nics_b[0] and e.reason == f.link_down_reason for e in receivers), \
            [e.to_dict() for e in receivers]
        assert senders[0].reason in ("error", "peer"), senders[0]
    assert [e.nic for e in events.of("nic_down")] and \
        sorted({e.nic for e in events.of("nic_down")}) == sorted(faulty)
    assert events.of("path_down", connection=send.id)
    stats = torch_reccl.stats()["nics"]
    for nic in faulty:
        assert stats[nic]["up"] is False
        assert stats[nic]["paths_down"] > before[nic]["paths_down"]
    for nic in healthy:
        assert stats[nic]["up"] is True
    if side != "receiver":
        assert stats[f.nics_a[0]]["failovers"] >= before[f.nics_a[0]]["failovers"] + 1

    # While the NIC is down the connection stays on the backup: re-dials of the
    # primary are refused at the dead end.
    seen = set()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        seen.add((send.active_path, recv.active_path))
        time.sleep(0.01)
    assert seen == {(1, 1)}, seen
    stream(send, recv, plan_sizes(22, 10, 64 << 10), 22)

    for nic in faulty:
        f.link(nic, up=True)
    assert both_on(send, recv, 0, 10), (send.paths(), recv.paths())
    assert wait_until(lambda: all(switch_events(events, "failback", send)), 3)
    back = switch_events(events, "failback", send)[0][0]
    assert (back.from_path, back.to_path) == (1, 0) and back.reason == "healed"
    if side != "receiver":
        stats = torch_reccl.stats()["nics"]
        assert stats[f.nics_a[0]]["failbacks"] >= before[f.nics_a[0]]["failbacks"] + 1
    stream(send, recv, plan_sizes(23, 20, 256 << 10), 23)  # and traffic flows on the primary
    assert send.active_path == 0 and send.active_nic == 0
    assert send.error == recv.error == ""


def test_every_connection_on_a_dead_nic_moves_at_once(bed, events):
    """NIC health is process-global: idle connections fail over at once, without
    waiting for their own heartbeat (1 s) or retry (IB: ~34 s) timeout."""
    f = bed(RECCL_HEARTBEAT_MS=1000, RECCL_IB_TIMEOUT=20)
    pairs = [f.pair() for _ in range(3)]
    start = time.monotonic()
    f.link(f.nics_a[0], up=False)
    assert wait_until(lambda: all(s.active_path == 1 and r.active_path == 1 for s, r in pairs), 2)
    assert time.monotonic() - start < 0.5  # far below the 1 s heartbeat
    for i, (send, recv) in enumerate(pairs):
        assert len(events.wait_for(2, "failover", connection=send.id, count=2)) >= 2
        stream(send, recv, plan_sizes(35 + i, 5, 64 << 10), 35 + i)


@pytest.mark.timeout(40)
def test_flapping_link_during_a_stream(bed, events):
    """10 down/up cycles at 5 Hz of the sender's primary while messages flow:
    every byte arrives, and the connection ends on the healed primary."""
    f = bed()
    send, recv = f.pair()
    nic = f.nics_a[0]
    before = torch_reccl.stats()["nics"][nic]["failovers"]
    if f.kind == "tcp":
        flap = torch_reccl.inject_fault(nic, "flap", period=0.2, count=10)
        join_flap = flap.join
    else:
        def cycle():
            for _ in range(10):
                f.link(nic, up=False)
                time.sleep(0.1)
                f.link(nic, up=True)
                time.sleep(0.1)

        thread = threading.Thread(target=cycle, daemon=True)
        thread.start()

        def join_flap(timeout):
            thread.join(timeout)
            return not thread.is_alive()
    start = time.monotonic()
    stream(send, recv, plan_sizes(51, 100, 256 << 10), 51, window=8,
           on_sent=lambda i: time.sleep(0.022))
    assert time.monotonic() - start > 1.5  # the stream spans the drill
    assert join_flap(5)
    assert len(events.wait_for(2, "nic_down", count=10, nic=nic)) == 10
    assert both_on(send, recv, 0, 10), (send.paths(), recv.paths())
    senders, _receivers = switch_events(events, "failover", send)
    # Each sender failover ends a switch that began when its active path was
    # lost, and losses while a switch is pending fold into it: a link down makes
    # at most one, and a down that finds the connection still on the backup (the
    # primary not yet re-dialed and failed back to) makes none. More failovers
    # than downs mean the primary was lost for some other reason.
    assert 5 <= len(senders) <= 10, flap_history(events, send, nic)
    assert torch_reccl.stats()["nics"][nic]["failovers"] - before >= len(senders)
    stream(send, recv, plan_sizes(52, 10, 256 << 10), 52)
    assert send.error == recv.error == ""


def flap_history(events, conn, nic):
    """The sender's switches and `nic`'s link events, in order, for a failure message."""
    found = [e for e in events.all()
             if (e.kind in ("nic_down", "nic_up") and e.nic == nic)
             or (e.kind in ("failover", "failback", "path_down") and e.connection == conn.id
                 and (e.kind == "path_down" or e.detail.startswith("sender:")))]
    if not found:
        return "no events"
    start = found[0].time
    lines = [f"{sum(e.kind == 'failover' for e in found)} sender failovers, "
             f"{sum(e.kind == 'failback' for e in found)} failbacks, "
             f"{sum(e.kind == 'nic_down' for e in found)} downs of {nic}:"]
    for e in found:
        path = f" {e.from_path}->{e.to_path}" if e.kind in ("failover", "failback") else ""
        lines.append(f"  +{e.time - start:.3f}s {e.kind}{path} {e.nic} ({e.reason}) {e.detail}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- blackhole


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_blackhole_is_detected_and_settles_on_the_backup(bed, events, side):
    """Traffic through one host's primary NIC silently vanishes mid-stream. No
    error is ever raised: only a timeout can tell (TCP: heartbeat silence, 300 ms;
    IB: the QP's retry budget, ~134 ms, with the heartbeat at 5 s). Every byte
    arrives, the connection moves to the backup once and stays there while the
    blackhole lasts (re-dials of the primary must not succeed), and fails back
    when it ends."""
    # TCP: the heartbeat is the only detector. IB: a slow heartbeat, so the
    # retry budget is.
    f = bed(RECCL_HEARTBEAT_MS=300 if bed.kind == "tcp" else 5000)
    send, recv = f.pair()
    nic = (f.nics_a if side == "sender" else f.nics_b)[0]
    counters = f.emu.counters() if f.emu is not None else None
    fault_t = streamed_fault(send, recv, 41, 6, lambda: f.blackhole(nic), window=6)
    assert both_on(send, recv, 1, 5), (send.paths(), recv.paths())
    assert wait_until(lambda: all(switch_events(events, "failover", send)), 3)
    senders, receivers = switch_events(events, "failover", send)
    assert (senders[0].from_path, senders[0].to_path) == (0, 1)
    assert (receivers[0].from_path, receivers[0].to_path) == (0, 1)
    # detected by a timeout, not at once and not after seconds
    assert 0.1 <= senders[0].time - fault_t <= 2.0, senders[0].time - fault_t
    downs = [e for e in events.of("path_down", connection=send.id) if e.time <= senders[0].time]
    details = [(e.reason, e.detail) for e in downs]
    if f.kind == "tcp":
        # Which end notices the silence first is a race (both run the same
        # heartbeat clock): the sender ("timeout"), or the receiver, which fails
        # the path and tells the sender over the backup ("peer"); when the
        # receiver's own NIC is the blackholed one, its closing the path can
        # also reach the sender first as a socket error ("error").
        expected = ("timeout", "peer") + (("error",) if side == "receiver" else ())
        assert senders[0].reason in expected, senders[0]
        # heartbeat silence, or a write that stopped making progress
        assert any(e.reason == "timeout" and ("no heartbeat from" in e.detail
                                              or "no progress" in e.detail)
                   for e in downs), details
        assert torch_reccl.stats()["nics"][nic]["blackholed"] is True
    else:
        assert any("retry counter exceeded" in e.detail and "RECCL_IB_TIMEOUT" in e.detail
                   for e in downs), details
        after = f.emu.counters()
        assert after["dropped"] > counters["dropped"]
        assert after["retry_exceeded"] > counters["retry_exceeded"]
        # The failed QP went to ERR: its posted receives and queued requests flushed.
        assert after["qp_errors"] > counters["qp_errors"]
        assert after["flushed"] >= counters["flushed"] + 32

    # Sustained: the connection stays on the backup while the blackhole lasts.
    seen = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        seen.add((send.active_path, recv.active_path))
        time.sleep(0.01)
    assert seen == {(1, 1)}, f"active paths seen while blackholed: {seen}"
    stream(send, recv, plan_sizes(42, 10, 64 << 10), 42)
    assert len(switch_events(events, "failover", send)[0]) == 1
    assert not events.of("failback", connection=send.id)

    f.blackhole(nic, on=False)
    if f.kind == "tcp":  # the drill's flag (the IB emulation drops below NIC health)
        assert torch_reccl.stats()["nics"][nic]["blackholed"] is False
    assert both_on(send, recv, 0, 10), (send.paths(), recv.paths())
    stream(send, recv, plan_sizes(43, 10, 64 << 10), 43)
    assert send.error == recv.error == ""


# --------------------------------------------------------------------------- no path left


def test_both_nics_down_fails_pending_requests_within_the_bound(bed, events):
    """Both NICs of the sending host die: each end fails its pending requests
    once RECCL_NO_PATH_TIMEOUT_MS (1 s) passed without a path, with an error that
    says so and names every path, and the connection refuses new requests."""
    f = bed(RECCL_NO_PATH_TIMEOUT_MS=1000)
    send, recv = f.pair()
    # Both paths up at both ends first, so the error names both.
    assert wait_until(lambda: all(len(c.paths()) == 2 and all(" up" in p for p in c.paths())
                                  for c in (send, recv)), 10), (send.paths(), recv.paths())
    stream(send, recv, plan_sizes(8, 5, 64 << 10), 8)
    buf = bytearray(10)
    r = recv.irecv(buf)
    start = time.monotonic()
    f.link(f.nics_a[0], up=False)
    f.link(f.nics_a[1], up=False)
    s = send.isend(b"0123456789")
    for request, conn, nics in ((s, send, f.nics_a), (r, recv, f.nics_b)):
        with pytest.raises(RecclError) as info:
            try:
                request.wait(5)
            except RecclTimeoutError:
                raise AssertionError(f"not failed after 5 s: error={conn.error!r} "
                                     f"paths={conn.paths()} active={conn.active_path}")
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert "RECCL_NO_PATH_TIMEOUT_MS" in message, message
        assert nics[0] in message and nics[1] in message, message  # names every path
        assert 0.9 <= elapsed <= 1.0 + 1.5, elapsed
        assert "RECCL_NO_PATH_TIMEOUT_MS" in conn.error
    with pytest.raises(RecclError, match="failed connection"):
        send.isend(b"x")
    with pytest.raises(RecclError, match="failed connection"):
        recv.irecv(bytearray(1))
    assert wait_until(lambda: len(events.of("connection_failed", connection=send.id)) >= 2, 2)
    with pytest.raises(RecclError):
        send.wait_ready(1)


# --------------------------------------------------------------------------- scale


def thread_ids():
    return set(os.listdir("/proc/self/task"))


def thread_names(tids):
    stats = procstat.threads()
    return [stats[tid].name for tid in sorted(tids) if tid in stats]


def all_paths_up(pairs):
    return all(len(c.paths()) == 2 and all(" up" in p for p in c.paths())
               for pair in pairs for c in pair)


def io_pool_bound():
    """The most I/O threads the process may run: RECCL_IO_THREADS by cores (1 or
    2) per NIC it has seen, whatever its connections."""
    return 2 * len(torch_reccl.stats()["nics"])


@pytest.mark.timeout(90)
def test_threads_do_not_grow_with_connections(bed):
    """Paths have no threads of their own on either transport: their sockets or
    completion channels are served by the process's I/O loops, a fixed pool per
    NIC, so 32 connections cost the threads one does. (A polling thread per IB
    path would show as 64 more per 32 connections, at each end.)"""
    f = bed()
    first = f.pair()
    stream(*first, plan_sizes(81, 5, 256 << 10), 81)
    assert wait_until(lambda: all_paths_up([first]), 5)

    def others():  # dial threads come and go: what is not an I/O loop must settle
        return sorted(n for n in thread_names(thread_ids()) if n != "reccl-io")

    # Transports of earlier tests may still be closing on a loaded box: their
    # threads leave during this test, so the check is that no kind of thread
    # outnumbers what there was with one connection.
    time.sleep(0.3)
    with_one = collections.Counter(others())
    pairs = [first] + [f.pair() for _ in range(31)]
    stream(*pairs[-1], plan_sizes(82, 5, 256 << 10), 82)
    assert wait_until(lambda: all_paths_up(pairs), 20)
    assert wait_until(lambda: not collections.Counter(others()) - with_one, 5), \
        (collections.Counter(others()) - with_one, with_one)
    io_threads = torch_reccl.stats()["io_threads"]
    assert 1 <= io_threads <= io_pool_bound(), io_threads
    assert thread_names(thread_ids()).count("reccl-io") <= io_pool_bound()


def voluntary_switches(seconds):
    """How often reccl's threads blocked over `seconds` (one voluntary context
    switch per sleep, so per wake-up), over the threads alive throughout."""
    def sample():
        return {tid: t.voluntary for tid, t in procstat.threads().items()
                if t.name.startswith("reccl-")}

    before = sample()
    time.sleep(seconds)
    after = sample()
    return sum(after[tid] - before[tid] for tid in after if tid in before)


@pytest.mark.timeout(60)
def test_idle_connections_wake_nothing_but_their_heartbeats(bed):
    """An idle path is woken by its heartbeats only (sending one, hearing one,
    its completion): a few wake-ups per beat, here one beat a second. Nothing
    polls it. (A path thread polling with a backoff of at most 1 ms would show
    as ~1000 wake-ups a second per path end.)"""
    f = bed(RECCL_HEARTBEAT_MS=4000)  # a beat every second
    time.sleep(0.5)
    transports_alone = voluntary_switches(2.0)  # accept, port events, supervision
    pairs = [f.pair() for _ in range(8)]
    stream(*pairs[0], plan_sizes(83, 5, 256 << 10), 83)
    assert wait_until(lambda: all_paths_up(pairs), 10)
    time.sleep(0.5)
    seconds = 2.0
    idle = voluntary_switches(seconds)
    path_ends = 2 * 2 * len(pairs)
    per_path_end = (idle - transports_alone) / seconds / path_ends
    assert per_path_end < 8, (idle, transports_alone, per_path_end)
    for send, recv in pairs:
        assert send.error == recv.error == ""
        assert send.active_path == recv.active_path == 0


# --------------------------------------------------------------------------- close


@pytest.mark.timeout(40)
def test_close_leaves_no_thread_behind(bed):
    """After every connection, listener and transport is closed and dropped, each
    thread started for them exits within 5 s (I/O threads may idle ~1-2 s before
    they retire). Threads are compared by id, so a thread of an earlier test that
    exits meanwhile cannot hide one of ours that stays."""
    gc.collect()
    baseline = thread_ids()
    f = bed()
    with_transports = thread_ids()
    forward = f.pair()
    backward = f.pair(1, reverse=True)
    for i, (send, recv) in enumerate((forward, backward)):
        stream(send, recv, plan_sizes(71 + i, 10, 256 << 10), 71 + i)
    assert wait_until(lambda pairs=(forward, backward): all_paths_up(pairs), 5)
    started = thread_ids() - baseline
    assert started, "no thread started for two transports and two connections?"
    start = time.monotonic()
    close_both(*forward)
    close_both(*backward)
    assert time.monotonic() - start < 2.0  # a healthy pair closes promptly
    for listener in f.listeners:
        listener.close()

    # The transports live on: what the connections started goes, what the
    # transports started (accept, supervision, link or port events) may stay,
    # and so may the shared I/O pool ("reccl-io"), which a transport's own
    # sockets can keep busy.
    def connection_threads():
        return [n for n in thread_names(thread_ids() - with_transports) if n != "reccl-io"]

    assert wait_until(lambda: not connection_threads(), 5), \
        f"connection threads left: {connection_threads()}"
    for send, recv in (forward, backward):
        with pytest.raises(RecclError, match="closed"):
            send.isend(b"x")
        with pytest.raises(RecclError, match="closed"):
            recv.irecv(bytearray(1))
        send.close()  # idempotent
        recv.close()
    f.close()  # drops its transports (and the IB emulation)
    del f, forward, backward, send, recv, listener
    gc.collect()
    assert wait_until(lambda: not (thread_ids() - baseline), 5), \
        f"threads left: {thread_names(thread_ids() - baseline)}"


def test_close_of_a_healthy_pair_is_prompt(bed):
    f = bed(RECCL_HEARTBEAT_MS=1000)
    for order in ("send first", "recv first", "together"):
        send, recv = f.pair()
        stream(send, recv, plan_sizes(75, 5, 64 << 10), 75)
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


def test_close_fails_pending_requests(bed):
    send, recv = bed().pair()
    r, s1 = recv.irecv(bytearray(8)), send.isend(b"x" * 8)
    assert s1.wait(5) == 8 and r.wait(5) == 8
    r2, s2 = recv.irecv(bytearray(8)), send.isend(b"y" * 8)
    s3 = send.isend(b"z" * 8)  # no receive posted for it: waits for a CTS
    assert s2.wait(5) == 8 and r2.wait(5) == 8
    start = time.monotonic()
    send.close()
    with pytest.raises(RecclError, match="closed"):
        s3.wait(3)
    r4 = recv.irecv(bytearray(8))
    with pytest.raises(RecclError, match="closed"):
        r4.wait(3)  # the sender closed: the receive fails instead of hanging
    assert time.monotonic() - start < 3.0
    recv.close()
    with pytest.raises(RecclError, match="closed"):
        recv.irecv(bytearray(8))


def test_close_of_the_receiving_end_fails_its_pending_requests(bed):
    send, recv = bed().pair()
    stream(send, recv, plan_sizes(76, 3, 1024), 76)
    pending = [recv.irecv(bytearray(16)) for _ in range(3)]  # nothing will be sent
    start = time.monotonic()
    recv.close()
    for request in pending:
        with pytest.raises(RecclError, match="closed"):
            request.wait(3)
    assert time.monotonic() - start < 3.0


def test_close_of_the_receiving_end_fails_the_senders_requests(bed):
    """The mirror of the case above: the receiver's CLOSE fails the send pending
    at it and any send posted after it, promptly, with an error that says the
    receiver closed (not a timeout, not RECCL_NO_PATH_TIMEOUT_MS)."""
    send, recv = bed().pair()
    stream(send, recv, plan_sizes(77, 3, 1024), 77)
    early = send.isend(b"early")  # no receive posted for it: waits for a CTS
    start = time.monotonic()
    recv.close()
    late = send.isend(b"late")
    for request in (early, late):
        with pytest.raises(RecclError, match="the receiver closed the connection"):
            request.wait(2)
    assert time.monotonic() - start < 2.0
    with pytest.raises(RecclError, match="the receiver closed the connection"):
        send.isend(b"later").wait(2)
    send.close()

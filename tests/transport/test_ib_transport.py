"""The IB verbs transport (s-Bond over RC QPs) against the in-process verbs emulation.

There is no RDMA hardware in CI: every test here runs the real IB transport code
(QP setup over the bootstrap socket, CTS FIFO written by RDMA, data by RDMA write
with immediate, port events, CQE errors, resync over the backup QP) on
``_testing.IbEmulation``, which gives RC semantics (in-order execution, write-with-
immediate completions, QP error state with flushes, retry-exceeded after
4.096 us * 2^RECCL_IB_TIMEOUT * (RECCL_IB_RETRY_CNT + 1)) and fault hooks (port
down/up with async events and a GID table that changes on every flap, blackhole,
corrupted deliveries). Host "a" sends, host "b" receives; each has two devices
(rails 0 and 1); the ``fabric`` fixture and ``Fabric`` are in conftest.py. Data is
checked bit for bit. docs/ib.md says what this does and does not prove.

What every transport must do (streams, failover/failback on a port event,
blackhole by retry-exceeded, faults seen by one end, no path left, close) is
tested once for TCP and IB alike in test_transport_contract.py; this file keeps
what only IB has: staging and direct placement by RDMA, registrations, fencing of
writes in flight, GIDs, corrupted deliveries, the bootstrap and QP exchange.
"""
from __future__ import annotations

import ctypes
import gc
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

import torch_reccl
from torch_reccl._native import testing as emulations
from torch_reccl.bench import procstat
from torch_reccl.transport import _C, ConfigError, ProtocolError, RecclError

from conftest import (
    A0,
    A1,
    B0,
    B1,
    HELPERS,
    IB_CHUNK,
    Fabric,
    ib_env,
    in_thread,
    message,
    plan_sizes,
    registered_stream,
    run_sender,
    stream,
    wait_until,
)
from nccl_net_harness import DmaBufArena

_testing = emulations()  # the IB rules: GID choice, port speed, QP exchange, handles

pytestmark = [pytest.mark.timeout(60)]

CHUNK = IB_CHUNK


def ipv4_gid_index(table):
    return next(i for i, (gid, kind) in enumerate(table)
                if kind == "RoCEv2" and gid[:12] == b"\x00" * 10 + b"\xff\xff")


# ------------------------------------------------------------------ healthy paths


def test_unregistered_messages_travel_as_rdma_writes_into_staging_slots(fabric):
    """Bit-exact streams in both directions are the contract suite's
    (test_transport_contract.py); this checks how the bytes travel over IB."""
    f = fabric()
    send, recv = f.pair()
    before = f.emu.counters()
    sizes = plan_sizes(1, 120, 3 * CHUNK, big=2)  # 0 and 1 bytes, chunk multiples, 1.5 MiB
    stream(send, recv, sizes, 1)
    after = f.emu.counters()
    # Every chunk travelled as an RDMA write with immediate into a staging slot.
    chunks = sum(max(1, -(-s // CHUNK)) for s in sizes)
    assert after["writes"] - before["writes"] >= chunks
    assert after["writes_with_imm"] - before["writes_with_imm"] >= chunks
    assert after["bytes"] - before["bytes"] >= sum(sizes)
    assert after["retry_exceeded"] == before["retry_exceeded"]
    assert after["access_errors"] == 0


def test_every_receive_consuming_request_finds_a_posted_receive(fabric):
    """Each end sends a SEND or a WRITE WITH IMMEDIATE only on a credit: a
    receive the peer has posted, counted from the peer's credit word, which the
    peer RDMA-writes as it reposts. So in steady state no request meets an empty
    receive queue (an RNR NAK, a stall of the QP); before, bursts of tiny
    messages and placed chunks outran the receiver's reposting."""
    f = fabric()
    send, recv = f.pair()
    before = f.emu.counters()
    stream(send, recv, [1] * 3000, 96, window=64)  # control-heavy: CTS, notices, ACKs
    registered_stream(f.a, f.b, send, recv, plan_sizes(97, 300, 3 * CHUNK), 97, window=16)
    stream(send, recv, plan_sizes(98, 300, 3 * CHUNK, big=2), 98, window=16)
    after = f.emu.counters()
    assert after["sends"] - before["sends"] > 6000
    assert after["rnr_naks"] == before["rnr_naks"]


def completion_events_per_completion(f, send, recv, count, seed):
    """Streams `count` one-byte messages one at a time (each waits for the one
    before: a ping-pong); returns completion-channel events per completion polled."""
    before = f.emu.counters()
    stream(send, recv, [1] * count, seed, window=1)
    after = f.emu.counters()
    return (after["cq_events"] - before["cq_events"]) / (after["completions_polled"] - before["completions_polled"])


def io_thread_cpu_and_wakeups():
    threads = [t for t in procstat.threads().values() if t.name == "reccl-io"]
    return sum(t.cpu_seconds for t in threads), sum(t.voluntary for t in threads)


def test_busy_polling_finds_completions_while_work_is_outstanding(fabric):
    """While a path has work outstanding its loop polls the CQs with the
    completion channel unarmed (RECCL_IB_BUSY_POLL_US past the last completion),
    so completions under load are found by polling, not announced one event each
    (on a real HCA: an interrupt and a wake-up per completion). Off, most
    completions of a ping-pong come by an event (on a loaded box one wake-up
    may find two: 0.49 was seen in CI), polling an order of magnitude fewer."""
    polling = fabric(IB_BUSY_POLL_US=10000)  # a window wide enough for this loaded box
    on = completion_events_per_completion(polling, *polling.pair(), 400, 101)
    events = fabric(IB_BUSY_POLL_US=0)
    off = completion_events_per_completion(events, *events.pair(), 400, 102)
    assert off > 0.3, off
    assert on < 0.1 and on * 5 < off, (on, off)


def test_paths_stop_polling_when_nothing_moves_and_idle_ones_never_poll(fabric):
    """The spin is bounded: a receive posted with nothing coming (NCCL posts
    its receives ahead) keeps the loop polling only RECCL_IB_BUSY_POLL_US past
    the last completion, then the path arms its channel and sleeps. An idle
    connection (nothing posted) never polls. Measured on the I/O threads: CPU
    time (a spinning thread shows there, not in context switches) and wake-ups
    (a beat a second per NIC pair here)."""
    f = fabric(IB_BUSY_POLL_US=10000, HEARTBEAT_MS=4000)
    send, recv = f.pair()
    stream(send, recv, [1] * 200, 103, window=1)
    buf = bytearray(8)
    waiting = recv.irecv(buf)
    for case in ("a receive posted", "idle"):
        time.sleep(0.1)  # past the polling window
        cpu_before, wakeups_before = io_thread_cpu_and_wakeups()
        time.sleep(1.0)
        cpu_after, wakeups_after = io_thread_cpu_and_wakeups()
        assert cpu_after - cpu_before < 0.15, (case, cpu_after - cpu_before)
        assert wakeups_after - wakeups_before < 40, (case, wakeups_after - wakeups_before)
        if case == "a receive posted":
            assert send.isend(b"abcdefgh").wait(10) == 8
            assert waiting.wait(10) == 8 and bytes(buf) == b"abcdefgh"


# ------------------------------------------------------------------ faults


def test_failback_after_a_port_flap_uses_the_new_gid_index(fabric, events):
    """Failover and failback themselves are the contract suite's; over IB a port
    that comes back has its GID table rebuilt in another order, and the new
    primary QP must address the GID where it is now, or nothing would arrive."""
    f = fabric()
    send, recv = f.pair()
    gids_before = f.emu.gid_table(A0)
    f.emu.port_down(A0)
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5), send.paths()
    assert not f.a.nics()[0]["up"]
    f.emu.port_up(A0)  # PORT_ACTIVE; the GID table is rebuilt in another order
    gids_after = f.emu.gid_table(A0)
    assert ipv4_gid_index(gids_after) != ipv4_gid_index(gids_before)
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
    assert events.wait_for(3, "failback", connection=send.id)
    before = f.emu.counters()["retry_exceeded"]
    stream(send, recv, plan_sizes(3, 20, 2 * CHUNK), 3)
    assert send.active_path == 0
    assert f.emu.counters()["retry_exceeded"] == before


def test_inject_fault_drills_work_on_rdma_devices(fabric, events):
    """torch_reccl.inject_fault names an RDMA device like any NIC: "down" fails
    its paths at once, "blackhole" silences them until the heartbeat fails them."""
    f = fabric()
    send, recv = f.pair()
    try:
        torch_reccl.inject_fault(A0, "down")
        assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 2)
        stream(send, recv, plan_sizes(40, 10, CHUNK), 40)
        torch_reccl.inject_fault(A0, "up")
        assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
        torch_reccl.inject_fault(B0, "blackhole")
        stream(send, recv, plan_sizes(41, 10, CHUNK), 41)
        assert wait_until(lambda: send.active_path == 1, 3), send.paths()
        # Silence, seen by whichever end notices first.
        assert wait_until(lambda: any("nothing from" in e.detail
                                      for e in events.of("path_down", connection=recv.id)), 3), \
            [e.detail for e in events.of("path_down", connection=recv.id)]
    finally:
        torch_reccl.inject_fault(A0, "up")
        torch_reccl.inject_fault(B0, "up")
    assert wait_until(lambda: send.active_path == 0, 10), send.paths()


@pytest.mark.parametrize("kind", ["payload", "immediate"])
def test_corrupted_delivery_fails_the_path_not_the_data(fabric, events, kind):
    f = fabric()
    send, recv = f.pair()
    stream(send, recv, plan_sizes(9, 5, CHUNK), 9)  # warm, so the next write is data
    before = f.emu.counters()["corrupted"]
    f.emu.corrupt_next(A0, kind)
    stream(send, recv, plan_sizes(10, 30, 2 * CHUNK), 10)
    assert f.emu.counters()["corrupted"] == before + 1
    downs = events.wait_for(3, "path_down", connection=recv.id)
    assert any("protocol error" in e.detail for e in downs), [e.detail for e in downs]


@pytest.mark.parametrize("device", [A0, B0])
def test_a_failing_poll_cq_fails_the_path_and_the_data_moves_over(fabric, events, device):
    """ibv_poll_cq returning < 0 (here on the sender's or the receiver's NIC of
    rail 0) fails that path with the reason, on the loop thread that polled, and
    the stream goes on over rail 1 bit for bit: no std::terminate."""
    f = fabric()
    send, recv = f.pair()
    stream(send, recv, plan_sizes(60, 5, CHUNK), 60)
    f.emu.fail_next(device, "poll_cq")
    stream(send, recv, plan_sizes(61, 30, 2 * CHUNK), 61)
    end = send if device == A0 else recv
    downs = events.wait_for(3, "path_down", connection=end.id)
    assert any("ibv_poll_cq failed" in e.detail for e in downs), [e.detail for e in downs]
    stream(send, recv, plan_sizes(62, 10, CHUNK), 62)


@pytest.mark.parametrize("device", [A0, B0])
def test_a_completion_queue_overrun_fails_its_paths_which_come_back(fabric, events, device):
    """CQ_ERR: the device's CQs overran, their QPs are in ERR and polling them
    fails. Each path on them fails at its next turn (a heartbeat at the latest),
    the stream goes on over rail 1 bit for bit, and since the NIC itself is fine
    the primary is re-dialed on fresh CQs and the connection fails back."""
    f = fabric()
    send, recv = f.pair()
    stream(send, recv, plan_sizes(65, 5, CHUNK), 65)
    f.emu.overrun_cqs(device)
    stream(send, recv, plan_sizes(66, 30, 2 * CHUNK), 66)
    end = send if device == A0 else recv
    assert wait_until(lambda: any("overran" in e.detail for e in events.of("path_down", end.id)), 5), [
        e.detail for e in events.of("path_down", end.id)]
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
    stream(send, recv, plan_sizes(67, 10, CHUNK), 67)


def fill_and_send(send, recv, src, src_reg, dst, dst_reg, seed, timeout=10):
    """One message of len(src) bytes from registered `src` into registered `dst`
    (bytes-like, or DmaBufArena, whose `device` address the CPU cannot touch),
    checked bit for bit."""
    def buffer(x):
        return (ctypes.c_char * x.size).from_address(x.device) if isinstance(x, DmaBufArena) else x

    def view(x):  # the bytes as the CPU may touch them
        return memoryview(x.host if isinstance(x, DmaBufArena) else x)

    size = len(view(src))
    view(src)[:] = message(seed, 0, size)
    view(dst)[:] = b"\xa5" * size
    request_r = recv.irecv(buffer(dst), registration=dst_reg)
    assert send.isend(buffer(src), registration=src_reg).wait(timeout) == size
    assert request_r.wait(timeout) == size
    assert view(dst).tobytes() == message(seed, 0, size)


def test_a_device_that_refuses_a_registration_leaves_it_on_the_others(fabric):
    """Registration is per NIC: a device with a fatal error (the failure case
    itself) refuses it, and the memory is still registered on the other NICs,
    which carry it by direct placement (no staged chunk); before, the whole
    registration failed."""
    f = fabric()
    send, recv = f.pair()
    f.emu.device_fatal(A1)  # the sender's backup NIC
    assert wait_until(lambda: not f.a.nics()[1]["up"], 5)
    regions = f.emu.memory_regions(A0)[0]
    src, dst = bytearray(3 * CHUNK), bytearray(3 * CHUNK)
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    assert f.emu.memory_regions(A0)[0] == regions + 1
    before = f.emu.counters()
    fill_and_send(send, recv, src, src_reg, dst, dst_reg, 90)
    after = f.emu.counters()
    assert after["writes_with_imm"] == before["writes_with_imm"]  # placed, not staged
    assert after["access_errors"] == before["access_errors"]


def test_a_nic_that_cannot_import_a_dmabuf_fails_its_paths_over(fabric, events):
    """The sender's primary NIC cannot import the dma-buf (no peer-to-peer path to
    that GPU): the memory is registered on its backup NIC only, the primary path
    fails naming why (device memory cannot be staged), and the message goes by
    direct placement over the backup, bit for bit."""
    f = fabric()
    send, recv = f.pair()
    f.emu.refuse_dmabuf(A0)
    src, dst = DmaBufArena(2 * CHUNK, "ib-src"), DmaBufArena(2 * CHUNK, "ib-dst")
    src_reg = f.a.register_dmabuf(src.fd, 0, src.size, src.device)
    dst_reg = f.b.register_dmabuf(dst.fd, 0, dst.size, dst.device)
    fill_and_send(send, recv, src, src_reg, dst, dst_reg, 91)
    assert wait_until(lambda: any("no registration of the send buffer" in e.detail and "EOPNOTSUPP" in e.detail
                                  for e in events.of("path_down", send.id)), 5), [
        e.detail for e in events.of("path_down", send.id)]
    f.emu.refuse_dmabuf(A1)
    f.emu.refuse_dmabuf(B1)
    with pytest.raises(RecclError, match=r"no RDMA device could register the memory: ib-a-0: .*EOPNOTSUPP.*; ib-a-1: "):
        f.a.register_dmabuf(src.fd, 0, src.size, src.device)


@pytest.mark.parametrize("device", [A0, B0])
def test_a_device_back_from_a_fatal_error_is_reopened_registered_again_and_failed_back(fabric, device):
    """DEVICE_FATAL kills the device's context for good. The connection fails over;
    once the device is back the transport opens it again (retrying with backoff),
    registers the live registrations on it again (the old keys are void: a write
    with one is an access error) and reports the NIC up, so the connection fails
    back and its registered buffers are placed directly over the primary again.
    Before, the NIC stayed down for good. The device is found again by its name
    only: gone, it is not listed; back, it is listed after the others (as a
    driver re-probe adds it), so its old position would name another device."""
    f = fabric()
    send, recv = f.pair()
    src, dst = bytearray(2 * CHUNK), bytearray(2 * CHUNK)
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    fill_and_send(send, recv, src, src_reg, dst, dst_reg, 92)
    f.emu.device_fatal(device)
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5), send.paths()
    fill_and_send(send, recv, src, src_reg, dst, dst_reg, 93)
    assert device not in f.emu.devices()
    time.sleep(0.3)  # the transport tries to reopen a device that is still gone
    f.emu.recover_device(device)
    assert f.emu.devices()[-1] == device
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
    before = f.emu.counters()
    fill_and_send(send, recv, src, src_reg, dst, dst_reg, 94)
    after = f.emu.counters()
    assert after["writes_with_imm"] == before["writes_with_imm"]  # placed with the new keys
    assert after["access_errors"] == before["access_errors"]
    assert send.active_path == 0 and recv.active_path == 0


def received_through(nic: str) -> int:
    return torch_reccl.stats()["nics"].get(nic, {}).get("bytes_received", 0)


def test_a_gpu_flush_reads_through_every_nic_that_wrote_part_of_the_receive(fabric):
    """A failover in the middle of a receive into device memory: the receiver's
    primary NIC placed the first chunks (they were on the wire when the sender's
    port went down, and landed before the receiver fenced that path), its
    backup NIC the rest. The GPU flush (NCCL's iflush) must order both NICs'
    writes, so it reads through each; before, only through the active one.
    The held chunks land through B0 only while its path stands: the hold also
    holds A0's heartbeats, so a hold longer than RECCL_HEARTBEAT_MS (300 ms in
    this suite; a slow moment of a loaded box, e.g. behind the threads earlier
    tests leave running) failed B0's path by silence first, its QP took none of
    them and the flush rightly read through B1 alone. The port event, not
    silence, must cause the failover here: the heartbeat is far longer."""
    f = fabric(HEARTBEAT_MS=5000)
    send, recv = f.pair()
    size = 32 * CHUNK
    src, dst = DmaBufArena(size, "ib-src"), DmaBufArena(size, "ib-dst")
    src_reg = f.a.register_dmabuf(src.fd, 0, src.size, src.device)
    dst_reg = f.b.register_dmabuf(dst.fd, 0, dst.size, dst.device)
    memoryview(src.host)[:] = message(95, 0, size)
    dst.host[:] = 0xA5
    f.emu.hold(A0)
    request_r = recv.irecv((ctypes.c_char * size).from_address(dst.device), registration=dst_reg)
    request_s = send.isend((ctypes.c_char * size).from_address(src.device), registration=src_reg)
    assert wait_until(lambda: f.emu.counters()["held"] >= 4, 5)  # placed chunks on the wire
    # The failover's messages wait on the backup's wire too, so the receiver
    # cannot fence B0 before the held chunks land through it.
    f.emu.hold(A1)
    f.emu.port_down(A0)
    landed = f.emu.counters()["wire_delivered"]
    taken = received_through(B0)
    f.emu.hold(A0, False)
    assert f.emu.counters()["wire_delivered"] > landed  # placed through B0
    # ... and taken by the receiver before the failover reaches it: it polls each
    # NIC's completions on its own, and a new epoch first makes B0's chunks stale
    # (their bytes written again through B1, which then rightly flushes alone).
    assert wait_until(lambda: received_through(B0) > taken, 5)
    f.emu.hold(A1, False)
    assert request_s.wait(10) == size and request_r.wait(10) == size
    assert memoryview(dst.host).tobytes() == message(95, 0, size)
    assert f.emu.counters()["wire_delivered"] >= 2 and recv.active_path == 1
    reads = {device: f.emu.reads_on(device) for device in (B0, B1)}
    f.b.flush_device_writes(dst_reg, dst.device, recv)
    assert {device: f.emu.reads_on(device) - reads[device] for device in (B0, B1)} == {B0: 1, B1: 1}
    # Nothing placed since: the next flush reads through one NIC only.
    f.b.flush_device_writes(dst_reg, dst.device, recv)
    assert sum(f.emu.reads_on(device) for device in (B0, B1)) == sum(reads.values()) + 3


def test_listed_devices_are_ordered_by_pci_path_without_inactive_ports():
    """Without RECCL_IB_HCA the transport takes the devices the library lists, as
    NCCL does: ordered by PCI path (rail i must be the same slot on every host,
    whatever order the kernel registered the devices in) and without those whose
    port is not active. Devices named in RECCL_IB_HCA stay, in that order, up or
    down (a backup that is down now may come up)."""
    names = ["ib-pci-0", "ib-pci-1", "ib-pci-2", "ib-pci-3"]
    emu = emulations().IbEmulation(names)
    paths = {"ib-pci-0": "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0",
             "ib-pci-1": "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0",
             "ib-pci-2": "/sys/devices/pci0000:17/0000:17:02.0/0000:19:00.0",
             "ib-pci-3": "/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0"}
    for name, path in paths.items():
        emu.set_pci_path(name, path)
    emu.port_down("ib-pci-2")
    env = ib_env(names)
    del env["RECCL_IB_HCA"]
    listed = _C.IbTransport(emu, env)
    assert [(n["name"], n["pci_path"]) for n in listed.nics()] == [
        (name, paths[name]) for name in ("ib-pci-1", "ib-pci-3", "ib-pci-0")]
    named = _C.IbTransport(emu, ib_env(["ib-pci-2", "ib-pci-0"]))
    assert [(n["name"], n["up"]) for n in named.nics()] == [("ib-pci-2", False), ("ib-pci-0", True)]


def test_a_registration_keeps_its_devices_open_until_it_goes():
    """A registration outliving the transport that made it keeps the transport
    (and its device contexts) alive: its memory regions are deregistered before
    any context closes. Before, the transport closed its contexts under live
    regions, which were then deregistered on freed verbs objects."""
    emu = emulations().IbEmulation([A0, A1])
    transport = _C.IbTransport(emu, ib_env([A0, A1]))
    buffer = bytearray(CHUNK)
    registration = transport.register(buffer)
    del transport
    gc.collect()
    assert emu.counters()["closed_with_regions"] == 0
    del registration
    gc.collect()
    counters = emu.counters()
    assert counters["closed_with_regions"] == 0 and counters["dereg_after_close"] == 0
    assert emu.memory_regions(A0) == (0, 0)


def test_modify_qp_timeouts_are_retried_then_fail_the_dial_clearly(fabric):
    """ibv_modify_qp answering ETIMEDOUT (RoCE neighbour resolution still under
    way) is tried again: three timeouts on rail 0 still give a rail-0 primary.
    Timeouts that never end fail each dial, bounded, with a clear reason, which
    the connection's error names once no path ever came up."""
    f = fabric(RECCL_NO_PATH_TIMEOUT_MS="1500")
    f.emu.fail_next(A0, "modify_qp", 3)
    send, recv = f.pair()
    stream(send, recv, plan_sizes(63, 10, CHUNK), 63)
    assert send.active_path == recv.active_path == 0, send.paths()
    for device in (A0, A1):
        f.emu.fail_next(device, "modify_qp", 1000)
    start = time.monotonic()
    with pytest.raises(RecclError, match="RTR still timed out after 10 attempts 50 ms apart"):
        f.pair()
    assert time.monotonic() - start < 10
    stream(send, recv, plan_sizes(64, 10, CHUNK), 64)  # connected QPs are not affected


def test_control_frames_beyond_the_send_buffers_wait_in_order_without_blocking(fabric, events):
    """sendControl never waits (its caller may hold its connection's lock, and a
    path's event loop serves other paths): while every control send buffer is in
    flight (the receiver's NIC drops everything for a second, so no send
    completes), further frames (48 CTS for 32 buffers) wait in the path's
    backlog and go out in order once completions free buffers. Nothing is lost,
    no path fails, and irecv returns at once."""
    f = fabric(RECCL_HEARTBEAT_MS=5000, RECCL_IB_TIMEOUT=16)  # retry budget ~2.1 s
    send, recv = f.pair()
    stream(send, recv, plan_sizes(90, 5, CHUNK), 90)
    sizes = plan_sizes(91, 48, CHUNK)
    buffers = [bytearray(size) for size in sizes]
    f.emu.drop(B0, True)
    try:
        start = time.monotonic()
        receives = [recv.irecv(buf) for buf in buffers]
        posting = time.monotonic() - start
        time.sleep(1.0)
    finally:
        f.emu.drop(B0, False)
    assert posting < 0.5, posting  # a caller waiting for a buffer would take the whole second
    assert run_sender(send, sizes, 91, window=8) == sum(sizes)
    for i, (request, buf) in enumerate(zip(receives, buffers)):
        assert request.wait(10) == sizes[i]
        assert bytes(buf) == message(91, i, sizes[i]), f"message {i} differs"
    assert events.of("path_down", connection=recv.id) == []
    assert send.active_path == recv.active_path == 0


# ------------------------------------------------------------------ direct placement


def chunk_count(sizes):
    return sum(max(1, -(-s // CHUNK)) for s in sizes)


def test_registered_buffers_are_placed_directly_without_staging(fabric):
    f = fabric()
    send, recv = f.pair()
    sizes = plan_sizes(50, 80, 3 * CHUNK, big=2)
    before = f.emu.counters()
    registered_stream(f.a, f.b, send, recv, sizes, 50)
    after = f.emu.counters()
    # Staged chunks are the WRITE WITH IMMEDIATE deliveries; only the empty
    # message (nothing to register) still goes that way.
    assert after["writes_with_imm"] - before["writes_with_imm"] == sizes.count(0)
    placed = chunk_count([s for s in sizes if s > 0])
    assert after["writes"] - before["writes"] >= placed
    assert after["sends"] - before["sends"] >= placed  # one notice per placed chunk
    assert after["bytes"] - before["bytes"] >= sum(sizes)
    assert after["access_errors"] == before["access_errors"]


@pytest.mark.parametrize("registered", ["sender", "receiver"])
def test_one_registered_end_falls_back_to_staging(fabric, registered):
    f = fabric()
    send, recv = f.pair()
    sizes = plan_sizes(51, 40, 2 * CHUNK)
    before = f.emu.counters()["writes_with_imm"]
    registered_stream(f.a, f.b, send, recv, sizes, 51, register_send=registered == "sender",
                      register_recv=registered == "receiver")
    assert f.emu.counters()["writes_with_imm"] - before == chunk_count(sizes)


def test_registered_transfers_both_ways_on_several_connections(fabric):
    f = fabric()
    forward = [f.pair() for _ in range(2)]
    back_send, back_recv = f.pair(1, reverse=True)
    before = f.emu.counters()["writes_with_imm"]
    joins = [in_thread(registered_stream, f.a, f.b, s, r, plan_sizes(60 + i, 40, 2 * CHUNK), 60 + i)
             for i, (s, r) in enumerate(forward)]
    joins.append(in_thread(registered_stream, f.b, f.a, back_send, back_recv,
                           plan_sizes(63, 40, 2 * CHUNK), 63))
    for join in joins:
        join()
    assert f.emu.counters()["writes_with_imm"] - before == 3  # the three empty messages


@pytest.mark.parametrize("fault", ["sender port", "receiver port", "blackhole"])
def test_registered_stream_survives_failover_bit_exact(fabric, fault):
    f = fabric(RECCL_HEARTBEAT_MS="5000" if fault == "blackhole" else "300")
    send, recv = f.pair()
    act = {"sender port": lambda: f.emu.port_down(A0),
           "receiver port": lambda: f.emu.port_down(B0),
           "blackhole": lambda: f.emu.drop(A0, True)}[fault]
    fired = []

    def on_sent(index):
        if index == 12 and not fired:
            fired.append(1)
            act()

    sizes = plan_sizes(70, 60, 2 * CHUNK, big=1)
    before = f.emu.counters()
    registered_stream(f.a, f.b, send, recv, sizes, 70, on_sent=on_sent)
    assert fired
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5), send.paths()
    after = f.emu.counters()
    # Still no staging after the switch: the backup path wrote with the rkey of
    # the receiver's backup NIC (any other key is an access error there).
    assert after["writes_with_imm"] - before["writes_with_imm"] == sizes.count(0)
    assert after["access_errors"] == before["access_errors"]
    if fault == "blackhole":
        assert after["retry_exceeded"] > before["retry_exceeded"]
    registered_stream(f.a, f.b, send, recv, plan_sizes(71, 10, CHUNK), 71)
    f.emu.drop(A0, False)


def test_a_write_in_flight_on_the_old_path_never_lands_after_completion(fabric):
    """Writes already on the wire when the sender fails over (hold) arrive after
    the receive completed over the backup; the receiver fenced the old QP (ERR)
    before it reported what it had, so they are dropped, not written into a
    buffer the application already reuses."""
    # A 3 s heartbeat and a 34 s retry budget: the receiver cannot notice the
    # dead primary by itself before the wire is released.
    f = fabric(RECCL_HEARTBEAT_MS="3000", RECCL_IB_TIMEOUT="20")
    send, recv = f.pair()
    size = 4 * CHUNK
    src = bytearray(message(80, 0, size))
    dst = bytearray(size)
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    registered_stream(f.a, f.b, send, recv, [CHUNK], 81)  # warm: both paths up
    f.emu.hold(A0)
    request_r = recv.irecv(dst, registration=dst_reg)
    request_s = send.isend(src, registration=src_reg)
    assert wait_until(lambda: f.emu.counters()["held"] >= 4, 5)  # data left on the wire
    f.emu.port_down(A0)  # the sender fails over at once; the receiver's primary QP is up
    assert request_r.wait(10) == size and request_s.wait(10) == size
    assert dst == src
    dst[:] = b"\xee" * size  # the application reuses its buffer
    before = f.emu.counters()
    f.emu.hold(A0, False)  # what was in flight arrives now
    after = f.emu.counters()
    assert after["wire_dropped"] > before["wire_dropped"]
    assert after["wire_delivered"] == before["wire_delivered"]
    assert dst == b"\xee" * size


@pytest.mark.parametrize("fence_delay_ms", [1000, 0])
def test_writes_accepted_before_the_fence_land_before_the_resync(fabric, fence_delay_ms):
    """A QP moved to ERR takes no more packets, but writes its HCA accepted just
    before may still be on their way to memory. The receiver's NIC here accepts
    at once and writes memory 0.7 s later (long enough that, without the fence
    delay, the failover and the receive's completion surely come first, also on
    a loaded box); the sender fails over while some of
    a registered message's writes are accepted but not landed. With the fence
    delay (RECCL_IB_FENCE_DELAY_MS, longer than that) the receiver reports what
    it has only after they landed, so nothing lands after the receive completed
    and the application reused its buffer. Without it (0) they do: the
    application's bytes are overwritten, which is what the delay prevents."""
    f = fabric(RECCL_HEARTBEAT_MS="3000", RECCL_IB_TIMEOUT="20", RECCL_IB_FENCE_DELAY_MS=fence_delay_ms)
    send, recv = f.pair()
    size = 8 * CHUNK
    src = bytearray(message(84, 0, size))
    dst = bytearray(size)
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    registered_stream(f.a, f.b, send, recv, [CHUNK], 85)  # warm: both paths up
    f.emu.set_landing_delay(B0, 0.7)
    writes = f.emu.counters()["writes"]
    request_r = recv.irecv(dst, registration=dst_reg)
    request_s = send.isend(src, registration=src_reg)
    assert wait_until(lambda: f.emu.counters()["writes"] >= writes + 2, 5)  # accepted, not landed
    f.emu.port_down(A0)  # the sender fails over at once; the receiver fences the old QP
    assert request_r.wait(10) == size and request_s.wait(10) == size
    assert recv.active_path == 1
    assert dst == src
    dst[:] = b"\xee" * size  # the application reuses its buffer
    assert wait_until(lambda: f.emu.counters()["landed_late"] >= 2, 5)  # past every landing
    if fence_delay_ms:
        assert dst == b"\xee" * size
    else:
        assert dst != b"\xee" * size  # a stale write of the old path landed in the reused buffer


def test_failback_waits_for_the_old_paths_writes_or_fences_it(fabric):
    """On failback the old path stays healthy, so the receiver does not fence
    it: the sender must see every direct write of it completed first. Writes
    held on the wire never complete, so the sender fails that path and the
    ACTIVATE tells the receiver to fence it; released later, they are dropped."""
    f = fabric(RECCL_HEARTBEAT_MS="3000", RECCL_IB_TIMEOUT="20")
    send, recv = f.pair()
    f.emu.port_down(A0)
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5)
    registered_stream(f.a, f.b, send, recv, [CHUNK], 82)
    size = 4 * CHUNK
    src = bytearray(message(83, 0, size))
    dst = bytearray(size)
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    f.emu.hold(A1)
    request_r = recv.irecv(dst, registration=dst_reg)
    request_s = send.isend(src, registration=src_reg)
    assert wait_until(lambda: f.emu.counters()["held"] >= 4, 5)
    f.emu.port_up(A0)  # failback to the primary while the backup's writes are in flight
    assert request_r.wait(10) == size and request_s.wait(10) == size
    assert send.active_path == 0 and recv.active_path == 0
    assert dst == src
    dst[:] = b"\xee" * size
    before = f.emu.counters()
    f.emu.hold(A1, False)
    after = f.emu.counters()
    assert after["wire_dropped"] > before["wire_dropped"]
    assert after["wire_delivered"] == before["wire_delivered"]
    assert dst == b"\xee" * size


def test_device_memory_with_an_unregistered_peer_fails_clearly_and_is_never_staged(fabric):
    """dma-buf memory (a GPU's, here a memfd under an address the CPU cannot
    touch) travels only by direct placement: with the other end unregistered
    both requests fail saying why, and the connection goes on."""
    f = fabric()
    send, recv = f.pair()
    for device_end in ("sender", "receiver"):
        transport = f.a if device_end == "sender" else f.b
        arena = DmaBufArena(CHUNK, "ib-device")
        registration = transport.register_dmabuf(arena.fd, 0, arena.size, arena.device)
        device_buffer = (ctypes.c_char * arena.size).from_address(arena.device)
        host = bytearray(CHUNK)
        if device_end == "sender":
            request_r = recv.irecv(host)
            request_s = send.isend(device_buffer, registration=registration)
        else:
            request_r = recv.irecv(device_buffer, registration=registration)
            request_s = send.isend(host)
        with pytest.raises(RecclError, match="cannot be carried: the (send|receive) buffer is device memory"):
            request_s.wait(5)
        with pytest.raises(RecclError, match="cannot be carried: device memory"):
            request_r.wait(5)
    registered_stream(f.a, f.b, send, recv, plan_sizes(84, 10, CHUNK), 84)
    assert not send.error and not recv.error


def test_registration_must_cover_the_buffer_and_tcp_registers_nothing(fabric):
    f = fabric()
    send, recv = f.pair()
    arena = bytearray(4 * CHUNK)
    reg = f.a.register(arena)
    assert reg.nbytes == len(arena)
    other = bytearray(CHUNK)
    with pytest.raises(RecclError, match="outside its registration"):
        send.isend(other, registration=reg)
    with pytest.raises(RecclError, match="outside its registration"):
        recv.irecv(other, registration=f.b.register(arena))
    # Keys belong to one transport's protection domains: another's are refused.
    stranger = _C.IbTransport(f.emu, ib_env([A0, A1]))
    with pytest.raises(RecclError, match="made by another transport"):
        send.isend(arena, registration=stranger.register(arena))
    off = _C.IbTransport(f.emu, ib_env([A0, A1], IB_ZERO_COPY="off"))
    assert off.register(arena) is None
    assert off.supports_dmabuf()[0] is False and "RECCL_IB_ZERO_COPY=off" in off.supports_dmabuf()[1]
    with pytest.raises(ConfigError, match="RECCL_IB_ZERO_COPY=maybe is not valid: expected on or off"):
        _C.validate_config({"RECCL_IB_ZERO_COPY": "maybe"})


# ------------------------------------------------------------------ input checks


def qp_exchange(**fields):
    values = dict(magic=0x51434552, version=6, role=1, mtu=3, qpn=0x101, psn=7, lid=0, link_layer=1,
                  gid=b"\x00" * 10 + b"\xff\xff\x0a\x00\x00\x01", addr=0x7f0000001000, rkey=5,
                  slots=4, slot_bytes=CHUNK + 64)
    values.update(fields)
    body = struct.pack("<IHBBIIHBB16sQIII", values["magic"], values["version"], values["role"],
                       values["mtu"], values["qpn"], values["psn"], values["lid"], values["link_layer"], 0,
                       values["gid"], values["addr"], values["rkey"], values["slots"],
                       values["slot_bytes"])
    return body.ljust(_C.IB_QP_EXCHANGE_BYTES, b"\x00")


def test_qp_exchange_is_validated_field_by_field():
    good = _testing.ib_decode_qp_exchange(qp_exchange(), "receiver")
    assert good == {"qp_number": 0x101, "slot_count": 4, "slot_bytes": CHUNK + 64, "mtu": 3}
    bad = {
        "magic": qp_exchange(magic=0),
        "version": qp_exchange(version=9),
        "expected the receiver": qp_exchange(role=0),
        "MTU": qp_exchange(mtu=6),
        "QP number": qp_exchange(qpn=1 << 24),
        "null region": qp_exchange(addr=0),
        "slot count": qp_exchange(slots=65),
        "staging slots": qp_exchange(slot_bytes=100),
        r"link layer 0; 1 \(Ethernet\) or 2 \(InfiniBand\)": qp_exchange(link_layer=0),
        "bytes; expected": qp_exchange()[:40],
    }
    for needle, data in bad.items():
        with pytest.raises(ProtocolError, match=needle):
            _testing.ib_decode_qp_exchange(data, "receiver")
    with pytest.raises(ProtocolError, match="FIFO entries"):
        _testing.ib_decode_qp_exchange(qp_exchange(role=0, slot_bytes=16), "sender")


def test_garbage_on_the_bootstrap_port_is_refused_and_counted(fabric):
    f = fabric(RECCL_NO_PATH_TIMEOUT_MS="1000", RECCL_CONNECT_TIMEOUT_MS="500")
    listener = f.b.listen(0)
    address, port = _testing.decode_handle(listener.handle)["nics"][0]
    rejected = torch_reccl.stats()["rejected_handshakes"]
    with socket.create_connection((address, port), timeout=5) as sock:
        sock.sendall(os.urandom(200))
        sock.settimeout(5)
        try:
            assert sock.recv(100) == b""  # closed on us
        except ConnectionResetError:
            pass
    assert wait_until(lambda: torch_reccl.stats()["rejected_handshakes"] > rejected, 3)
    # A wrong secret is refused before any QP exists.
    handle = bytearray(listener.handle)
    handle[20] ^= 1
    send = f.a.connect(0, bytes(handle))
    with pytest.raises(RecclError, match="RECCL_NO_PATH_TIMEOUT_MS"):
        send.wait_ready(5)
    assert "refused" in send.error
    send.close()
    listener.close()


def test_gid_choice_takes_only_roce_v2_ipv4_or_the_addr_range():
    """RoCE: a RoCE v2 GID that is not link-local and holds an IPv4 address (or,
    with RECCL_IB_ADDR_RANGE, an address in that range); never RoCE v1, never
    link-local, never a GID whose type is unknown (it may be v1)."""
    link_local = b"\xfe\x80" + b"\x00" * 13 + b"\x01"
    mapped = b"\x00" * 10 + b"\xff\xff\x0a\x00\x00\x01"
    other = b"\x00" * 10 + b"\xff\xff\xc0\xa8\x05\x07"  # 192.168.5.7
    global6 = bytes.fromhex("fd000000000000000000000000000001")
    zero = b"\x00" * 16
    assert _testing.ib_select_gid([(link_local, "RoCEv1"), (link_local, "RoCEv2"), (mapped, "RoCEv1"),
                             (mapped, "RoCEv2")]) == 3
    # Link-local RoCE v2, IPv6 and v1 GIDs are not chosen by default: none usable.
    assert _testing.ib_select_gid([(zero, "RoCEv2"), (link_local, "RoCEv1"), (link_local, "RoCEv2"),
                             (global6, "RoCEv2"), (mapped, "RoCEv1")]) == -1
    # Unknown types (sysfs hidden, no ibv_query_gid_ex) are never ranked usable.
    assert _testing.ib_select_gid([(link_local, "unknown"), (mapped, "unknown")]) == -1
    assert _testing.ib_select_gid([(zero, "RoCEv2")]) == -1
    # The lowest index wins among usable ones; the range picks among them.
    table = [(link_local, "RoCEv2"), (other, "RoCEv2"), (global6, "RoCEv2"), (mapped, "RoCEv2")]
    assert _testing.ib_select_gid(table) == 1
    assert _testing.ib_select_gid(table, addr_range="10.0.0.0/8") == 3
    assert _testing.ib_select_gid(table, addr_range="10.0.0.1/32") == 3
    assert _testing.ib_select_gid(table, addr_range="192.168.4.0/23") == 1
    assert _testing.ib_select_gid(table, addr_range="10.1.0.0/16") == -1
    assert _testing.ib_select_gid(table, addr_range="fd00::/8") == 2
    assert _testing.ib_select_gid(table, addr_range="fe80::/10") == -1  # link-local never
    assert _testing.ib_select_gid(table, addr_range="0.0.0.0/0") == 1
    # IB link layer: every GID is an IB GID; the first non-zero one.
    assert _testing.ib_select_gid([(zero, "IB"), (link_local, "IB")], ethernet=False) == 1
    assert _testing.ib_select_gid([(link_local, "unknown")], ethernet=False) == 0
    with pytest.raises(ConfigError, match="16 bytes"):
        _testing.ib_select_gid([(b"\x01", "RoCEv2")])


def ipv4_gid(a, b, c, d):
    return b"\x00" * 10 + b"\xff\xff" + bytes([a, b, c, d])


@pytest.mark.parametrize("sources", [dict(table=True, query_ex=False, sysfs=False),
                                     dict(table=False, query_ex=True, sysfs=False),
                                     dict(table=False, query_ex=False, sysfs=True)])
def test_gid_types_come_from_the_verbs_calls_when_sysfs_is_hidden(sources):
    """In a container sysfs may not show gid_attrs/types; the types then come
    from ibv_query_gid_table (one call per dial) or ibv_query_gid_ex. Each way
    the QPs use the RoCE v2 IPv4 GID (the emulated fabric is routed: a RoCE v1
    or link-local GID, which the old sysfs-only reading fell back to, carries
    nothing). Each end of each path reads the table once per dial: one
    ibv_query_gid_table, or one ibv_query_gid(_ex) per entry without it."""
    f = Fabric("ib")
    try:
        for device in (A0, A1, B0, B1):
            f.emu.set_gid_sources(device, **sources)
        before = f.emu.counters()
        send, recv = f.pair()
        assert wait_until(lambda: all(len(c.paths()) == 2 and all(" up" in p for p in c.paths())
                                      for c in (send, recv)), 5), send.paths()
        after = f.emu.counters()
        queries = (after["gid_table_queries"] - before["gid_table_queries"],
                   after["gid_queries"] - before["gid_queries"])
        ends = 4  # primary and backup, each dialed once, two ends each
        entries = len(f.emu.gid_table(A0))
        assert queries == ((ends, 0) if sources["table"] else (0, ends * entries)), (queries, entries)
        stream(send, recv, plan_sizes(5, 10, CHUNK), 5)
        for device in (A0, B0):
            assert set(f.emu.qp_gid_indexes(device)) == {ipv4_gid_index(f.emu.gid_table(device))}
    finally:
        f.close()


def test_no_typed_gid_fails_the_dial_naming_the_table_and_the_fix(fabric):
    """Neither the verbs calls nor sysfs give types: no GID is usable (an
    unknown type may be RoCE v1), and the dial says so, naming the table and
    RECCL_IB_GID_INDEX; forcing the IPv4 RoCE v2 index then works."""
    f = fabric(RECCL_NO_PATH_TIMEOUT_MS="1000")
    for device in (A0, A1, B0, B1):
        f.emu.set_gid_sources(device, table=False, query_ex=False, sysfs=False)
    with pytest.raises(RecclError, match="no usable GID.*unknown-type.*RECCL_IB_GID_INDEX"):
        f.pair()
    index = ipv4_gid_index(f.emu.gid_table(A0))
    assert all(ipv4_gid_index(f.emu.gid_table(d)) == index for d in (A1, B0, B1))
    g = fabric(RECCL_IB_GID_INDEX=index)
    for device in (A0, A1, B0, B1):
        g.emu.set_gid_sources(device, table=False, query_ex=False, sysfs=False)
    send, recv = g.pair()
    stream(send, recv, plan_sizes(6, 5, CHUNK), 6)
    assert set(g.emu.qp_gid_indexes(A0)) == {index}


def test_a_forced_gid_index_that_holds_nothing_fails_clearly(fabric):
    f = fabric(RECCL_IB_GID_INDEX=15, RECCL_NO_PATH_TIMEOUT_MS="1000")
    with pytest.raises(RecclError, match=r"RECCL_IB_GID_INDEX=15: .* has no GID at that index; its GIDs: 0 fe80::"):
        f.pair()


def test_addr_range_picks_the_gid_and_survives_a_flap(fabric):
    """Each device gets a second IPv4 address (192.168.x.1) and an IPv6 one
    below its 10.0.x.1 GID: by default the lowest-indexed IPv4 GID is used,
    RECCL_IB_ADDR_RANGE=10.0.0.0/16 picks 10.0.x.1, fd00::/16 the IPv6 one. After
    a flap moves the addresses, the re-dialed QP finds the range's GID again."""
    def extra(f):
        for i, device in enumerate((A0, A1, B0, B1)):
            f.emu.add_gid(device, ipv4_gid(192, 168, i, 1))
            f.emu.add_gid(device, bytes.fromhex("fd0000000000000000000000000000") + bytes([i + 1]))

    def gid_of(f, device):
        return {f.emu.gid_table(device)[i][0] for i in f.emu.qp_gid_indexes(device)}

    def connected(seed, **settings):
        """A fabric with the extra GIDs and a connection that carried a stream."""
        f = fabric(**settings)
        extra(f)
        send, recv = f.pair()
        stream(send, recv, plan_sizes(seed, 5, CHUNK), seed)
        return f, send, recv

    f, _, _ = connected(7)
    assert gid_of(f, A0) == {ipv4_gid(192, 168, 0, 1)}

    g, send, recv = connected(8, RECCL_IB_ADDR_RANGE="10.0.0.0/16")
    assert gid_of(g, A0) == {ipv4_gid(10, 0, 0, 1)} and gid_of(g, B0) == {ipv4_gid(10, 0, 2, 1)}
    g.emu.port_down(A0)
    assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5), send.paths()
    g.emu.port_up(A0)
    assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
    stream(send, recv, plan_sizes(9, 5, CHUNK), 9)
    assert gid_of(g, A0) == {ipv4_gid(10, 0, 0, 1)}

    h, _, _ = connected(10, RECCL_IB_ADDR_RANGE="fd00::/16")
    assert gid_of(h, A0) == {bytes.fromhex("fd0000000000000000000000000000") + b"\x01"}

    k = fabric(RECCL_IB_ADDR_RANGE="172.16.0.0/12", RECCL_NO_PATH_TIMEOUT_MS="1000")
    with pytest.raises(RecclError, match=r"none is RoCE v2 .*RECCL_IB_ADDR_RANGE=172.16.0.0/12"):
        k.pair()


def test_registered_buffers_use_relaxed_ordering_where_the_library_can_ask(fabric):
    """Buffers registered with the transport (NCCL's regMr) ask for
    IBV_ACCESS_RELAXED_ORDERING on every device whose library has
    ibv_reg_mr_iova2, as NCCL does; a device without it (where asking would fail
    with EINVAL) registers without it and still carries the data; the transport's
    own rings never use it; RECCL_IB_RELAXED_ORDERING=off never asks."""
    f = fabric()
    f.emu.set_relaxed_ordering(A1, False)
    send, recv = f.pair()
    before = {d: f.emu.memory_regions(d) for d in (A0, A1, B0, B1)}
    assert all(relaxed == 0 for _, relaxed in before.values())  # rings and FIFOs: never
    src = bytearray(message(86, 0, 3 * CHUNK))
    dst = bytearray(len(src))
    src_reg, dst_reg = f.a.register(src), f.b.register(dst)
    after = {d: f.emu.memory_regions(d) for d in (A0, A1, B0, B1)}
    assert after[A0] == (before[A0][0] + 1, 1)
    assert after[A1] == (before[A1][0] + 1, 0)  # fell back: no ibv_reg_mr_iova2
    assert after[B0] == (before[B0][0] + 1, 1) and after[B1] == (before[B1][0] + 1, 1)
    request_r = recv.irecv(dst, registration=dst_reg)
    assert send.isend(src, registration=src_reg).wait(10) == len(src)
    assert request_r.wait(10) == len(src) and dst == src
    f.emu.port_down(A0)  # over the device without relaxed ordering too
    assert wait_until(lambda: send.active_path == 1, 5)
    dst[:] = bytes(len(dst))
    request_r = recv.irecv(dst, registration=dst_reg)
    assert send.isend(src, registration=src_reg).wait(10) == len(src)
    assert request_r.wait(10) == len(src) and dst == src
    g = fabric(RECCL_IB_RELAXED_ORDERING="off")
    g.a.register(bytearray(4096))
    assert g.emu.memory_regions(A0)[1] == 0


def test_infiniband_routes_by_lid_in_a_subnet_and_by_gid_across_subnets():
    """On an InfiniBand port a QP addresses the peer's LID and sends a GRH only
    when the peer's subnet prefix differs (a router between); the emulated
    switches forward by DLID within a subnet and need the GRH across. Failover
    and failback work the same (an IB port's GID does not move on a flap)."""
    same = 0xfe80000000000000
    f = Fabric("ib", infiniband=[same] * 4)
    try:
        send, recv = f.pair()
        stream(send, recv, plan_sizes(11, 10, CHUNK), 11)
        for device in (A0, A1, B0, B1):
            assert f.emu.qp_global(device) and not any(f.emu.qp_global(device)), device  # LID routed
        f.emu.port_down(A0)
        assert wait_until(lambda: send.active_path == 1 and recv.active_path == 1, 5), send.paths()
        f.emu.port_up(A0)
        assert wait_until(lambda: send.active_path == 0 and recv.active_path == 0, 10), send.paths()
        stream(send, recv, plan_sizes(12, 10, CHUNK), 12)
    finally:
        f.close()
    g = Fabric("ib", infiniband=[same, same, 0xfe80000000000001, 0xfe80000000000001])
    try:
        send, recv = g.pair()
        stream(send, recv, plan_sizes(13, 10, CHUNK), 13)
        assert g.emu.qp_global(A0) and all(g.emu.qp_global(A0))  # across subnets: a GRH
    finally:
        g.close()


def test_link_layers_of_both_ends_must_match():
    """An InfiniBand port and a RoCE port cannot reach each other: the dial says
    so, naming both, instead of timing out."""
    ib = 0xfe80000000000000
    f = Fabric("ib", infiniband=[ib, ib], RECCL_NO_PATH_TIMEOUT_MS=1000)  # host a IB, host b RoCE
    try:
        with pytest.raises(RecclError, match=r"link layers differ: ib-\w-0 is (InfiniBand|Ethernet \(RoCE\)), "
                                             r"the peer's device is (Ethernet \(RoCE\)|InfiniBand)"):
            f.pair()
    finally:
        f.close()


def test_ib_settings_are_validated():
    for name, value, needle in [("RECCL_IB_TIMEOUT", "0", "1..31"), ("RECCL_IB_TIMEOUT", "32", "1..31"),
                                ("RECCL_IB_RETRY_CNT", "8", "0..7"), ("RECCL_IB_HCA", "a,,b", "comma"),
                                ("RECCL_IB_TC", "256", "0..255"), ("RECCL_IB_SL", "16", "0..15"),
                                ("RECCL_IB_GID_INDEX", "-2", "-1..255"), ("RECCL_IB_GID_INDEX", "256", "-1..255"),
                                ("RECCL_IB_ADDR_RANGE", "10.0.0.0", "no /prefix length"),
                                ("RECCL_IB_ADDR_RANGE", "10.0.0.0/33", "prefix length must be 0..32"),
                                ("RECCL_IB_ADDR_RANGE", "fd00::/129", "prefix length must be 0..128"),
                                ("RECCL_IB_ADDR_RANGE", "10.0.0/8", "'10.0.0' is not an IPv4 address"),
                                ("RECCL_IB_ADDR_RANGE", "fd00::g/8", "not an IPv6 address"),
                                ("RECCL_IB_ADDR_RANGE", "10.0.0.0/x", "prefix length"),
                                ("RECCL_IB_RELAXED_ORDERING", "on", "auto or off"),
                                ("RECCL_IB_FENCE_DELAY_MS", "1001", "0..1000")]:
        with pytest.raises(ConfigError, match=f"{name}=.*CIDR" if name == "RECCL_IB_ADDR_RANGE" else needle):
            _C.validate_config({name: value})
        with pytest.raises(ConfigError, match=needle):
            _C.validate_config({name: value})
    _C.validate_config({"RECCL_IB_ADDR_RANGE": "fd00::/8", "RECCL_IB_GID_INDEX": "3"})
    emu = emulations().IbEmulation([A0, A1])
    with pytest.raises(ConfigError, match="no emulated RDMA device 'mlx5_9'"):
        _C.IbTransport(emu, ib_env(["mlx5_9"]))
    with pytest.raises(ConfigError, match="corruption kind"):
        emu.corrupt_next(A0, "everything")
    with pytest.raises(ConfigError, match="expected poll_cq or modify_qp"):
        emu.fail_next(A0, "post_send")


def test_real_verbs_backend_is_compiled_and_loads_at_run_time():
    """The dlopen backend: compiled when the libibverbs headers are installed (CI
    installs libibverbs-dev), and on a host without RDMA devices it explains itself
    instead of failing to load the library."""
    if os.path.exists("/usr/include/infiniband/verbs.h"):
        assert _C.ib_verbs_headers_compiled()
    loaded = _C.ib_load_system_verbs()
    if not _C.ib_verbs_headers_compiled():
        assert not loaded["loaded"] and "libibverbs-dev" in loaded["error"]
    elif not loaded["loaded"]:
        assert "libibverbs.so.1" in loaded["error"]
    if not loaded["devices"]:
        with pytest.raises(ConfigError, match="no RDMA devices|libibverbs"):
            _C.IbTransport(None, {"RECCL_HEARTBEAT_MS": "300"})


# ------------------------------------------------------------------ transport choice


def test_traffic_class_and_service_level_reach_every_qp(fabric):
    """RECCL_IB_TC / RECCL_IB_SL go into every QP's address vector at INIT->RTR,
    at both ends and on both rails (a lossless RoCE class must carry all of it);
    the defaults are NCCL's, 0 and 0."""
    f = fabric(RECCL_IB_TC="106", RECCL_IB_SL="3")
    send, recv = f.pair()
    stream(send, recv, plan_sizes(65, 10, CHUNK), 65)
    for device in (A0, A1, B0, B1):
        routes = f.emu.qp_routes(device)
        assert routes and set(routes) == {(106, 3)}, (device, routes)
    g = fabric()
    send, recv = g.pair()
    stream(send, recv, plan_sizes(66, 5, CHUNK), 66)
    assert set(g.emu.qp_routes(A0)) == set(g.emu.qp_routes(B0)) == {(0, 0)}


def test_a_lossless_fabric_carries_only_the_class_set_in_reccl_ib_tc():
    """A lossless (PFC) RoCE fabric protects one traffic class; RDMA in class 0
    is dropped under congestion (the emulation drops it always). With
    RECCL_IB_TC set to the fabric's class the stream flows; with NCCL's default
    0 no path can be set up (the dial's probe write retries out) and the
    connection fails instead of carrying data."""
    good = Fabric("ib", RECCL_IB_TC="106")
    bad = Fabric("ib", RECCL_NO_PATH_TIMEOUT_MS=1500)
    try:
        for f in (good, bad):
            for device in (A0, A1, B0, B1):
                f.emu.set_lossless_class(device, 106)
        send, recv = good.pair()
        stream(send, recv, plan_sizes(67, 10, CHUNK), 67)
        with pytest.raises(RecclError, match="could not connect.*probe write: transport retry counter exceeded"):
            bad.pair()
    finally:
        good.close()
        bad.close()


def test_fork_init_is_called_unless_fork_protection_is_on_already():
    """ibv_fork_init (DataLoader workers fork after registration) is called by
    the system loader exactly when ibv_is_fork_initialized does not say it is on
    or unneeded and neither RDMAV_FORK_SAFE nor IBV_FORK_SAFE is set (libibverbs
    then turns it on itself; any value counts, as in libibverbs)."""
    needs = emulations().ib_needs_fork_init
    assert needs("disabled") and needs("unknown")
    assert not needs("enabled") and not needs("unneeded")
    assert not needs("disabled", rdmav_fork_safe="1")
    assert not needs("unknown", ibv_fork_safe="")
    with pytest.raises(ConfigError, match="expected unknown, disabled, enabled or unneeded"):
        needs("on")


@pytest.fixture(scope="module")
def fake_libibverbs(tmp_path_factory):
    """tests/helpers/c/fake_libibverbs.c built as libibverbs.so.1 in a directory of its own."""
    directory = tmp_path_factory.mktemp("fake_verbs")
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    os.path.join(HELPERS, "c", "fake_libibverbs.c"),
                    "-Wl,-soname,libibverbs.so.1", "-o", str(directory / "libibverbs.so.1")],
                   check=True, timeout=120)
    return directory


@pytest.mark.parametrize("status, fork_safe, called", [
    (0, None, True),    # disabled: call it
    (1, None, False),   # enabled already
    (2, None, False),   # unneeded (the kernel copes with fork)
    (0, "1", False),    # RDMAV_FORK_SAFE: libibverbs turns it on itself
])
@pytest.mark.needs_verbs_headers
def test_the_system_loader_calls_fork_init_before_anything_else(fake_libibverbs, tmp_path, status,
                                                                fork_safe, called):
    """The call itself, not only the decision: the loader dlopens a
    libibverbs.so.1 (a stand-in that records ibv_fork_init and answers
    ibv_is_fork_initialized as told) and calls ibv_fork_init exactly when the
    library says fork protection is off and RDMAV_FORK_SAFE is unset."""
    log = tmp_path / "calls"
    env = {key: value for key, value in os.environ.items() if key not in ("RDMAV_FORK_SAFE", "IBV_FORK_SAFE")}
    env.update(LD_LIBRARY_PATH=f"{fake_libibverbs}:{env.get('LD_LIBRARY_PATH', '')}",
               FAKE_IBV_LOG=str(log), FAKE_IBV_FORK_STATUS=str(status))
    if fork_safe is not None:
        env["RDMAV_FORK_SAFE"] = fork_safe
    code = ("from torch_reccl.transport import _C\n"
            "loaded = _C.ib_load_system_verbs()\n"
            "assert loaded['loaded'] and loaded['devices'] == [], loaded\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # The stand-in was the library loaded (it logs its device listing), and
    # fork protection came before any other call.
    calls = log.read_text().split()
    assert calls == (["fork_init"] if called else []) + ["get_device_list"], calls


def test_transport_choice_follows_reccl_transport():
    emu = emulations().IbEmulation([A0, A1])
    assert _C.choose_transport({"RECCL_TRANSPORT": "tcp"}, emu)["kind"] == "tcp"
    for setting in ("auto", "ib"):
        choice = _C.choose_transport({"RECCL_TRANSPORT": setting}, emu)
        assert choice["kind"] == "ib", choice
        assert f"lists {A0},{A1}" in choice["reason"] and "emulation" in choice["reason"]
    assert _C.choose_transport({}, emu)["kind"] == "tcp"  # tcp is the default until a hardware run
    with pytest.raises(ConfigError, match="expected auto, tcp or ib"):
        _C.choose_transport({"RECCL_TRANSPORT": "rdma"}, emu)


def test_transport_choice_on_a_host_without_rdma_devices():
    """Over the system library: auto falls back to TCP, ib says what is missing."""
    if _C.ib_load_system_verbs()["devices"]:
        pytest.skip("this host has RDMA devices")
    choice = _C.choose_transport({"RECCL_TRANSPORT": "auto"})
    assert choice["kind"] == "tcp"
    assert "no RDMA devices" in choice["reason"] or "no verbs library" in choice["reason"], choice
    with pytest.raises(ConfigError) as info:
        _C.choose_transport({"RECCL_TRANSPORT": "ib"})
    message = str(info.value)
    assert message.startswith("RECCL_TRANSPORT=ib, but"), message
    assert "lists no RDMA devices" in message or "verbs library is unusable" in message, message


def test_bootstrap_address_setting():
    assert _C.ib_bootstrap_address({"RECCL_IB_BOOTSTRAP": "127.0.0.1"}) == "127.0.0.1"
    assert _C.ib_bootstrap_address({"RECCL_IB_BOOTSTRAP": "lo"}) == "127.0.0.1"
    # Default: the first NIC RECCL_NICS selects.
    assert _C.ib_bootstrap_address({"RECCL_NICS": "127.0.0.2,127.0.0.1"}) == "127.0.0.2"
    with pytest.raises(ConfigError) as info:
        _C.ib_bootstrap_address({"RECCL_IB_BOOTSTRAP": "nosuchnic9"})
    assert "RECCL_IB_BOOTSTRAP" in str(info.value) and "lo(127.0.0.1)" in str(info.value)
    for bad in ("", "lo,eth0"):
        with pytest.raises(ConfigError, match="one interface name or local IPv4 address"):
            _C.validate_config({"RECCL_IB_BOOTSTRAP": bad})


def test_port_speed_from_active_speed_and_width():
    four_x = 2  # IB_WIDTH_4X
    assert _testing.ib_port_speed_mbps(32, four_x) == 100000   # EDR
    assert _testing.ib_port_speed_mbps(64, four_x) == 200000   # HDR
    assert _testing.ib_port_speed_mbps(128, four_x) == 400000  # NDR
    assert _testing.ib_port_speed_mbps(1, 1) == 2500           # SDR 1x
    assert _testing.ib_port_speed_mbps(16, 8) == 168000        # FDR 12x
    assert _testing.ib_port_speed_mbps(64, 16) == 100000       # HDR 2x
    assert _testing.ib_port_speed_mbps(3, four_x) == 0         # not one IB_SPEED_* bit
    assert _testing.ib_port_speed_mbps(32, 3) == 0


def test_transport_reports_port_speed_and_no_pci_path_for_emulated_devices(fabric):
    nics = fabric().a.nics()
    assert [n["speed_mbps"] for n in nics] == [100000, 100000]
    assert [n["pci_path"] for n in nics] == ["", ""]

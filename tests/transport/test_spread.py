"""Spreading (RECCL_SPREAD=on) on four loopback NICs, in one process.

While a connection's primary path is down it stripes its chunks over one path per
surviving NIC (the backup and the last-resort rails) instead of the backup alone;
a lane lost mid-stream is replayed on the others; failback returns to the single
primary path. Every byte is checked. Faults are injected with inject_fault (both
ends share the process's NIC table); test_spread_fabric.py does the same with
real link faults between emulated hosts and checks the shares per NIC.
"""
from __future__ import annotations

import threading
import time

import pytest

import torch_reccl
from torch_reccl.transport import ConfigError, Transport

from conftest import close_both, plan_sizes, reccl_env, registered_stream, socket_count, stream, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("healed_nics")]

NICS = [f"lo:127.0.0.{i}" for i in range(1, 5)]
CHUNK = 64 << 10


def spread_env(spread="on", **overrides):
    return reccl_env(RECCL_NICS=",".join(n.split(":")[1] for n in NICS), RECCL_SPREAD=spread,
                     RECCL_CHUNK_BYTES=CHUNK, **overrides)


def lanes_of(connection_id):
    """The NICs `connection_id` spreads over now (empty when it does not)."""
    for entry in torch_reccl.stats()["spreading"]:
        if entry["connection"] == connection_id:
            return sorted(entry["nics"])
    return []


def bytes_sent():
    return {name: s["bytes_sent"] for name, s in torch_reccl.stats()["nics"].items() if name in NICS}


def sent_since(before):
    now = bytes_sent()
    return {name: now[name] - before.get(name, 0) for name in NICS}


def test_setting_is_checked():
    with pytest.raises(ConfigError, match="RECCL_SPREAD=sometimes.*on or off"):
        Transport(spread_env("sometimes"))


def test_spreads_over_every_surviving_nic_then_fails_back(pair_factory, events):
    _t, _l, send, recv = pair_factory(spread_env())
    assert lanes_of(send.id) == []  # healthy: the primary alone
    torch_reccl.inject_fault(NICS[0], "down")
    assert wait_until(lambda: lanes_of(send.id) == NICS[1:], 5), (lanes_of(send.id), send.paths())
    before = bytes_sent()
    sizes = plan_sizes(61, 120, 1 << 20, big=3)
    stream(send, recv, sizes, 61)
    moved = sent_since(before)
    total = sum(sizes)
    assert moved[NICS[0]] == 0, moved
    for nic in NICS[1:]:
        # Loopback lanes are equally fast: each carries a real part of the stream.
        assert moved[nic] > 0.15 * total, moved
    assert sum(moved.values()) == total, (moved, total)

    torch_reccl.inject_fault(NICS[0], "up")
    assert events.wait_for(10, "failback", connection=send.id)
    assert wait_until(lambda: send.active_path == 0 and lanes_of(send.id) == [], 5), send.paths()
    before = bytes_sent()
    sizes = plan_sizes(62, 60, 1 << 20)
    stream(send, recv, sizes, 62)
    moved = sent_since(before)
    assert moved[NICS[0]] == sum(sizes), moved  # single path again


def test_lanes_write_on_one_data_socket_each(pair_factory):
    """A lane stays on its first data socket (core/path.h, limitDataStreams):
    bulk data spread over three lanes opens no socket, where each lane path
    would grow to 1 + RECCL_NSOCKS sockets at both ends; after failback the
    primary grows again."""
    _t, _l, send, recv = pair_factory(spread_env(RECCL_NSOCKS="4"))
    torch_reccl.inject_fault(NICS[0], "down")
    assert wait_until(lambda: lanes_of(send.id) == NICS[1:], 5), (lanes_of(send.id), send.paths())
    stream(send, recv, plan_sizes(67, 10, 1 << 16), 67)  # every lane up and carrying
    with socket_count() as sockets:
        stream(send, recv, [16 << 20] * 4, 68)  # 1024 chunks: they queue behind every lane
        time.sleep(0.3)  # a socket dialed for a lane would have joined by now
        assert sockets() == 0, sockets()
        torch_reccl.inject_fault(NICS[0], "up")
        assert wait_until(lambda: send.active_path == 0 and lanes_of(send.id) == [], 10), send.paths()
        stream(send, recv, [16 << 20] * 4, 69)
        # The primary's three late data sockets join, at both ends (it was redialed
        # on its first data socket after the fault).
        assert wait_until(lambda: sockets() >= 2 * 3, 5), sockets()


def test_a_lane_lost_mid_stream_is_replayed_on_the_others(pair_factory, events):
    _t, _l, send, recv = pair_factory(spread_env())
    torch_reccl.inject_fault(NICS[0], "down")
    assert wait_until(lambda: lanes_of(send.id) == NICS[1:], 5), send.paths()
    sizes = plan_sizes(63, 300, 1 << 20, big=4)
    lost = threading.Event()

    def on_sent(index):
        if index == 60 and not lost.is_set():
            lost.set()
            torch_reccl.inject_fault(NICS[2], "down")  # a rail lane, not the active backup

    stream(send, recv, sizes, 63, on_sent=on_sent)
    assert lost.is_set()
    assert lanes_of(send.id) == [NICS[1], NICS[3]], send.paths()
    # The lane's chunks were replayed by a new epoch, named as a failover off it.
    assert events.wait_for(5, "failover", connection=send.id, count=2)
    # It comes back as a lane, without a new epoch.
    torch_reccl.inject_fault(NICS[2], "up")
    assert wait_until(lambda: lanes_of(send.id) == NICS[1:], 10), send.paths()
    stream(send, recv, plan_sizes(64, 60, 1 << 20), 64)


def test_flapping_lanes_lose_nothing(pair_factory):
    _t, _l, send, recv = pair_factory(spread_env())
    torch_reccl.inject_fault(NICS[0], "down")
    assert wait_until(lambda: len(lanes_of(send.id)) == 3, 5), send.paths()
    stop = threading.Event()

    def flap():
        while not stop.is_set():
            for nic in (NICS[3], NICS[1]):  # a rail, then the backup (the active path)
                torch_reccl.inject_fault(nic, "down")
                time.sleep(0.15)
                torch_reccl.inject_fault(nic, "up")
                time.sleep(0.25)

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        stream(send, recv, plan_sizes(65, 400, 1 << 20, big=4), 65)
    finally:
        stop.set()
        flapper.join(10)


def test_spreading_off_loads_the_backup_alone(pair_factory):
    _t, _l, send, recv = pair_factory(spread_env("off"))
    torch_reccl.inject_fault(NICS[0], "down")
    assert wait_until(lambda: send.active_path == 1, 5), send.paths()
    before = bytes_sent()
    sizes = plan_sizes(66, 60, 1 << 20)
    stream(send, recv, sizes, 66)
    moved = sent_since(before)
    assert lanes_of(send.id) == []
    assert moved[NICS[1]] == sum(sizes), moved


def test_ib_emulation_spreads_replays_a_lost_lane_and_fails_back(events):
    """The IB transport takes the same lanes: three emulated devices per host."""
    from conftest import A0, A1, B0, B1, IB_CHUNK, ib_env, native, testing

    a, b = [A0, A1, "ib-a-2"], [B0, B1, "ib-b-2"]
    emu = testing().IbEmulation(a + b)
    sender = native().IbTransport(emu, ib_env(a, RECCL_SPREAD="on"))
    receiver = native().IbTransport(emu, ib_env(b, RECCL_SPREAD="on"))
    listener = receiver.listen(0)
    send = sender.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)
    try:
        emu.port_down(A0)
        assert wait_until(lambda: lanes_of(send.id) == [A1, "ib-a-2"], 5), send.paths()
        lost = threading.Event()

        def on_sent(index):
            if index == 50 and not lost.is_set():
                lost.set()
                emu.port_down("ib-a-2")

        stream(send, recv, plan_sizes(67, 200, 1 << 20, big=2), 67, on_sent=on_sent)
        assert lost.is_set() and lanes_of(send.id) == [], send.paths()  # one lane left
        emu.port_up("ib-a-2")
        assert wait_until(lambda: lanes_of(send.id) == [A1, "ib-a-2"], 10), send.paths()
        stream(send, recv, plan_sizes(68, 80, 1 << 20), 68)
        # Registered buffers: chunks RDMA-written straight into the receive
        # buffer over both lanes; a lane lost mid-stream is fenced (NOTIFY)
        # and the surviving one drained before the new epoch replays.
        lost.clear()
        before = emu.counters()

        def lose_again(index):
            if index == 30 and not lost.is_set():
                lost.set()
                emu.port_down("ib-a-2")

        registered_stream(sender, receiver, send, recv, plan_sizes(70, 80, 4 * IB_CHUNK, big=1), 70,
                          on_sent=lose_again)
        assert lost.is_set()
        emu.port_up("ib-a-2")
        assert wait_until(lambda: lanes_of(send.id) == [A1, "ib-a-2"], 10), send.paths()
        registered_stream(sender, receiver, send, recv, plan_sizes(71, 40, 4 * IB_CHUNK), 71)
        after = emu.counters()
        # Placed directly on every lane (each with its own device's key), none staged
        # but the empty messages.
        assert after["access_errors"] == before["access_errors"]
        assert after["writes_with_imm"] - before["writes_with_imm"] == 2  # the two 0-byte ones
        emu.port_up(A0)
        assert events.wait_for(10, "failback", connection=send.id)
        assert wait_until(lambda: lanes_of(send.id) == [] and send.active_path == 0, 5)
        stream(send, recv, plan_sizes(69, 40, 1 << 20), 69)
    finally:
        for nic in a + b:
            emu.port_up(nic)
        close_both(send, recv)
        listener.close()

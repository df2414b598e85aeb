"""Events beyond one process: the measured slowdown and the job-wide view on rank 0.

The slowdown tests stream paced traffic over two loopback NICs, fail the primary
and change the pace, so the expected ratio is known from the pacing, not from the
code under test. The job-wide tests run ranks 1 and 2 as spawned children that share
a real TCPStore with this process (rank 0); rank 2 dies abruptly part way.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

import torch_reccl
from torch_reccl import events as events_module
from torch_reccl.events import Event, configure_slowdown, flush_events, join_job, leave_job, on_event
from torch_reccl.slowdown import SlowdownMeter

from conftest import BACKUP, PRIMARY, EventLog, close_both, reccl_env

pytestmark = pytest.mark.usefixtures("healed_nics")


def make_event(**fields):
    return Event(rank=None, peer="", **fields)


def switch(kind, at, duration=0.1, nic=PRIMARY):
    return make_event(kind=kind, time=at, nic=nic, reason="injected", detail="", duration_s=duration)


def feed(meter, start, end, rate, total, step=0.1):
    """Samples at `step` from start to end (exclusive) with `rate` bytes/s; returns
    (finished measurements, byte total at the end)."""
    finished = []
    t = start
    while t < end - 1e-9:
        finished += meter.sample(t, int(total))
        total += rate * step
        t += step
    return finished, total


@pytest.mark.timeout(10)
def test_meter_ratio_of_known_rates():
    meter = SlowdownMeter(make_event, window_s=2.0, settle_s=1.0)
    out, total = feed(meter, 0.0, 10.0, 100e6, 0)
    meter.observe(switch("failover", 10.0, duration=0.2))        # detected at 9.8
    meter.observe(switch("path_down", 10.3))                     # burst: settles at 11.3
    out2, total = feed(meter, 10.0, 11.3, 0, total)               # interruption: nothing moves
    out3, _ = feed(meter, 11.3, 14.0, 40e6, total)
    assert out == out2 == []
    assert len(out3) == 1
    result = out3[0]
    assert result.kind == "slowdown" and result.nic == PRIMARY
    assert result.throughput_before == pytest.approx(100e6, rel=1e-6)
    assert result.throughput_after == pytest.approx(40e6, rel=1e-6)
    assert result.slowdown == pytest.approx(2.5, rel=1e-6)
    assert result.window_s == 2.0
    assert result.time >= 11.3 + 2.0


@pytest.mark.timeout(10)
def test_meter_reports_nothing_when_healed_early_or_idle_before():
    meter = SlowdownMeter(make_event, window_s=1.0, settle_s=0.5)
    _, total = feed(meter, 0.0, 5.0, 1e6, 0)
    meter.observe(switch("failover", 5.0))
    meter.observe(switch("failback", 5.8))
    out, total = feed(meter, 5.0, 9.0, 1e6, total)
    assert out == []
    idle = SlowdownMeter(make_event, window_s=1.0, settle_s=0.5)
    _, total = feed(idle, 0.0, 5.0, 0, 0)
    idle.observe(switch("failover", 5.0))
    out, _ = feed(idle, 5.0, 9.0, 1e6, total)
    assert out == []


@pytest.mark.timeout(10)
def test_meter_reports_a_stall_as_no_ratio():
    meter = SlowdownMeter(make_event, window_s=1.0, settle_s=0.5)
    _, total = feed(meter, 0.0, 5.0, 1e6, 0)
    meter.observe(switch("failover", 5.0))
    out, _ = feed(meter, 5.0, 8.0, 0, total)
    assert len(out) == 1 and out[0].slowdown is None and out[0].throughput_after == 0
    assert "no traffic after" in out[0].detail


def test_meter_rejects_bad_windows():
    with pytest.raises(ValueError, match="window_s"):
        configure_slowdown(0, 1.0)
    with pytest.raises(ValueError, match="settle_s"):
        configure_slowdown(1.0, -1)


def paced_stream(send, recv, rate_of, stop, chunk=256 << 10):
    """Sends `chunk`-byte messages at rate_of() bytes/s until stop is set."""
    received = []

    def receive():
        buf = bytearray(chunk)
        while True:
            request = recv.irecv(buf)
            got = request.wait(30)
            if got == 1:
                return
            received.append(got)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    data = os.urandom(chunk)
    sent, last = 0.0, time.monotonic()
    budget = 0.0
    while not stop.is_set():
        now = time.monotonic()
        budget = min(budget + rate_of() * (now - last), 4 * chunk)
        last = now
        if budget >= chunk:
            send.isend(data).wait(30)
            budget -= chunk
            sent += chunk
        else:
            time.sleep(0.002)
    send.isend(b"\0").wait(30)
    receiver.join(30)
    return sent


@pytest.mark.timeout(60)
def test_slowdown_event_after_a_real_failover(pair_factory):
    """Paced at 16 MiB/s until the failover, then at 8 MiB/s: the meter must see ~2."""
    configure_slowdown(1.0, 0.5)
    log = EventLog()
    handle = on_event(log, kinds=["failover", "slowdown"])
    try:
        _t, _l, send, recv = pair_factory(reccl_env())
        rate = {"now": 16 << 20}
        stop = threading.Event()
        box = {}
        worker = threading.Thread(target=lambda: box.update(sent=paced_stream(
            send, recv, lambda: rate["now"], stop)), daemon=True)
        worker.start()
        time.sleep(2.0)  # a full before-window of steady traffic
        torch_reccl.inject_fault(PRIMARY, "down")
        assert log.wait_for(5, "failover", connection=send.id)
        rate["now"] = 8 << 20
        slowdowns = log.wait_for(10, "slowdown")
        stop.set()
        worker.join(30)
        assert slowdowns, [e.to_dict() for e in log.all()]
        result = slowdowns[0]
        print(result.to_json())  # shown with -s
        assert result.nic == PRIMARY and result.reason == "measured"
        # Both ends are in this process, so each byte counts sent and received.
        assert result.throughput_before == pytest.approx(2 * (16 << 20), rel=0.25)
        assert result.throughput_after == pytest.approx(2 * (8 << 20), rel=0.25)
        assert result.slowdown == pytest.approx(2.0, rel=0.3)
        assert result.slowdown == pytest.approx(result.throughput_before / result.throughput_after)
    finally:
        handle.remove()
        configure_slowdown(2.0, 1.0)


# --------------------------------------------------------------------------- job-wide


def rank_main(rank: int, world_size: int, port: int, commands, replies) -> None:
    """Ranks 1 and 2: join the job over the store, then act on commands from rank 0."""
    import datetime

    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.events import flush_events, join_job, on_event
    from torch_reccl.transport import Transport

    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=20))
    join_job(store=store, rank=rank, world_size=world_size)
    local = []
    on_event(local.append, job_wide=True)  # on ranks > 0: gets nothing, publishes everything
    transport = Transport(reccl_env())
    listener = transport.listen(0)
    send = transport.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)
    replies.put(("ready", rank))
    while True:
        command = commands.get(timeout=60)
        if command == "fault":
            torch_reccl.inject_fault(PRIMARY, "down")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and send.active_path != 1:
                time.sleep(0.02)
            flush_events(job_wide=True, timeout=10)
            replies.put(("fault", send.id))
        elif command == "heal":
            torch_reccl.inject_fault(PRIMARY, "up")
            time.sleep(0.5)
            flush_events(job_wide=True, timeout=10)
            replies.put(("heal", len(local)))
        elif command == "die":
            # The test's own queue first: dying while its feeder thread still holds the
            # shared replies queue's write lock (it may not have run since the last
            # reply) would wedge the other rank's replies. The store sees no goodbye.
            replies.close()
            replies.join_thread()
            os._exit(3)  # no cleanup, no goodbye: as a crashed rank
        elif command == "exit":
            close_both(send, recv)
            listener.close()
            flush_events(job_wide=True, timeout=10)
            replies.put(("exit", 0))
            return


@pytest.fixture
def job_store():
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    yield store
    leave_job()


@pytest.mark.timeout(120)
def test_rank0_sees_every_rank_and_outlives_a_dead_one(job_store):
    ctx = multiprocessing.get_context("spawn")
    replies = ctx.Queue()
    ranks = {}
    for rank in (1, 2):
        commands = ctx.Queue()
        process = ctx.Process(target=rank_main, args=(rank, 3, job_store.port, commands, replies),
                              daemon=True)
        process.start()
        ranks[rank] = (process, commands)
    try:
        seen = EventLog()
        join_job(store=job_store, rank=0, world_size=3, poll_interval_s=0.05)
        handle = on_event(seen, kinds=["failover", "failback", "nic_down"], job_wide=True)
        local_only = EventLog()
        local_handle = on_event(local_only, kinds=["failover", "nic_down"])
        assert {replies.get(timeout=60) for _ in ranks} == {("ready", 1), ("ready", 2)}

        ranks[2][1].put("fault")
        kind, connection_2 = replies.get(timeout=30)
        assert kind == "fault"
        assert seen.wait_for(5, "failover", rank=2, connection=connection_2)
        assert seen.wait_for(5, "nic_down", rank=2, nic=PRIMARY)

        ranks[2][1].put("die")
        ranks[2][0].join(30)
        assert ranks[2][0].exitcode == 3

        ranks[1][1].put("fault")
        kind, connection_1 = replies.get(timeout=30)
        moved = seen.wait_for(5, "failover", rank=1, connection=connection_1)
        assert moved and moved[0].from_path == 0 and moved[0].to_path == 1
        assert moved[0].duration_s is not None and moved[0].duration_s > 0
        ranks[1][1].put("heal")
        kind, delivered_on_rank1 = replies.get(timeout=30)
        assert delivered_on_rank1 == 0  # job-wide callbacks on ranks > 0 get nothing
        assert seen.wait_for(5, "failback", rank=1, connection=connection_1)

        # Rank 0's own events reach its job-wide callback too, tagged rank 0;
        # other ranks' events never reach a local-only callback.
        from torch_reccl.transport import Transport

        Transport(reccl_env())  # registers this process's NICs, so the drill can name one
        torch_reccl.inject_fault(BACKUP, "down")
        assert seen.wait_for(5, "nic_down", rank=0, nic=BACKUP)
        assert all(e.rank in (0, None) for e in local_only.all())
        assert not [e for e in seen.all() if e.rank not in (0, 1, 2)]
        for event in seen.all():  # each event once: no batch read twice
            assert len([e for e in seen.all() if e == event]) == 1

        ranks[1][1].put("exit")
        assert replies.get(timeout=30) == ("exit", 0)
        handle.remove()
        local_handle.remove()
    finally:
        for process, _commands in ranks.values():
            process.join(10)
            if process.is_alive():
                process.kill()


def test_job_wide_needs_a_process_group_or_a_store():
    assert events_module._hub.channel is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        on_event(print, job_wide=True)
    with pytest.raises(ValueError, match="rank"):
        join_job(store=object(), rank=5, world_size=2)
    flush_events()


class StuckStore:
    """A store whose set() blocks until released, or fails, as a hung or dead rank 0.
    It has no queue_push, so the channel uses the keys fallback (a slot from add,
    then set)."""

    def __init__(self, fail=False):
        self.release = threading.Event()
        self.fail = fail
        self.sets = []

    def set(self, key, value):
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        self.release.wait(30)
        self.sets.append(key)

    def add(self, key, amount):
        return 1


@pytest.mark.timeout(30)
def test_a_hung_store_never_blocks_local_delivery_or_flush_beyond_its_timeout(capfd):
    store = StuckStore()
    try:
        channel = join_job(store=store, rank=1, world_size=2)
        assert channel.is_publisher
        local = EventLog()
        handle = on_event(local)
        event = make_event(kind="nic_down", time=time.time(), nic=PRIMARY, reason="injected", detail="")
        events_module._hub._dispatch([event])       # as the event thread does
        assert local.all() == [event]                 # delivered at once, store or not
        started = time.monotonic()
        assert flush_events(job_wide=True, timeout=0.5) is False
        assert 0.4 < time.monotonic() - started < 3
        store.release.set()
        assert flush_events(job_wide=True, timeout=10) is True
        assert store.sets == ["reccl/events/log/1"]
        assert channel.stats()["mode"] == "keys"
        handle.remove()
    finally:
        store.release.set()
        leave_job()

    dead = StuckStore(fail=True)
    try:
        channel = join_job(store=dead, rank=1, world_size=2)
        for _ in range(2):
            channel.publish(make_event(kind="nic_up", time=time.time(), nic=PRIMARY, reason="", detail=""))
            assert flush_events(job_wide=True, timeout=10) is True   # dropped, not stuck
        stats = channel.stats()
        assert (stats["failed_batches"], stats["dropped_events"], stats["store_down"]) == (2, 2, 1)
        assert stats["batches_published"] == 0 and stats["store_errors"] >= 1
        err = capfd.readouterr().err
        assert err.count("is not answering") == 1, err  # warned once, then quiet
        assert "this rank's events do not reach rank 0" in err
    finally:
        leave_job()


@pytest.mark.timeout(30)
def test_channel_collects_on_any_rank_the_job_names():
    """Three channels on one store, collecting on the last rank (as Megatron logs)."""
    import torch.distributed as dist

    from torch_reccl.job_events import JobChannel

    store = dist.HashStore()
    got = []
    channels = [JobChannel(store, rank, 3, got.extend, poll_interval_s=0.05, collector_rank=2)
                for rank in range(3)]
    try:
        assert [c.is_publisher for c in channels] == [True, True, False]
        for rank in (0, 1):
            event = make_event(kind="failover", time=float(rank), nic=f"eth{rank}", reason="injected",
                               detail="", duration_s=0.001)
            channels[rank].publish(dataclasses_replace(event, rank=rank))
            assert channels[rank].flush(10)
        channels[2].flush(10)
        assert sorted((e["rank"], e["nic"]) for e in got) == [(0, "eth0"), (1, "eth1")]
    finally:
        for channel in channels:
            channel.close()
    with pytest.raises(ValueError, match="collector_rank"):
        JobChannel(store, 0, 3, got.extend, collector_rank=3)


def dataclasses_replace(event, **changes):
    import dataclasses

    return dataclasses.replace(event, **changes)

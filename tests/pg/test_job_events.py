"""The job-wide event side channel at scale: cost in proportion to events, not ranks.

Publishers run as spawned children that share a real TCPStore with this process
(the collector, rank 0), as in tests/core/test_events.py. What the old design got wrong,
each checked here: every event of 6 ranks arrives once with its source rank and
nothing is left in the store; an idle window costs the collector the same handful of
store calls with 2 ranks as with 6 (counted by a proxy around the store, not by the
code under test) and the publishers none; a store host that is stopped, resumed and
killed gives exactly one warning per outage and rank, one line when it answers again,
and close() stays bounded.
"""
from __future__ import annotations

import collections
import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from torch_reccl import events as events_module, job_events
from torch_reccl.events import Event, flush_events, join_job, leave_job, on_event

from conftest import EventLog, stop_process, wait_until


def make_event(detail: str, nic: str = "eth0", rank=None) -> Event:
    return Event(kind="nic_down", time=time.time(), rank=rank, nic=nic, peer="", reason="injected",
                 detail=detail)


def server_store(world_size: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


class CountingStore:
    """Forwards the store calls the channel makes and counts them; its clones share
    the counter, so it counts every connection the channel opens through it."""

    CALLS = ("queue_push", "queue_pop", "queue_len", "add", "set", "get", "check", "delete_key")

    def __init__(self, inner, calls=None, lock=None):
        self._inner = inner
        self.calls = collections.Counter() if calls is None else calls
        self._lock = threading.Lock() if lock is None else lock

    def total(self) -> int:
        with self._lock:
            return sum(self.calls.values())

    def clone(self):
        with self._lock:
            self.calls["clone"] += 1
        return CountingStore(self._inner.clone(), self.calls, self._lock)

    def set_timeout(self, timeout):
        self._inner.set_timeout(timeout)

    def __getattr__(self, name):
        if name not in self.CALLS:
            raise AttributeError(name)
        method = getattr(self._inner, name)

        def counted(*args, **kwargs):
            with self._lock:
                self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


def publisher_main(rank: int, world_size: int, port: int, commands, replies) -> None:
    """A rank > 0: joins the job over the store, publishes bursts through the event hub."""
    import torch.distributed as dist

    from torch_reccl import events as ev

    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=30))
    channel = ev.join_job(store=store, rank=rank, world_size=world_size)
    replies.put(("ready", rank, channel.stats()))
    sent = 0
    while True:
        command, argument = commands.get(timeout=120)
        if command == "publish":  # argument: burst sizes, each burst one dispatch
            for size in argument:
                # rank=None: the channel must tag each event with its source rank
                ev._hub._dispatch([make_event(f"{rank}:{sent + i}", nic=f"eth{rank}")
                                   for i in range(size)])
                sent += size
                time.sleep(0.15)  # > BATCH_DELAY_S: bursts go out as separate batches
            ok = ev.flush_events(job_wide=True, timeout=20)
            replies.put(("published", rank, (ok, channel.stats())))
        elif command == "stats":
            replies.put(("stats", rank, channel.stats()))
        elif command == "exit":
            ev.leave_job(10)
            replies.put(("exit", rank, None))
            return


class Job:
    """This process is rank 0; ranks 1..N-1 are spawned publishers."""

    def __init__(self, world_size: int, port: int):
        ctx = multiprocessing.get_context("spawn")
        self.replies = ctx.Queue()
        self.ranks = {}
        for rank in range(1, world_size):
            commands = ctx.Queue()
            process = ctx.Process(target=publisher_main,
                                  args=(rank, world_size, port, commands, self.replies), daemon=True)
            process.start()
            self.ranks[rank] = (process, commands)
        self.collect("ready")

    def collect(self, kind: str):
        got = {}
        for _ in self.ranks:
            reply_kind, rank, payload = self.replies.get(timeout=90)
            assert reply_kind == kind, (reply_kind, rank, payload)
            got[rank] = payload
        return got

    def all(self, command: str, argument=None):
        for _process, commands in self.ranks.values():
            commands.put((command, argument))

    def close(self):
        try:
            self.all("exit")
            self.collect("exit")
        finally:
            for process, _commands in self.ranks.values():
                process.join(15)
                if process.is_alive():
                    process.kill()


@pytest.fixture
def no_channel():
    assert events_module._hub.channel is None
    yield
    leave_job()


@pytest.mark.timeout(180)
def test_every_event_of_six_ranks_reaches_the_collector_once(no_channel):
    world_size = 6
    store = server_store(world_size)
    bursts = [1, 40, 300, 7]  # 300 > MAX_BATCH_EVENTS: one burst, two batches
    job = Job(world_size, store.port)
    try:
        channel = join_job(store=store, rank=0, world_size=world_size)
        seen = EventLog()
        handle = on_event(seen, kinds=["nic_down"], job_wide=True)
        assert channel.mode == "queue"
        job.all("publish", bursts)
        published = job.collect("published")
        assert all(ok for ok, _stats in published.values())
        assert flush_events(job_wide=True, timeout=20)

        per_rank = sum(bursts)
        events = seen.all()
        details = collections.Counter(e.detail for e in events)
        assert len(events) == (world_size - 1) * per_rank
        assert set(details.values()) == {1}, "an event arrived twice"
        assert set(details) == {f"{r}:{i}" for r in range(1, world_size) for i in range(per_rank)}
        for event in events:  # tagged with the rank that published it
            assert event.rank == int(event.detail.split(":")[0])
            assert event.nic == f"eth{event.rank}"

        stats = channel.stats()
        sent_batches = sum(s["batches_published"] for _ok, s in published.values())
        assert stats["batches_collected"] == sent_batches
        assert stats["events_collected"] == len(events)
        for _ok, s in published.values():
            # one push per batch, one clone, one round trip for the flush: nothing per rank
            assert s["store_requests"] == s["batches_published"] + 2, s
            assert s["dropped_events"] == 0
        assert store.queue_len(job_events.QUEUE_KEY) == 0  # popped items leave the store
        handle.remove()
    finally:
        job.close()


def idle_cost(world_size: int, monkeypatch) -> dict:
    """Counts the store calls of an idle job: the collector's through a proxy, the
    publishers' from their stats, over a 2 s window with the default heartbeat and
    again with a 0.5 s one."""
    store = server_store(world_size)
    counting = CountingStore(store)
    got = []
    channel = job_events.JobChannel(counting, 0, world_size, got.extend)
    job = Job(world_size, store.port)
    try:
        job.all("publish", [3])  # every rank has published: the old design's worst case
        job.collect("published")
        assert channel.flush(20)
        assert len(got) == 3 * (world_size - 1)

        def window():
            job.all("stats")
            before = {rank: s["store_requests"] for rank, s in job.collect("stats").items()}
            start = counting.total()
            time.sleep(2.0)
            collector = counting.total() - start
            job.all("stats")
            after = {rank: s["store_requests"] for rank, s in job.collect("stats").items()}
            return collector, {rank: after[rank] - before[rank] for rank in after}

        quiet, quiet_publishers = window()
        monkeypatch.setattr(job_events, "HEARTBEAT_S", 0.5)
        assert channel.flush(10)  # wakes the control thread, which now ticks every 0.5 s
        ticking, ticking_publishers = window()
        return {"quiet": quiet, "ticking": ticking, "publishers": {**quiet_publishers},
                "ticking_publishers": ticking_publishers, "calls": dict(counting.calls),
                "stats": channel.stats()}
    finally:
        channel.close(5)
        job.close()


@pytest.mark.timeout(240)
def test_idle_cost_does_not_grow_with_ranks(monkeypatch):
    small = idle_cost(2, monkeypatch)
    monkeypatch.setattr(job_events, "HEARTBEAT_S", 30.0)
    large = idle_cost(6, monkeypatch)
    print("idle store calls over 2 s:", {"N=2": small, "N=6": large})  # shown with -s
    for result in (small, large):
        # Default heartbeat (30 s): the collector's pop just waits, no call at all.
        assert result["quiet"] <= 1, result
        # 0.5 s heartbeat: a tick pushed and popped per beat (2 calls), whatever N
        # (fewer on a loaded machine, never more).
        assert 2 <= result["ticking"] <= 12, result
        assert set(result["publishers"].values()) == {0}, result
        assert set(result["ticking_publishers"].values()) == {0}, result
    assert abs(small["ticking"] - large["ticking"]) <= 3, (small, large)
    assert small["quiet"] == large["quiet"]


# --------------------------------------------------------------------------- store gone


STORE_HOST = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def store_host():
    """A process that only hosts the TCPStore, so the test can stop and kill it."""
    process = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        yield process, port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(10)


@pytest.fixture
def fast_outages(monkeypatch):
    monkeypatch.setattr(job_events, "STALL_S", 1.0)
    monkeypatch.setattr(job_events, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(job_events, "BACKOFF_MAX_S", 0.4)


def client_store(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))


def ours(err: str, rank: int, what: str):
    return [line for line in err.splitlines() if line.startswith(f"[reccl] rank {rank}: ") and what in line]


@pytest.mark.timeout(120)
def test_store_host_stopped_resumed_killed_warns_once_per_outage(store_host, fast_outages, capfd):
    host, port = store_host
    store = client_store(port)
    got = []
    collector = job_events.JobChannel(store, 0, 2, got.extend)
    publisher = job_events.JobChannel(store, 1, 2, None)
    try:
        publisher.publish(make_event("before", rank=1))
        assert publisher.flush(10) and collector.flush(10)
        assert [e["detail"] for e in got] == ["before"]
        capfd.readouterr()

        # Stopped: pushes sit in the socket buffers; the publisher's flush round trip
        # and the collector's heartbeat go unanswered for STALL_S.
        stop_process(host.pid)
        publisher.publish(make_event("while stopped, buffered", rank=1))
        started = time.monotonic()
        assert publisher.flush(2.5) is False
        assert time.monotonic() - started < 3.5
        assert wait_until(lambda: collector.stats()["store_down"] == 1, 5)
        publisher.publish(make_event("while stopped, dropped", rank=1))  # never waits
        assert publisher.stats()["dropped_events"] == 1
        time.sleep(1.5)  # more heartbeats and stall checks: still no second warning
        err = capfd.readouterr().err
        for rank in (0, 1):
            assert len(ours(err, rank, "is not answering")) == 1, err
            assert f"127.0.0.1:{port}" in ours(err, rank, "is not answering")[0]
        assert "Traceback" not in err

        os.kill(host.pid, signal.SIGCONT)
        assert wait_until(lambda: publisher.stats()["store_down"] == 0
                          and collector.stats()["store_down"] == 0, 10)
        assert publisher.flush(10) and collector.flush(10)
        assert [e["detail"] for e in got] == ["before", "while stopped, buffered"]
        err = capfd.readouterr().err
        for rank in (0, 1):
            assert len(ours(err, rank, "answers again")) == 1, err
            assert not ours(err, rank, "is not answering")
        assert "1 events dropped" in ours(err, 1, "answers again")[0]

        # Killed: the collector's pop fails at once; the publisher finds out on a push
        # or its flush. Retries are quiet (a TCP probe of the port, no c10d call).
        host.kill()
        host.wait(10)
        for i in range(6):
            publisher.publish(make_event(f"after kill {i}", rank=1))
            publisher.flush(2)
            time.sleep(0.3)
        assert wait_until(lambda: collector.stats()["store_down"] == 1, 5)
        time.sleep(1.5)  # several backoff rounds (capped at 0.4 s here)
        stats = {"publisher": publisher.stats(), "collector": collector.stats()}
        err = capfd.readouterr().err
        reccl_lines = [line for line in err.splitlines() if line.startswith("[reccl]")]
        assert len(ours(err, 0, "is not answering")) == 1, err
        assert len(ours(err, 1, "is not answering")) == 1, err
        assert len(reccl_lines) == 2, reccl_lines
        assert stats["collector"]["store_probes"] >= 2, stats  # it kept retrying, quietly
        assert stats["publisher"]["dropped_events"] >= 5, stats
        # torch prints one warning per failing c10d call; we make none after the first
        # failure on each connection (publisher: 1; collector: pop and perhaps control).
        assert err.count("[c10d]") <= 4, err
    finally:
        started = time.monotonic()
        publisher.close(1.0)
        collector.close(1.0)
        assert time.monotonic() - started < 4


@pytest.mark.timeout(60)
def test_close_is_bounded_while_the_store_host_is_stopped(store_host, fast_outages, capfd):
    host, port = store_host
    store = client_store(port)
    got = []
    collector = job_events.JobChannel(store, 0, 2, got.extend)
    publisher = job_events.JobChannel(store, 1, 2, None)
    publisher.publish(make_event("first", rank=1))
    assert publisher.flush(10) and collector.flush(10)
    stop_process(host.pid)
    publisher.publish(make_event("pending", rank=1))
    started = time.monotonic()
    publisher.close(1.0)  # its flush round trip never comes back
    collector.close(1.0)  # its stop marker is never popped
    assert time.monotonic() - started < 3
    assert [e["detail"] for e in got] == ["first"]


# --------------------------------------------------------------------------- fallback


class KeysOnlyStore(CountingStore):
    """A store without queues (as torch < 2.6 or a custom store): the keys fallback."""

    CALLS = ("add", "set", "get", "check", "delete_key")

    def clone(self):
        with self._lock:
            self.calls["clone"] += 1
        return KeysOnlyStore(self._inner.clone(), self.calls, self._lock)


@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
def test_junk_in_the_queue_is_counted_and_collection_goes_on():
    """Anyone with the store can push to the events queue: items that are not UTF-8,
    not JSON, nested past json's recursion limit or not a list of events are counted
    as bad items, and the events after them still arrive."""
    store = server_store(2)
    got = []

    def deliver(batch):  # as the event hub does: every item must be an event's dict
        got.extend([Event.from_dict(d) for d in batch])

    channels = [job_events.JobChannel(store, rank, 2, deliver) for rank in range(2)]
    try:
        assert {c.mode for c in channels} == {"queue"}
        junk = [b"\xff\xfe", b"{not json", b"[" * 100000, b"7", b"[1, 2]"]
        for item in junk:
            store.queue_push(job_events.QUEUE_KEY, item)
        channels[1].publish(make_event("after the junk"))
        assert channels[1].flush(10)
        assert channels[0].flush(10)
        assert [e.detail for e in got] == ["after the junk"]
        assert channels[0].stats()["bad_items"] == len(junk), channels[0].stats()
    finally:
        for channel in channels:
            channel.close(5)


def test_keys_fallback_delivers_once_skips_a_dead_slot_and_cleans_up(monkeypatch):
    monkeypatch.setattr(job_events, "GAP_GRACE_S", 0.5)
    store = server_store(4)
    keys = KeysOnlyStore(store)
    got = []
    channels = [job_events.JobChannel(keys, rank, 4, got.extend, poll_interval_s=0.05)
                for rank in range(4)]
    try:
        assert {c.mode for c in channels} == {"keys"}
        for rank in (1, 2, 3):
            for i in range(5):
                channels[rank].publish(make_event(f"{rank}:{i}"))
            assert channels[rank].flush(10)
        # A publisher that died between reserving a slot and writing it:
        dead_slot = store.add(job_events.SLOT_KEY, 1)
        channels[1].publish(make_event("1:late"))
        assert channels[1].flush(10)
        assert channels[0].flush(10)
        assert sorted(e["detail"] for e in got) == sorted(
            [f"{r}:{i}" for r in (1, 2, 3) for i in range(5)])
        assert wait_until(lambda: any(e["detail"] == "1:late" for e in got), 5)  # after the grace
        assert all(e["rank"] == int(e["detail"].split(":")[0]) for e in got)
        assert len(got) == 16
        stats = channels[0].stats()
        assert stats["skipped_slots"] == 1, stats
        assert stats["events_collected"] == 16 and stats["bad_items"] == 0, stats
        total = store.add(job_events.SLOT_KEY, 0)
        assert not any(store.check([job_events.LOG_KEY.format(s)]) for s in range(1, total + 1)
                       if s != dead_slot)  # read entries are deleted
        assert store.add(job_events.READ_KEY, 0) == total
    finally:
        for channel in channels:
            channel.close(5)

"""One event loop (csrc/transport/event_loop.h) with recording handlers over
pipes: readiness reaches the handler, deadlines fire in order and never early,
replaced and earlier-only deadlines, a deadline set from another thread wakes
a sleeping loop, a deadline already past hands work to the loop at once,
setEvents(0) silences a socket, remove() waits for a running callback and no
callback follows it, and an idle loop retires its thread.

Timing is bounded from one side only ("not before", "within a generous
bound"): load can delay a callback, never make one early.
"""
from __future__ import annotations

import os
import select
import threading
import time

import pytest

from torch_reccl._native import testing as load_testing

pytestmark = pytest.mark.timeout(60)

T = load_testing()
MS = 1_000_000
BOUND = 10.0  # seconds


@pytest.fixture
def pipes():
    opened = []

    def make():
        r, w = os.pipe()
        os.set_blocking(r, False)
        opened.append((r, w))
        return r, w

    yield make
    for r, w in opened:
        os.close(r)
        os.close(w)


def kinds(handler):
    return [call[0] for call in handler.calls()]


def test_readiness_reaches_the_handler(pipes):
    loop = T.EventLoop()
    r, w = pipes()
    handler = T.LoopHandler(drain_fd=r)
    ident = loop.add(r, select.EPOLLIN, handler)
    assert ident != 0 and loop.running
    time.sleep(0.1)
    assert handler.calls() == [], "an empty pipe reported readiness"
    os.write(w, b"x")
    assert handler.wait_calls(2, BOUND)
    (start, _, events), (end, _, _) = handler.calls()
    assert (start, end) == ("io-start", "io") and events & select.EPOLLIN
    loop.remove(ident)


def test_deadlines_fire_in_order_and_never_early(pipes):
    loop = T.EventLoop()
    handlers = [T.LoopHandler() for _ in range(3)]
    ids = [loop.add(pipes()[0], select.EPOLLIN, h) for h in handlers]
    now = T.steady_now_ns()
    dues = [now + 150 * MS, now + 50 * MS, now + 100 * MS]
    for ident, due in zip(ids, dues):
        loop.set_deadline(ident, due)
    for handler in handlers:
        assert handler.wait_calls(2, BOUND)
    fired = [h.calls()[0][1] for h in handlers]
    for at, due in zip(fired, dues):
        assert at >= due, f"a deadline fired {due - at} ns early"
    assert fired[1] <= fired[2] <= fired[0], "deadlines fired out of order"
    for ident in ids:
        loop.remove(ident)


def test_a_replaced_deadline_fires_once_at_its_new_time(pipes):
    loop = T.EventLoop()
    handler = T.LoopHandler()
    ident = loop.add(pipes()[0], select.EPOLLIN, handler)
    now = T.steady_now_ns()
    loop.set_deadline(ident, now + 40 * MS)
    loop.set_deadline(ident, now + 300 * MS)  # replaces: later
    loop.set_deadline(ident, now + 900 * MS, earlier_only=True)  # kept: 300 ms is earlier
    assert handler.wait_calls(2, BOUND)
    assert handler.calls()[0][1] >= now + 300 * MS
    time.sleep(0.8)
    assert kinds(handler) == ["deadline-start", "deadline"], "a replaced deadline fired too"
    loop.remove(ident)


def test_an_earlier_deadline_from_another_thread_wakes_the_sleeping_loop(pipes):
    loop = T.EventLoop()
    sleeper, woken = T.LoopHandler(), T.LoopHandler()
    first = loop.add(pipes()[0], select.EPOLLIN, sleeper)
    second = loop.add(pipes()[0], select.EPOLLIN, woken)
    now = T.steady_now_ns()
    loop.set_deadline(first, now + 30_000 * MS)  # the loop sleeps until then
    time.sleep(0.1)
    due = T.steady_now_ns() + 100 * MS
    threading.Thread(target=loop.set_deadline, args=(second, due)).start()
    assert woken.wait_calls(2, BOUND), "the loop slept through an earlier deadline"
    assert woken.calls()[0][1] >= due
    assert sleeper.calls() == []
    loop.remove(first)
    loop.remove(second)


def test_a_past_deadline_hands_work_to_the_loop_at_once(pipes):
    loop = T.EventLoop()
    handler = T.LoopHandler()
    ident = loop.add(pipes()[0], select.EPOLLIN, handler)
    loop.set_deadline(ident, T.steady_now_ns() + 30_000 * MS)
    time.sleep(0.1)
    loop.set_deadline(ident, T.steady_now_ns() - 5 * MS)  # due now
    loop.set_deadline(ident, T.steady_now_ns() + 30_000 * MS, earlier_only=True)  # nothing is earlier
    assert handler.wait_calls(2, BOUND)
    time.sleep(0.3)
    assert kinds(handler) == ["deadline-start", "deadline"]
    loop.remove(ident)


def test_set_events_zero_silences_a_socket(pipes):
    loop = T.EventLoop()
    r, w = pipes()
    handler = T.LoopHandler()  # does not drain: level-triggered, it would report again and again
    ident = loop.add(r, select.EPOLLIN, handler)
    loop.set_events(ident, 0)
    os.write(w, b"x")
    time.sleep(0.3)
    assert handler.calls() == []
    loop.set_events(ident, select.EPOLLIN)
    assert handler.wait_calls(2, BOUND)
    loop.set_events(ident, 0)
    time.sleep(0.1)  # a report already taken may still be dispatched
    count = len(handler.calls())
    time.sleep(0.3)
    assert len(handler.calls()) == count
    loop.remove(ident)


def test_remove_waits_for_the_running_callback_and_none_follows(pipes):
    loop = T.EventLoop()
    r, w = pipes()
    handler = T.LoopHandler(drain_fd=r, hold=True)
    ident = loop.add(r, select.EPOLLIN, handler)
    loop.set_deadline(ident, T.steady_now_ns() + 400 * MS)
    os.write(w, b"x")
    assert handler.wait_calls(1, BOUND)  # inside onIo, held
    released = threading.Timer(0.3, handler.release)
    released.start()
    loop.remove(ident)  # returns only once the held callback is over
    assert kinds(handler) == ["io-start", "io"]
    time.sleep(0.6)  # past the deadline the removed registration had
    assert kinds(handler) == ["io-start", "io"], "a callback ran after remove()"
    released.join()


def test_an_idle_loop_retires_its_thread(pipes):
    loop = T.EventLoop()
    ident = loop.add(pipes()[0], select.EPOLLIN, T.LoopHandler())
    assert loop.running
    loop.remove(ident)
    deadline = time.monotonic() + T.EVENT_LOOP_IDLE_RETIREMENT_MS / 1000 + BOUND
    while loop.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loop.running, "an idle loop kept its thread"
    # A new registration starts it again.
    handler = T.LoopHandler()
    ident = loop.add(pipes()[0], select.EPOLLIN, handler)
    assert loop.running
    loop.set_deadline(ident, T.steady_now_ns())
    assert handler.wait_calls(2, BOUND)
    loop.remove(ident)

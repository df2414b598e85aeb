"""The timer wheel (csrc/core/timer_wheel.h) on a clock the test drives: which
ids pop when, replacing and cancelling, deadlines beyond one turn of the wheel,
deadlines later in the current tick, and when the owner is told to wake. A
seeded random run checks every pop against a plain model of deadlines.
"""
from __future__ import annotations

import random

import pytest

from torch_reccl._native import testing as load_testing

pytestmark = pytest.mark.timeout(60)

T = load_testing()
TICK = T.TIMER_WHEEL_TICK_NS
TURN = TICK * T.TIMER_WHEEL_SLOTS
START = 1_000_000 * TICK + 123  # an arbitrary instant, not on a tick boundary
MS = 1_000_000


def test_ids_pop_when_due_and_not_before():
    wheel = T.TimerWheel(START)
    wheel.set(1, START + 30 * MS)
    wheel.set(2, START + 10 * MS)
    wheel.set(3, START + 20 * MS)
    assert wheel.pop_due(START + 9 * MS) == []
    assert wheel.pop_due(START + 10 * MS) == [2]
    assert wheel.pop_due(START + 10 * MS) == []  # popped once
    assert sorted(wheel.pop_due(START + 35 * MS)) == [1, 3]
    assert wheel.next_wake_ns() == -1
    assert wheel.deadline_of(1) == -1


def test_replacing_and_cancelling():
    wheel = T.TimerWheel(START)
    wheel.set(7, START + 5 * MS)
    wheel.set(7, START + 50 * MS)  # replaces: one deadline per id
    assert wheel.deadline_of(7) == START + 50 * MS
    assert wheel.pop_due(START + 20 * MS) == []
    wheel.set(8, START + 60 * MS)
    wheel.cancel(8)
    wheel.cancel(8)   # twice is harmless
    wheel.cancel(99)  # unknown is harmless
    assert wheel.deadline_of(8) == -1
    assert wheel.pop_due(START + 100 * MS) == [7]


def test_a_past_deadline_is_due_at_the_next_tick():
    wheel = T.TimerWheel(START)
    wheel.pop_due(START + 10 * MS)
    wheel.set(4, START)  # already past
    assert wheel.deadline_of(4) == START
    assert START + 10 * MS < wheel.next_wake_ns() <= START + 12 * MS
    assert wheel.pop_due(START + 12 * MS) == [4]


def test_a_deadline_later_in_the_current_tick_is_not_lost():
    # popDue leaves the current tick open: a deadline later in it must pop
    # within this tick, not a whole turn later.
    base = (START // TICK + 5) * TICK
    wheel = T.TimerWheel(START)
    wheel.set(5, base + TICK * 6 // 10)
    assert wheel.pop_due(base + TICK * 2 // 10) == []
    assert wheel.pop_due(base + TICK * 6 // 10) == [5]


def test_deadlines_beyond_one_turn_wait_their_turn():
    wheel = T.TimerWheel(START)
    far = START + 3 * TURN + 7 * MS
    wheel.set(1, far)
    wheel.set(2, START + TURN + 7 * MS)  # the same slot, a different turn
    for now in range(START + 5 * MS, far - MS, 100 * MS):
        due = wheel.pop_due(now)
        assert 1 not in due, f"popped {far - now} ns early"
        if due:
            assert due == [2] and now >= START + TURN + 7 * MS
    assert wheel.deadline_of(2) == -1
    assert wheel.pop_due(far) == [1]


def test_next_wake_is_within_a_tick_after_the_earliest_deadline():
    wheel = T.TimerWheel(START)
    assert wheel.next_wake_ns() == -1
    wheel.set(1, START + 40 * MS + 300)
    wheel.set(2, START + 900 * MS)
    wake = wheel.next_wake_ns()
    assert START + 40 * MS + 300 <= wake <= START + 41 * MS + 300
    assert wheel.pop_due(wake) == [1]
    wake = wheel.next_wake_ns()
    assert START + 900 * MS <= wake <= START + 901 * MS
    wheel.cancel(2)
    assert wheel.next_wake_ns() == -1


def test_random_schedule_matches_a_model():
    rng = random.Random(34)
    wheel = T.TimerWheel(START)
    model = {}
    now = START
    for _ in range(4000):
        action = rng.random()
        ident = rng.randrange(64)
        if action < 0.45:
            # Mostly near deadlines, some past, some several turns away.
            due = now + rng.choice([rng.randrange(-5 * MS, 40 * MS), rng.randrange(0, 4 * TURN)])
            wheel.set(ident, due)
            model[ident] = due
        elif action < 0.6:
            wheel.cancel(ident)
            model.pop(ident, None)
        else:
            if model and rng.random() < 0.5:
                # Advance to where the wheel asks to be woken: nothing overdue may be left behind.
                wake = wheel.next_wake_ns()
                assert wake >= 0
                assert wake <= max(now, min(model.values())) + TICK + TICK
                now = max(now, wake)
            else:
                now += rng.randrange(0, 3 * MS)
            due = wheel.pop_due(now)
            expected = sorted(i for i, d in model.items() if d <= now)
            assert sorted(due) == expected, f"at {now - START} ns"
            for ident in due:
                del model[ident]
        assert wheel.deadline_of(ident) == model.get(ident, -1)
    assert (wheel.next_wake_ns() == -1) == (not model)

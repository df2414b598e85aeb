"""The supervisor's rounds (csrc/core/supervisor.h) with recording items: a poke
or an added item starts a round, quiet items let it sleep its quiet tick, a busy
item keeps it ticking, wakeBy bounds a quiet sleep, a failing round neither
stops it nor lets it fall asleep, items whose owner is gone are reaped, and
stopping it is prompt however long it sleeps.

Timing is only ever bounded from one side: load can delay a round, never make
one happen, so "no round before X" and "a round within a generous bound" are
the assertions.
"""
from __future__ import annotations

import gc
import time

import pytest

from torch_reccl._native import testing as load_testing

pytestmark = pytest.mark.timeout(60)

T = load_testing()
LONG_MS = 60_000  # a quiet tick no test waits for
BOUND = 10.0      # seconds: generous, for a loaded machine


@pytest.fixture
def supervisor():
    made = []

    def make(tick_ms=20, quiet_tick_ms=LONG_MS):
        s = T.Supervisor(tick_ms=tick_ms, quiet_tick_ms=quiet_tick_ms)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def settle(item, supervisor):
    """Waits until the rounds that adding `item` started are over."""
    assert item.wait_rounds(1, BOUND)
    while True:
        count = len(item.rounds())
        time.sleep(0.2)
        if len(item.rounds()) == count:
            return count


def test_adding_an_item_starts_a_round(supervisor):
    s = supervisor()
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    assert item.wait_rounds(1, BOUND)


def test_quiet_items_let_it_sleep_until_poked(supervisor):
    s = supervisor()
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    count = settle(item, s)
    time.sleep(0.5)
    assert len(item.rounds()) == count, "a quiet supervisor ran a round nobody asked for"
    poked_at = T.steady_now_ns()
    s.poke()
    assert item.wait_rounds(count + 1, BOUND)
    assert item.rounds()[count] >= poked_at


def test_a_busy_item_keeps_it_ticking(supervisor):
    s = supervisor(tick_ms=20)
    item = T.SupervisedItem()  # not quiet: a deadline may be pending
    s.add(item)
    assert item.wait_rounds(5, BOUND), "a busy item was not serviced again without pokes"
    rounds = item.rounds()
    # Never faster than the tick when nobody pokes (the first round is the add's).
    gaps = [b - a for a, b in zip(rounds[1:], rounds[2:])]
    assert min(gaps) >= 15_000_000, gaps


def test_the_quiet_tick_is_a_safety_net(supervisor):
    s = supervisor(quiet_tick_ms=300)
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    assert item.wait_rounds(3, BOUND), "no round at the quiet tick"
    rounds = item.rounds()
    assert rounds[2] - rounds[1] >= 250_000_000


def test_wake_by_bounds_a_quiet_sleep(supervisor):
    s = supervisor()
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    count = settle(item, s)
    due = T.steady_now_ns() + 200_000_000
    s.wake_by(due)
    s.wake_by(due + 5_000_000_000)  # a later wake does not postpone the earlier one
    assert item.wait_rounds(count + 1, BOUND), "wakeBy did not end the quiet sleep"
    assert item.rounds()[count] >= due - 1_000_000  # the wait rounds to the clock's ms
    # Each wakeBy lasts one round: the supervisor sleeps again afterwards.
    time.sleep(0.5)
    assert len(item.rounds()) == count + 1


def test_a_failing_round_is_survived_and_retried_at_the_tick(supervisor):
    s = supervisor(tick_ms=20)
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    count = settle(item, s)
    item.fail_next_round()
    s.poke()
    # The failed round counts as not quiet: the next one follows at the tick,
    # without a poke, though the item says it is quiet.
    assert item.wait_rounds(count + 2, BOUND)
    time.sleep(0.5)
    settled = len(item.rounds())
    s.poke()
    assert item.wait_rounds(settled + 1, BOUND), "the supervisor stopped after a failing round"


def test_items_whose_owner_is_gone_are_reaped(supervisor):
    s = supervisor()
    base = s.items()  # the grey detector's item rides on every supervisor
    kept, dropped = T.SupervisedItem(), T.SupervisedItem()
    kept.quiet = dropped.quiet = True
    s.add(kept)
    s.add(dropped)
    assert s.items() == base + 2
    del dropped
    gc.collect()
    assert s.items() == base + 1
    count = len(kept.rounds())
    s.poke()
    assert kept.wait_rounds(count + 1, BOUND)  # the live item is still served


def test_closing_a_sleeping_supervisor_is_prompt(supervisor):
    s = T.Supervisor(tick_ms=20, quiet_tick_ms=LONG_MS)
    item = T.SupervisedItem()
    item.quiet = True
    s.add(item)
    settle(item, s)
    started = time.monotonic()
    s.close()
    assert time.monotonic() - started < BOUND / 2
    with pytest.raises(Exception, match="closed"):
        s.poke()

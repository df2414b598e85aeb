"""DCR's rule and the per-op agreement it rides on, without a network.

The end-to-end behaviour (switching at the same op on every rank through real
faults) is tested in tests/fabric/test_training_fabric.py; these pin the rules that
make it deterministic: every rank applies advancePlan to the same agreed
inputs, and the agreement's merge gives the same bytes whatever order
recursive doubling merges the ranks in.
"""
from __future__ import annotations

import random

import pytest

from torch_reccl._native import native

_C = native()
ProtocolError = _C.ProtocolError

ALL_REDUCE, BROADCAST = 1, 2


def test_a_new_agreed_set_makes_a_plan_that_starts_after_the_offset():
    start = (0, 0, 0)
    switched, current, pending = _C._dcr_advance_plan(start, None, 0b10, 7, 3)
    assert switched is None and current == start and pending == (1, 10, 0b10)
    switched, current, pending = _C._dcr_advance_plan(current, pending, 0b10, 9, 3)
    assert switched is None and pending == (1, 10, 0b10)      # not due yet
    switched, current, pending = _C._dcr_advance_plan(current, pending, 0b10, 10, 3)
    assert switched == (1, 10, 0b10) == current and pending is None


def test_offset_zero_switches_at_the_agreeing_op():
    switched, current, pending = _C._dcr_advance_plan((0, 0, 0), None, 0b1, 5, 0)
    assert switched == (1, 5, 0b1) == current and pending is None
    # healed: back to every channel, a newer plan id
    switched, current, _ = _C._dcr_advance_plan(current, None, 0, 6, 0)
    assert switched == (2, 6, 0) == current


def test_a_pending_plan_is_dropped_or_replaced_when_the_agreement_changes():
    _, current, pending = _C._dcr_advance_plan((0, 0, 0), None, 0b1, 1, 5)
    _, current, pending2 = _C._dcr_advance_plan(current, pending, 0, 2, 5)
    assert pending2 is None and current == (0, 0, 0)          # healed before it started
    _, current, pending3 = _C._dcr_advance_plan(current, pending, 0b11, 2, 5)
    assert pending3 == (1, 7, 0b11)                            # the newer set wins, later start


def test_avoided_channels_carry_no_data():
    ranges = _C._dcr_plan_weights(0b0010, 4, 3000)
    assert ranges[1][1] == 0
    assert sum(count for _, count in ranges) == 3000
    assert [count for _, count in ranges] == [1000, 0, 1000, 1000]
    offsets = [off for off, _ in ranges]
    assert offsets == sorted(offsets)  # contiguous, in channel order


def test_avoiding_every_channel_keeps_equal_shares():
    assert [c for _, c in _C._dcr_plan_weights(0b1111, 4, 400)] == [100, 100, 100, 100]


def random_merge_order(n, rng):
    """Merge steps (into, from): every rank's state folds into state 0 along a random tree."""
    alive = list(range(n))
    steps = []
    while len(alive) > 1:
        a, b = rng.sample(alive, 2)
        if b == 0:
            a, b = b, a
        steps.append((a, b))
        alive.remove(b)
    return steps


@pytest.mark.parametrize("n", [2, 3, 7, 16, 33])
def test_every_merge_order_gives_the_same_bytes(n):
    rng = random.Random(n)
    ops = [(5, ALL_REDUCE, 100, -1)] * n
    ops[n - 1] = (5, BROADCAST, 100, 0)            # the last rank called something else
    if n > 3:
        ops[n // 2] = (5, ALL_REDUCE, 101, -1)     # and a middle one another count
    faults = [(rng.randrange(100), 0, 0) for _ in range(n)]
    for r in rng.sample(range(n), min(n, 11)):   # more degraded ranks than are listed
        faults[r] = (faults[r][0], 1 << (r % 3), 1 << (r % 2))
    results = {_C._agreement_fold(n, ops, faults, random_merge_order(n, rng)) for _ in range(20)}
    assert len(results) == 1, "merge order changed the agreement"
    d = _C._agreement_decode(results.pop(), n)
    odd = n // 2 if n > 3 else n - 1
    assert (d["first_rank"], d["odd_rank"]) == (0, odd)
    assert "rank 0 called all_reduce(float32, 100 elements" in d["mismatch"]
    assert f"but rank {odd} called" in d["mismatch"]
    degraded = [r for r in range(n) if faults[r][1] or faults[r][2]]
    assert d["degraded_ranks"] == len(degraded)
    assert [x[0] for x in d["listed"]] == degraded[:8]
    assert d["max_ops_done"] == max(f[0] for f in faults)
    backup = 0
    for f in faults:
        backup |= f[1]
    assert d["backup_channels"] == backup


def test_agreeing_ranks_have_no_mismatch():
    n = 5
    ops = [(2, ALL_REDUCE, 8, -1)] * n
    d = _C._agreement_decode(_C._agreement_fold(n, ops, [(0, 0, 0)] * n, random_merge_order(n, random.Random(1))), n)
    assert d["odd_rank"] == -1 and d["mismatch"] is None and d["degraded_ranks"] == 0


SCATTER = 7
LIST_LENGTH, ELEMENT_COUNT = 1, 2


@pytest.mark.parametrize("n", [2, 3, 7, 16])
def test_a_rejection_is_named_alike_whatever_the_merge_order(n):
    """Ranks that reject their own arguments: every merge order names the lowest
    of them (rank 0's own, or the lowest that differs from rank 0's op)."""
    rng = random.Random(100 + n)
    ops = [(4, SCATTER, 8, n - 1)] * n
    short = (LIST_LENGTH, "scatter_list", -1, n - 1, n)
    for rejecting in ({n - 1: short}, {0: short},
                      {0: short, n - 1: (ELEMENT_COUNT, "scatter_list", 1, 3, 8)}):
        results = {_C._agreement_fold(n, ops, [(0, 0, 0)] * n, random_merge_order(n, rng), rejecting)
                   for _ in range(10)}
        assert len(results) == 1, "merge order changed the agreement"
        d = _C._agreement_decode(results.pop(), n)
        named = min(rejecting)
        assert d["mismatch"].startswith(f"reccl: invalid arguments in process group 'g' at op #4: rank {named} "
                                        f"called scatter(float32, 8 elements, root={n - 1}) but its ")
        assert f"scatter_list has {n - 1} entr" in d["mismatch"], d["mismatch"]


def test_equal_rejections_on_every_rank_still_fail():
    n = 3
    d = _C._agreement_decode(_C._agreement_fold(
        n, [(0, SCATTER, 2, 0)] * n, [(0, 0, 0)] * n, [(0, 1), (0, 2)],
        {r: (ELEMENT_COUNT, "scatter_list", 0, 1, 2) for r in range(n)}), n)
    assert d["odd_rank"] == -1
    assert "rank 0 called scatter" in d["mismatch"] and "scatter_list[0] has 1 elements, expected 2" in d["mismatch"]


def test_bad_rejections_are_refused_with_a_reason():
    raw = _C._agreement_fold(2, [(0, SCATTER, 1, 0)] * 2, [(0, 0, 0)] * 2, [(0, 1)],
                             {0: (LIST_LENGTH, "scatter_list", -1, 1, 2)})
    assert "scatter_list has 1 entry, expected 2" in _C._agreement_decode(raw, 2)["mismatch"]
    reason = 80 + 69  # the first descriptor's rejection reason, then its argument's name
    bad = bytearray(raw)
    bad[reason] = 99
    with pytest.raises(ProtocolError, match="unknown rejection reason 99"):
        _C._agreement_decode(bytes(bad), 2)
    bad = bytearray(raw)
    bad[reason + 1:reason + 5] = b"Bad!"
    with pytest.raises(ProtocolError, match="names no valid argument"):
        _C._agreement_decode(bytes(bad), 2)


@pytest.mark.parametrize("cut", [0, 3, 4, 100, 591])
def test_truncated_agreements_are_rejected(cut):
    raw = _C._agreement_fold(2, [(0, ALL_REDUCE, 1, -1)] * 2, [(0, 0, 0)] * 2, [(0, 1)])
    with pytest.raises(ProtocolError, match="truncated"):
        _C._agreement_decode(raw[:cut], 2)


def test_bad_agreements_are_rejected_with_a_reason():
    good = _C._agreement_fold(3, [(0, ALL_REDUCE, 1, -1)] * 3, [(0, 1, 0), (0, 0, 0), (0, 1, 0)],
                              [(0, 1), (0, 2)])
    assert _C._agreement_decode(good, 3)["degraded_ranks"] == 2
    with pytest.raises(ProtocolError, match="bad magic"):
        _C._agreement_decode(b"XXXX" + good[4:], 3)
    with pytest.raises(ProtocolError, match="outside a group of 1"):
        _C._agreement_decode(good, 1)                 # two degraded ranks in a group of one
    listed_rank_of_second = 80 + 2 * 96 + 40       # second listed entry's rank field
    bad = bytearray(good)
    bad[listed_rank_of_second:listed_rank_of_second + 4] = (0).to_bytes(4, "little")
    with pytest.raises(ProtocolError, match="out of order"):
        _C._agreement_decode(bytes(bad), 3)

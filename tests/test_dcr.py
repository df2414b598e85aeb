"""DCR's decisions and the control plane's store encodings, without a network.

The end-to-end behaviour (switching at the same op on every rank through real
faults) is tested in tests/test_training_fabric.py; these pin the rules that
make it deterministic and the validation of what the control plane reads back
from the store.
"""
from __future__ import annotations

import pytest

from torch_reccl._native import native

_C = native()
ProtocolError = _C.ProtocolError


def test_a_plan_starts_only_when_due_and_newer():
    none = (0, 0, 0)
    plan1 = (1, 10, 0b10)
    assert _C._dcr_plan_to_adopt(0, [none, none], 9) is None
    assert _C._dcr_plan_to_adopt(0, [none, plan1], 9) is None          # not due yet
    assert _C._dcr_plan_to_adopt(0, [none, plan1], 10) == plan1        # due
    assert _C._dcr_plan_to_adopt(1, [plan1, plan1], 12) is None        # already in force


def test_a_rank_that_learned_late_is_carried_along():
    # Only one rank knew of the plan when its op came; every rank sees the same
    # descriptors, so every rank computes the same answer.
    plan1 = (1, 10, 0b10)
    for carried in ([plan1, (0, 0, 0), (0, 0, 0)], [(0, 0, 0), (0, 0, 0), plan1]):
        assert _C._dcr_plan_to_adopt(0, carried, 15) == plan1


def test_the_newest_due_plan_wins():
    plan1, plan2, plan3 = (1, 10, 0b10), (2, 12, 0), (3, 50, 0b1)
    assert _C._dcr_plan_to_adopt(0, [plan1, plan2, plan3], 12) == plan2
    assert _C._dcr_plan_to_adopt(0, [plan1, plan3], 12) == plan1


def test_avoided_channels_carry_no_data():
    ranges = _C._dcr_plan_weights(0b0010, 4, 3000)
    assert ranges[1][1] == 0
    assert sum(count for _, count in ranges) == 3000
    assert [count for _, count in ranges] == [1000, 0, 1000, 1000]
    offsets = [off for off, _ in ranges]
    assert offsets == sorted(offsets)  # contiguous, in channel order


def test_avoiding_every_channel_keeps_equal_shares():
    assert [c for _, c in _C._dcr_plan_weights(0b1111, 4, 400)] == [100, 100, 100, 100]


def test_group_view_round_trip():
    degraded = [(0, 5, 0b1, 0b1, 7), (2, 4, 0b1, 0, 0)]
    raw = _C._encode_group_view(3, 2, 9, 0b1, 5, degraded)
    assert _C._decode_group_view(raw, 3) == (3, 2, 9, 0b1, 5, degraded)


@pytest.mark.parametrize("cut", [0, 3, 4, 20, 47])
def test_truncated_views_are_rejected(cut):
    raw = _C._encode_group_view(1, 1, 1, 1, 1, [(0, 1, 1, 0, 0)])
    with pytest.raises(ProtocolError, match="truncated"):
        _C._decode_group_view(raw[:cut], 2)


def test_bad_views_are_rejected_with_a_reason():
    good = _C._encode_group_view(1, 1, 1, 1, 1, [(1, 1, 1, 0, 0)])
    with pytest.raises(ProtocolError, match="bad magic"):
        _C._decode_group_view(b"XXXX" + good[4:], 2)
    with pytest.raises(ProtocolError, match="trailing"):
        _C._decode_group_view(good + b"\0", 2)
    with pytest.raises(ProtocolError, match="names rank 1 of a group of 1"):
        _C._decode_group_view(good, 1)
    many = _C._encode_group_view(1, 1, 1, 1, 1, [(0, 1, 1, 0, 0), (1, 1, 1, 0, 0)])
    with pytest.raises(ProtocolError, match="lists 2 degraded ranks in a group of 1"):
        _C._decode_group_view(many, 1)

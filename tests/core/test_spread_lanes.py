"""The spreading scheduler alone (csrc/core/spread.cc, through the test binding):
how chunks are shared between lanes by static factor (a degraded NIC's goodput
ratio, the PCI distance from the primary's NIC) and by measured goodput. The
end-to-end checks are tests/transport/test_spread.py and tests/fabric/test_spread_fabric.py."""
from __future__ import annotations

import pytest

from torch_reccl._native import testing as load_testing

_testing = load_testing()  # SpreadLanes, spread_distance_factor

CHUNK = 64 << 10


def shares(lanes, slots, chunks, acks_per_ms=None, picks_per_ms=8):
    """Picks `chunks` chunks, `picks_per_ms` per ms of a test clock; with
    `acks_per_ms` ({slot: chunks per ms}) each lane's outstanding chunks are
    acknowledged at its own rate (demand above capacity: queues build)."""
    count = {s: 0 for s in slots}
    queued = {s: 0 for s in slots}
    now_ms = 0
    for i in range(chunks):
        slot = lanes.pick(CHUNK, now_ms)
        count[slot] += 1
        queued[slot] += 1
        if acks_per_ms and (i + 1) % picks_per_ms == 0:
            now_ms += 1
            for s, rate in acks_per_ms.items():
                done = min(queued[s], rate)
                if done:
                    lanes.acked(s, done * CHUNK, now_ms)
                    queued[s] -= done
    return {s: count[s] / chunks for s in slots}


def test_the_distance_factor_follows_design_costs():
    assert _testing.spread_distance_factor(0) == 1.0
    assert _testing.spread_distance_factor(100) == pytest.approx(0.5)   # across the host bridge
    assert _testing.spread_distance_factor(200) == pytest.approx(1 / 3)  # another NUMA node
    assert _testing.spread_distance_factor(-5) == 1.0


def test_static_factors_split_unmeasured_lanes():
    lanes = _testing.SpreadLanes()
    # a NIC on the primary's switch, one across the host bridge, one on the other NUMA node
    factors = [1.0, _testing.spread_distance_factor(100), _testing.spread_distance_factor(200)]
    lanes.reset([1, 2, 3], factors)
    got = shares(lanes, [1, 2, 3], 1100)
    total = sum(factors)
    for slot, factor in zip([1, 2, 3], factors):
        assert got[slot] == pytest.approx(factor / total, abs=0.01), got


def test_a_degraded_nics_weight_scales_its_share():
    lanes = _testing.SpreadLanes()
    lanes.reset([0, 1], [1.0, 0.25])  # lane 1's NIC was degraded at 25% of its peers
    got = shares(lanes, [0, 1], 1000)
    assert got[1] == pytest.approx(0.2, abs=0.01)


def test_measured_goodput_moves_chunks_to_the_faster_lane():
    lanes = _testing.SpreadLanes()
    lanes.reset([0, 1], [1.0, 1.0])
    # offered 8 chunks per ms, lane 0 acknowledges 3 and lane 1 one: by outstanding
    # bytes alone lane 0 would get 5/8; weighted by the measured goodput (3:1), 3/4
    got = shares(lanes, [0, 1], 8000, acks_per_ms={0: 3, 1: 1})
    assert 0.70 <= got[0] <= 0.80, got

"""Shares sized by usable bandwidth end to end in the emulated fabric (root): 4
hosts x 4 rails under a back-to-back all_reduce of floats whose sums change with
the summation order, RECCL_SHARES=proportional; host 0 loses NIC 0. Every rank switches to the same
smaller share for host 0 (the rebalance event), host 0's NICs then send less
than each other host's, and every result stays bit-identical to the run's
first, fault-free one. The rank program and driver are
torch_reccl/bench/grey_fabric.py's, which bench/shares_fabric.py measures with."""
from __future__ import annotations

import time

import pytest

from torch_reccl.bench import grey_fabric
from torch_reccl.fabric import require_root

HOSTS = 4
SHARES = "shares by rank: 0.100 0.300 0.300 0.300"


@pytest.fixture(autouse=True)
def _root():
    require_root()


def _sent(tick: dict) -> int:
    return sum(n["sent"] for n in tick["nics"].values())


def _sent_per_op(ticks, start, end):
    """Bytes the host's NICs sent per all_reduce between its first and last tick in
    [start, end] (per op: each rank's ticks fall at its own times)."""
    inside = [t for t in ticks if start <= t["t"] <= end]
    assert len(inside) >= 2 and inside[-1]["ops"] > inside[0]["ops"], f"no ops between {start} and {end}"
    return (_sent(inside[-1]) - _sent(inside[0])) / (inside[-1]["ops"] - inside[0]["ops"])


@pytest.mark.timeout(120)
def test_a_host_with_a_nic_down_gets_a_smaller_share_and_the_bits_stay():
    marks = {}

    def plan(fabric, state) -> bool:
        ticks = state["ticks"][0]
        now = time.time()
        if "fault" not in marks and ticks and ticks[-1]["ops"] >= 3 and now - state["t0"] >= 2.0:
            marks["fault"] = time.time()  # before: the ranks may see it while nic_down waits
            fabric.nic_down(0, 0)
        return "fault" in marks and now >= marks["fault"] + 6.0

    # 8 MiB: above the halving range at 4 ranks (1 MiB x 4), so the large all_reduce runs.
    state = grey_fabric.run_scenario(rails=4, rate_mbit=1000, env={"RECCL_SHARES": "proportional"},
                                     plan=plan, hosts=HOSTS,
                                     size_bytes=8 << 20, max_seconds=60, name_prefix="p",
                                     order_sensitive=True)
    assert state["exit_codes"] == [0] * HOSTS, state["logs"]
    for rank in range(HOSTS):
        final = state["ticks"][rank][-1]
        assert final["final"] and final["wrong"] == 0, f"rank {rank}: {final['wrong']} elements differ"
        assert final["ops"] > 10
        switched = [e for e in state["events"] if e["rank"] == rank and e["ev"] == "rebalance"
                    and e["detail"].startswith(SHARES)]
        assert switched, f"rank {rank} never switched to the shares: {state['events']}"
        assert switched[0]["t"] >= marks["fault"]
    # Host 0 reduces a third as much as the others: it sends S + 2 (0.1 S) against
    # S + 2 (0.3 S) (equal shares: 1.5 S each).
    start, end = marks["fault"] + 2.0, state["ticks"][0][-1]["t"]
    host0 = _sent_per_op(state["ticks"][0], start, end)
    others = [_sent_per_op(state["ticks"][r], start, end) for r in range(1, HOSTS)]
    assert host0 < 0.85 * min(others), f"host 0 sent {host0:.0f} bytes per op, the others {others}"

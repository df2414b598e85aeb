"""Grey failures end to end in the emulated fabric (root): a NIC slowed with tbf
under load is marked degraded, traffic moves off it with every byte right, and
it recovers after the heal; a fabric that is uniformly slow and bursty raises
no `degraded` event. The rank program and driver are torch_reccl/bench/grey_fabric.py's,
which bench/grey_fabric.py measures with."""
from __future__ import annotations

import time

import pytest

from torch_reccl.bench import grey_fabric
from torch_reccl.fabric import require_root

DETECT_BOUND_S = 6.0    # RECCL_GREY_MS (2 s) + sampling + DCR: well inside this
RECOVER_BOUND_S = 20.0  # trial after RECCL_GREY_RETRY_MS, then RECCL_GREY_MS of good goodput


@pytest.fixture(autouse=True)
def _root():
    require_root()


def _sent(tick: dict, nic: str) -> int:
    return tick["nics"][nic]["sent"]


def _share(ticks, nic, start, end):
    """The share of rank 0's acknowledged bytes that left by `nic` between two times."""
    inside = [t for t in ticks if start <= t["t"] <= end]
    assert len(inside) >= 2, f"no ticks between {start} and {end}"
    first, last = inside[0], inside[-1]
    total = sum(_sent(last, n) - _sent(first, n) for n in last["nics"])
    assert total > 0, "no bytes moved in the window"
    return (_sent(last, nic) - _sent(first, nic)) / total


def _events(state, kind, nic="eth1"):
    return [e for e in state["events"] if e["ev"] == kind and e["nic"] == nic]


@pytest.mark.timeout(150)
def test_slow_nic_is_degraded_traffic_moves_off_and_comes_back():
    marks = {}

    def plan(fabric, state) -> bool:
        now = time.time()
        if "fault" not in marks and now - state["t0"] >= 3.0:
            fabric.slow(0, 1, 10)
            marks["fault"] = time.time()
        if "fault" not in marks:
            return False
        degraded = _events(state, "degraded")
        if not degraded:
            return now > marks["fault"] + DETECT_BOUND_S  # give up: the asserts say why
        marks.setdefault("degraded", min(e["t"] for e in degraded))
        if "heal" not in marks and now >= marks["degraded"] + 2.5:
            fabric.slow(0, 1, on=False)
            marks["heal"] = time.time()
        if "heal" not in marks:
            return False
        recovered = [e for e in _events(state, "recovered") if e["rank"] == 0]
        if recovered:
            marks.setdefault("recovered", recovered[0]["t"])
            return now >= marks["recovered"] + 2.0
        return now > marks["heal"] + RECOVER_BOUND_S

    # The heartbeat at 8 s: this tests the detector. At 1 s, the rate cut sometimes
    # collapses TCP on the pair for a second and the heartbeat fails it over first
    # (a real failover, reason timeout, tested elsewhere; docs/grey_failures.md);
    # at 4 s a loaded CI VM still lost that race twice in ~10 runs.
    env = {"RECCL_GREY_RETRY_MS": "3000", "RECCL_HEARTBEAT_MS": "8000"}
    state = grey_fabric.run_scenario(rails=2, rate_mbit=1000, env=env, plan=plan, max_seconds=60)
    assert state["exit_codes"] == [0, 0], state["logs"]
    finals = [state["ticks"][r][-1] for r in (0, 1)]
    assert all(t["final"] and t["wrong"] == 0 for t in finals), finals  # every element checked
    assert all(t["ops"] > 20 for t in finals)

    degraded = _events(state, "degraded")
    assert degraded, f"no degraded event within {DETECT_BOUND_S} s of the fault: {state['events']}"
    first = min(e["t"] for e in degraded)
    assert 0 < first - marks["fault"] <= DETECT_BOUND_S
    assert {e["rank"] for e in degraded} >= {0}
    assert all(e["reason"] == "slow" and "goodput" in e["detail"] for e in degraded)
    # nothing else was ever called degraded
    assert not [e for e in state["events"] if e["ev"] == "degraded" and e["nic"] != "eth1"]

    ticks = state["ticks"][0]
    before = _share(ticks, "eth1", state["t0"] + 1.0, marks["fault"])
    assert 0.3 <= before <= 0.7, f"eth1 carried {before:.2f} of the bytes before the fault"
    during = _share(ticks, "eth1", marks["degraded"] + 0.5, marks["heal"])
    assert during < 0.03, f"eth1 still carried {during:.2f} of the bytes while degraded"
    assert any(t["nics"]["eth1"]["grey"] == "degraded" for t in ticks)

    assert "recovered" in marks, f"no recovered event within {RECOVER_BOUND_S} s of the heal: " \
                                 f"{state['events']}"
    failbacks = [e for e in state["events"] if e["ev"] == "failback" and e["t"] > marks["degraded"]]
    assert failbacks, "traffic never failed back to eth1"
    after = _share(ticks, "eth1", marks["recovered"], ticks[-1]["t"])
    assert after >= 0.25, f"eth1 carried only {after:.2f} of the bytes after it recovered"
    assert ticks[-1]["nics"]["eth1"]["grey"] == "healthy"


@pytest.mark.timeout(150)
def test_without_dcr_spreading_moves_traffic_off_a_nic_slow_from_the_start():
    """RECCL_DCR=0, RECCL_SPREAD=on, 4 rails: host 0's eth1 is slowed before the
    ranks start, so it never had a fast history of its own and, in the lockstep
    ring, its fast peers idle in most windows while it is judged (a detector
    that compared it with its own slow history would read it healthy and leave
    busbw at 0.11-0.15 of fault-free). It is degraded, both
    ranks' connections of channel 1 stripe over the other three NICs, eth1
    carries nothing more, and every element of every result is right."""
    marks = {}

    def plan(fabric, state) -> bool:
        degraded = _events(state, "degraded")
        if degraded:
            marks.setdefault("degraded", min(e["t"] for e in degraded))
            return time.time() >= marks["degraded"] + 3.0
        # the ranks' start (seconds on a loaded box) is not the detector's time:
        # count from their first op done (t0), which ran on the slow NIC already
        return time.time() > state["t0"] + DETECT_BOUND_S + 2.0  # the asserts say why

    env = {"RECCL_DCR": "0", "RECCL_SPREAD": "on", "RECCL_HEARTBEAT_MS": "8000"}
    state = grey_fabric.run_scenario(rails=4, rate_mbit=1000, env=env, plan=plan, max_seconds=40,
                                     before=lambda fabric: fabric.slow(0, 1, 10))
    assert state["exit_codes"] == [0, 0], state["logs"]
    finals = [state["ticks"][r][-1] for r in (0, 1)]
    assert all(t["final"] and t["wrong"] == 0 for t in finals), finals  # every element checked
    degraded = _events(state, "degraded")
    assert "degraded" in marks, f"no degraded event within {DETECT_BOUND_S} s: {state['events']}"
    assert state["faults"][0][1] < state["t0"] and marks["degraded"] - state["t0"] <= DETECT_BOUND_S
    # Either end of the slow path may condemn it first; its failover then
    # moves both directions off eth1, and the other end, left with nothing to
    # measure there, may never raise its own event (a two-host fabric cannot
    # tell which end is slow).
    assert all(e["reason"] == "slow" and "peer NICs' median" in e["detail"] for e in degraded), degraded
    assert not [e for e in state["events"] if e["ev"] == "degraded" and e["nic"] != "eth1"]
    assert not [e for e in state["events"] if e["ev"] == "rebalance"]  # DCR is off
    nics = [f"eth{i}" for i in range(4)]
    for rank in (0, 1):  # both directions: each rank's channel-1 sender moved
        ticks = state["ticks"][rank]
        # the final tick (the only one after the stop op) may follow the other
        # rank's teardown, which closes the lanes
        after = [t for t in ticks if t["t"] >= marks["degraded"] + 0.5 and not t["final"]]
        start, end = after[0], after[-1]
        sent = {n: end["nics"][n]["sent"] - start["nics"][n]["sent"] for n in nics}
        total = sum(sent.values())
        assert total > 0, sent
        assert sent["eth1"] / total < 0.03, f"rank {rank}: eth1 still carried {sent}"
        # its own channel and a third of eth1's each: a third of all
        assert all(0.2 <= sent[n] / total <= 0.45 for n in nics if n != "eth1"), (rank, sent)
        assert ["eth0", "eth2", "eth3"] in end["spreading"], (rank, end["spreading"])


@pytest.mark.timeout(120)
def test_uniformly_slow_bursty_fabric_raises_no_degraded_event():
    marks = {}

    def plan(fabric, state) -> bool:
        now = time.time() - state["t0"]
        if "slow" not in marks and now >= 2.0:
            for host in (0, 1):
                for rail in (0, 1):
                    fabric.slow(host, rail, 30)  # every NIC alike: no NIC is worse than its peers
            marks["slow"] = time.time()
        return now >= 10.0

    state = grey_fabric.run_scenario(rails=2, rate_mbit=1000, env={}, plan=plan, bursty=True,
                                     max_seconds=40)
    assert state["exit_codes"] == [0, 0], state["logs"]
    assert all(state["ticks"][r][-1]["wrong"] == 0 for r in (0, 1))
    ticks = state["ticks"][0]
    # the detector had load to judge: every NIC carried more than RECCL_GREY_MIN_BYTES
    # (1 MiB) per 250 ms window on average while the whole fabric was slow
    start = [t for t in ticks if t["t"] <= marks["slow"]][-1]
    windows = (ticks[-1]["t"] - start["t"]) / 0.25
    for nic in ("eth0", "eth1"):
        per_window = (ticks[-1]["nics"][nic]["busy_bytes"] - start["nics"][nic]["busy_bytes"]) / windows
        assert per_window > 1 << 20, f"{nic}: only {per_window / 1e6:.2f} MB per window"
    grey = [e for e in state["events"] if e["ev"] in ("degraded", "recovered")]
    assert grey == [], f"a healthy (uniformly slow, bursty) fabric raised {grey}"
    assert all(n["grey"] == "healthy" for t in ticks for n in t["nics"].values())

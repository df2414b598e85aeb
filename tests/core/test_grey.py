"""The grey-failure detector's logic (csrc/core/grey_detector.cc), fed with
synthetic per-NIC counters through the test binding: load, sustained duration,
hysteresis, the trial of a degraded NIC, and no flapping on noise. The end-to-end
check with a real slow NIC is tests/fabric/test_grey_fabric.py."""
from __future__ import annotations

import random

import pytest

from torch_reccl._native import testing as load_testing
from torch_reccl.transport import _C, ConfigError

_testing = load_testing()  # GreyDetector

WINDOW_NS = 250_000_000
MB_PER_NS = 1e6 / 1e9  # 1 MB/s in bytes per ns
SETTINGS = {"low_ratio": 0.25, "recover_ratio": 0.5, "sustain_ms": 2000, "min_bytes": 1 << 20,
            "retry_ms": 10000}


class Feed:
    """Cumulative counters of N NICs; each window, NIC i moves at rates[i] MB/s while busy."""

    def __init__(self, nics: int, **settings):
        self.detector = _testing.GreyDetector({**SETTINGS, **settings})
        self.bytes = [0] * nics
        self.busy = [0] * nics
        self.now = 10 * WINDOW_NS
        self.detector.sample(self.now, self._samples())  # the baseline sample

    def _samples(self):
        return [(b, t, True) for b, t in zip(self.bytes, self.busy)]

    def window(self, rates, busy_share=1.0):
        """One window; a rate of None: the NIC carried nothing."""
        self.now += WINDOW_NS
        for i, rate in enumerate(rates):
            if rate is None:
                continue
            busy = int(WINDOW_NS * busy_share)
            self.busy[i] += busy
            self.bytes[i] += int(rate * MB_PER_NS * busy)
        return self.detector.sample(self.now, self._samples())

    def run(self, rates, windows, **kw):
        changes = []
        for _ in range(windows):
            changes += self.window(rates, **kw)
        return changes


def test_a_nic_far_below_its_peers_for_the_sustained_time_is_degraded():
    feed = Feed(4)
    assert feed.run([100, 100, 100, 100], 20) == []
    # 2 s of busy time at 10% of the peers' median: 8 windows, and not one fewer
    assert feed.run([100, 10, 100, 100], 7) == []
    (change,) = feed.window([100, 10, 100, 100])
    assert change["nic"] == 1 and change["state"] == "degraded" and change["announce"]
    assert change["ratio"] == pytest.approx(0.1, rel=0.01)
    assert "of its peer NICs' median" in change["detail"]
    assert feed.detector.state(1) == "degraded" and feed.detector.state(0) == "healthy"
    # degraded: it carries nothing now, and nothing more is said until its trial
    assert feed.run([100, None, 100, 100], 20) == []


def test_the_reference_is_the_peers_median_not_the_mean_and_not_itself():
    feed = Feed(2)
    # two NICs: the slow one's reference is the other one alone
    changes = feed.run([100, 20], 8)
    assert [(c["nic"], c["state"]) for c in changes] == [(1, "degraded")]
    feed = Feed(5)
    # one fast outlier does not drag the median: 30 of a median 100 is no fault
    assert feed.run([100, 30, 100, 100, 1000], 40) == []


def test_without_load_nothing_counts_and_nothing_is_forgotten():
    feed = Feed(2)
    # a window below RECCL_GREY_MIN_BYTES says nothing: 0.5 MB in 250 ms
    assert feed.run([100, 1], 40) == []  # 1 MB/s * 0.25 s: far below 1 MiB
    # busy time is what counts: light windows in between neither advance nor reset
    assert feed.run([100, 10], 6) == []
    assert feed.run([None, None], 30) == []
    assert [c["state"] for c in feed.run([100, 10], 2)] == ["degraded"]


def test_one_good_window_restarts_the_count():
    feed = Feed(2)
    assert feed.run([100, 10], 7) == []
    assert feed.window([100, 90]) == []
    assert feed.run([100, 10], 7) == []
    assert [c["state"] for c in feed.window([100, 10])] == ["degraded"]


def test_hysteresis_between_the_thresholds_is_no_fault():
    feed = Feed(3)
    assert feed.run([100, 30, 100], 100) == []  # 30%: above 25%, so never degraded


def test_noise_never_flaps():
    rng = random.Random(7)
    feed = Feed(4)
    for _ in range(2000):
        rates = [100 * rng.uniform(0.5, 1.5) for _ in range(4)]
        # bursty: some windows light, some NICs idle, busy time anywhere in (0, 1]
        rates = [r if rng.random() > 0.2 else None for r in rates]
        assert feed.window(rates, busy_share=rng.uniform(0.05, 1.0)) == []
    assert all(feed.detector.state(i) == "healthy" for i in range(4))


def test_a_degraded_nic_goes_on_trial_and_recovers_after_sustained_good_goodput():
    feed = Feed(3)
    assert [c["state"] for c in feed.run([100, 10, 100], 8)] == ["degraded"]
    # RECCL_GREY_RETRY_MS (10 s = 40 windows) of carrying nothing, then the trial
    assert feed.run([100, None, 100], 39) == []
    (trial,) = feed.window([100, None, 100])
    assert trial["state"] == "probation" and not trial["announce"]
    # on trial at 60%: above the recover ratio for 2 s of busy time
    assert feed.run([100, 60, 100], 7) == []
    (back,) = feed.window([100, 60, 100])
    assert back["state"] == "healthy" and back["announce"] and "recovered" in back["detail"]
    assert feed.detector.ratio(1) == pytest.approx(0.6, rel=0.01)


def test_a_failed_trial_is_silent_and_waits_twice_as_long():
    feed = Feed(2)
    feed.run([100, 10], 8)
    feed.run([100, None], 40)  # the trial starts
    assert feed.detector.state(1) == "probation"
    # 40%: not low enough to degrade a healthy NIC, but not a recovery either
    changes = feed.run([100, 40], 8)
    assert [(c["state"], c["announce"]) for c in changes] == [("degraded", False)]
    assert feed.run([100, None], 79) == []  # 20 s now
    assert [c["state"] for c in feed.window([100, None])] == ["probation"]


def test_a_connection_without_a_path_puts_a_degraded_nic_on_trial_at_once():
    feed = Feed(3)
    assert [c["state"] for c in feed.run([100, 10, 100], 8)] == ["degraded"]
    assert feed.run([100, None, 100], 4) == []  # 1 s of the 10 s wait
    feed.detector.last_resort()
    (trial,) = feed.window([100, None, 100])
    assert trial["nic"] == 1 and trial["state"] == "probation" and not trial["announce"]
    # asked once, answered once: a later window changes nothing by itself
    assert feed.run([100, None, 100], 4) == []


def test_a_degraded_nic_without_link_stays_degraded_at_the_last_resort():
    feed = Feed(3)
    feed.run([100, 10, 100], 8)
    feed.detector.last_resort()
    feed.now += WINDOW_NS
    assert feed.detector.sample(feed.now, [(b, t, i != 1) for i, (b, t) in
                                           enumerate(zip(feed.bytes, feed.busy))]) == []
    assert feed.detector.state(1) == "degraded"


def test_busy_time_held_up_by_an_outage_counts_only_the_window():
    """A message stuck for 10 s while its peer's host was down is acknowledged in
    the window after the outage, with 10 s of busy time: not a slow NIC."""
    feed = Feed(2)
    assert feed.run([100, 100], 20) == []
    for _ in range(2):  # two such windows in a row: still under 2 s of busy time
        feed.now += WINDOW_NS
        feed.busy[0] += WINDOW_NS
        feed.bytes[0] += int(100 * MB_PER_NS * WINDOW_NS)
        feed.busy[1] += 10_000_000_000
        feed.bytes[1] += 2 << 20
        assert feed.detector.sample(feed.now, feed._samples()) == []
    assert feed.run([100, 100], 8) == []
    assert feed.detector.state(1) == "healthy"


def test_a_nic_whose_peers_are_idle_is_compared_with_its_own_history():
    feed = Feed(2)
    assert feed.run([100, None], 20) == []
    changes = feed.run([10, None], 8)
    assert [(c["nic"], c["state"]) for c in changes] == [(0, "degraded")]
    assert "its own history" in changes[0]["detail"]
    # no history, no loaded peers: nothing to compare with, so nothing is said
    assert Feed(2).run([10, None], 40) == []


def test_peers_idle_between_their_bursts_still_count_as_the_reference():
    """A lockstep collective with one slow NIC: the fast NICs finish their share
    early and idle (no load in most windows) while the slow one is always busy.
    A peer's goodput from its last loaded window stands for it (for up to
    RECCL_GREY_MS); judged against its own history in those windows instead, a NIC
    slow from the start (so its history is slow) restarted its count every time."""
    feed = Feed(4)
    changes = []
    for w in range(10):
        peer = 100 if w % 3 == 2 else None  # the first windows: the slow NIC alone loaded
        changes += feed.window([peer, 10, peer, peer])
    assert [(c["nic"], c["state"]) for c in changes] == [(1, "degraded")]
    assert "of its peer NICs' median" in changes[0]["detail"]
    assert changes[0]["ratio"] == pytest.approx(0.1, rel=0.01)
    # a peer's measurement older than RECCL_GREY_MS (2 s) stands for nothing
    feed = Feed(2)
    assert feed.run([100, None], 1) == []
    assert feed.run([None, None], 4) == []   # 1 s idle: its rate is 1 s old
    assert feed.run([None, 10], 40) == []    # counted low for 1 s, then no reference


def test_the_last_usable_nic_is_never_degraded():
    """Its traffic would have nowhere to go (degrading it would stop every
    connection), and alone at full load it reads low against a history of short
    bursts (seen in CI: the survivor of two NICs called 7% of its history)."""
    feed = Feed(1)
    assert feed.run([100], 20) == []
    assert feed.run([10], 40) == []
    # the same once its only peer is degraded
    feed = Feed(2)
    assert [(c["nic"], c["state"]) for c in feed.run([100, 10], 12)] == [(1, "degraded")]
    assert not [c for c in feed.run([10, None], 40) if c["nic"] == 0]


def test_the_peers_verdict_on_a_shared_path_counts_as_evidence():
    """Both ends of a slow path see it; the end that condemns its NIC first moves
    the path (NOTIFY, reason slow), leaving the other end's NIC without load.
    Already low for half of RECCL_GREY_MS, that NIC is degraded on the peer's word."""
    feed = Feed(2)
    assert feed.run([100, 10], 4) == []  # 1 s of busy time at 10%: half the sustain
    feed.detector.peer_found_slow(1)
    (change,) = feed.window([100, None])  # the path moved: no load on it any more
    assert change["nic"] == 1 and change["state"] == "degraded" and change["announce"]
    assert "the peer found the path slow too" in change["detail"]
    assert change["ratio"] == pytest.approx(0.1, rel=0.01)
    # less than half the sustain below the threshold: the peer's word alone is not enough
    feed = Feed(2)
    assert feed.run([100, 10], 3) == []
    feed.detector.peer_found_slow(1)
    assert feed.run([100, None], 20) == []
    # nor for a NIC at full goodput, nor for the last usable NIC; and the word is used once
    feed = Feed(2)
    assert feed.run([100, 100], 8) == []
    feed.detector.peer_found_slow(1)
    assert feed.run([100, 100], 4) == []
    feed = Feed(1)
    feed.run([100], 20)
    feed.run([10], 6)
    feed.detector.peer_found_slow(0)
    assert feed.run([None], 4) == []


def test_a_nic_without_link_is_no_peer():
    feed = Feed(3)
    feed.now += WINDOW_NS
    # NIC 2 has lost its link: its counters are ignored, NIC 1 is judged against NIC 0
    for _ in range(8):
        feed.now += WINDOW_NS
        for i, rate in enumerate((100, 10, 5)):
            feed.busy[i] += WINDOW_NS
            feed.bytes[i] += int(rate * MB_PER_NS * WINDOW_NS)
        changes = feed.detector.sample(feed.now, [(b, t, i != 2) for i, (b, t) in
                                                  enumerate(zip(feed.bytes, feed.busy))])
    assert [(c["nic"], c["state"]) for c in changes] == [(1, "degraded")]


def test_bad_detector_settings_are_named():
    with pytest.raises(ConfigError, match="unknown setting 'low'; valid: low_ratio"):
        _testing.GreyDetector({"low": 0.1})
    for name, bad in (("RECCL_GREY_PCT", "60"), ("RECCL_GREY_RECOVER_PCT", "40")):
        with pytest.raises(ConfigError, match=name):
            _C.validate_config({name: bad})

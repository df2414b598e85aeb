"""The seeded random fault schedule of ``reccl soak``.

A schedule is a list of :class:`SoakFault`, each with a kind, its target NICs, a
start and an end. Faults arrive one after another at random gaps and may
overlap, but never on the same NIC: each fault claims the NICs it touches until
it ends. A host outage (every NIC of a host down) and a split (two hosts left
without a common rail) claim the whole fabric, so no other fault makes them
longer. The same seed and arguments give the same schedule, fault for fault.

Kinds (``--mix`` weights them; every kind the drill knows):

=========== =============================================== ===================
kind        what                                            claims
=========== =============================================== ===================
nic_down    a NIC loses link for 0.5-8 s                    that NIC
rail_down   a rail switch dies for 0.5-8 s                  the rail's NICs
flap        a NIC goes down and up 3-15 times               that NIC
blackhole   a NIC drops every frame for 0.5-8 s             that NIC
slow        a NIC runs at 10-50% of the rate for 2-20 s     that NIC
lossy       a NIC drops 1-5% of its frames for 2-20 s       that NIC
host_down   every NIC of a host down for 1 s-max outage     every NIC
split       two hosts without a common rail for 1-30 s      every NIC
=========== =============================================== ===================
"""
from __future__ import annotations

import dataclasses
import random
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

KINDS = ("nic_down", "rail_down", "flap", "blackhole", "slow", "lossy", "host_down", "split")
DEFAULT_MIX = {"nic_down": 3, "rail_down": 1, "flap": 2, "blackhole": 2, "slow": 1, "lossy": 1,
               "host_down": 1, "split": 1}
# the faults that leave some pair of hosts with no path: the fabric is theirs alone
EXCLUSIVE = ("host_down", "split")
FLAP_PERIOD_S = 0.4
RATE_KINDS = ("slow",)  # need a rate-capped fabric
Nic = Tuple[int, int]   # (host, rail)


class SoakScheduleError(ValueError):
    """Arguments no schedule can be made from."""


@dataclasses.dataclass(frozen=True)
class SoakFault:
    index: int
    kind: str
    start_s: float
    end_s: float
    host: Optional[int] = None        # nic_down, flap, blackhole, slow, lossy, host_down
    rail: Optional[int] = None        # nic_down, flap, blackhole, slow, lossy, rail_down
    hosts: Tuple[int, ...] = ()       # split: the two hosts
    rails_lost: Tuple[Tuple[int, ...], ...] = ()  # split: the rails each of them loses
    percent: Optional[float] = None   # slow: share of the rate kept; lossy: share dropped
    flaps: Optional[int] = None
    host_rails: int = 0               # host_down: how many NICs the host has

    @property
    def target(self) -> str:
        if self.kind == "rail_down":
            return f"rail{self.rail}"
        if self.kind == "host_down":
            return f"h{self.host}"
        if self.kind == "split":
            a, b = self.hosts
            return (f"h{a}(-rails {','.join(map(str, self.rails_lost[0]))}) "
                    f"h{b}(-rails {','.join(map(str, self.rails_lost[1]))})")
        return f"h{self.host}nic{self.rail}"

    def nics_down(self, hosts: int) -> List[Nic]:
        """The NICs that carry nothing while the fault holds (slow and lossy carry some)."""
        if self.kind in ("nic_down", "flap", "blackhole"):
            return [(self.host, self.rail)]
        if self.kind == "rail_down":
            return [(h, self.rail) for h in range(hosts)]
        if self.kind == "host_down":
            return [(self.host, r) for r in range(self.host_rails)]
        if self.kind == "split":
            return [(h, r) for h, lost in zip(self.hosts, self.rails_lost) for r in lost]
        return []

    def describe(self) -> str:
        extra = ""
        if self.percent is not None:
            extra = f" {self.percent:g}%"
        if self.flaps is not None:
            extra = f" x{self.flaps} every {FLAP_PERIOD_S:g} s"
        return (f"#{self.index} {self.kind}{extra} {self.target} "
                f"{self.start_s:.1f}-{self.end_s:.1f} s")

    def to_json(self) -> dict:
        out = {"index": self.index, "kind": self.kind, "target": self.target,
               "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3)}
        for key in ("host", "rail", "percent", "flaps"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.kind == "split":
            out["hosts"] = list(self.hosts)
            out["rails_lost"] = [list(r) for r in self.rails_lost]
        return out


def parse_mix(text: str) -> Dict[str, float]:
    """``nic_down=3,flap=2,...`` (kinds left out get 0); ``default`` for DEFAULT_MIX."""
    if text.strip() == "default":
        return dict(DEFAULT_MIX)
    mix: Dict[str, float] = {}
    for item in text.split(","):
        name, sep, weight = item.strip().partition("=")
        if name not in KINDS or not sep:
            raise SoakScheduleError(f"--mix {text!r}: {item.strip()!r} is not KIND=WEIGHT with "
                                    f"KIND one of {', '.join(KINDS)}")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise SoakScheduleError(f"--mix {text!r}: weight {weight!r} of {name} is not a number")
        if mix[name] < 0:
            raise SoakScheduleError(f"--mix {text!r}: weight of {name} must be >= 0")
    if not any(mix.values()):
        raise SoakScheduleError(f"--mix {text!r}: every weight is 0; give at least one kind")
    return mix


def make_schedule(seed: int, hosts: int, rails: int, start_s: float, end_s: float,
                  mix: Dict[str, float], gap_s: Tuple[float, float] = (0.5, 3.0),
                  max_outage_s: float = 60.0, rate_capped: bool = True) -> List[SoakFault]:
    """Faults starting in [start_s, end_s) and healed by end_s, from ``seed``."""
    if hosts < 2 or rails < 1:
        raise SoakScheduleError(f"a soak needs at least 2 hosts and 1 rail; got {hosts} x {rails}")
    if not 0 < gap_s[0] <= gap_s[1]:
        raise SoakScheduleError(f"fault gaps must satisfy 0 < min <= max; got {gap_s}")
    mix = {k: w for k, w in mix.items() if w > 0 and (rate_capped or k not in RATE_KINDS)
           and not (k == "split" and rails < 2)}
    if not mix:
        raise SoakScheduleError("no fault kind of the mix fits this fabric (slow needs "
                                "--rate-mbit, split needs 2 rails)")
    rng = random.Random(seed)
    kinds, weights = zip(*sorted(mix.items()))
    faults: List[SoakFault] = []
    busy: List[Tuple[float, FrozenSet[Nic]]] = []  # (end, NICs claimed)
    everything = frozenset((h, r) for h in range(hosts) for r in range(rails))
    t = start_s + rng.uniform(*gap_s)
    while t < end_s:
        busy = [(end, claimed) for end, claimed in busy if end > t]
        claimed_now = frozenset().union(*(c for _, c in busy)) if busy else frozenset()
        kind = rng.choices(kinds, weights)[0]
        if kind in EXCLUSIVE and busy:
            # the fabric is theirs alone: wait for every fault on it to heal
            t = max(end for end, _ in busy) + rng.uniform(*gap_s)
            busy = []
            claimed_now = frozenset()
        fault = None
        for _ in range(8):  # a few draws of a target that is free now
            candidate = _draw(rng, kind, len(faults), t, hosts, rails, max_outage_s)
            claims = everything if kind in EXCLUSIVE else frozenset(
                candidate.nics_down(hosts) or [(candidate.host, candidate.rail)])
            if candidate.end_s <= end_s and not (claims & claimed_now):
                fault = candidate
                break
        if fault is not None:
            faults.append(fault)
            busy.append((fault.end_s, claims))
            if kind in EXCLUSIVE:
                t = fault.end_s
        t += rng.uniform(*gap_s)
    return faults


def _draw(rng: random.Random, kind: str, index: int, t: float, hosts: int, rails: int,
          max_outage_s: float) -> SoakFault:
    host, rail = rng.randrange(hosts), rng.randrange(rails)
    if kind in ("nic_down", "blackhole"):
        return SoakFault(index, kind, t, t + rng.uniform(0.5, 8.0), host=host, rail=rail)
    if kind == "rail_down":
        return SoakFault(index, kind, t, t + rng.uniform(0.5, 8.0), rail=rail)
    if kind == "flap":
        flaps = rng.randint(3, 15)
        return SoakFault(index, kind, t, t + flaps * FLAP_PERIOD_S + 0.1, host=host, rail=rail,
                         flaps=flaps)
    if kind == "slow":
        return SoakFault(index, kind, t, t + rng.uniform(2.0, 20.0), host=host, rail=rail,
                         percent=float(rng.randint(10, 50)))
    if kind == "lossy":
        return SoakFault(index, kind, t, t + rng.uniform(2.0, 20.0), host=host, rail=rail,
                         percent=float(rng.randint(1, 5)))
    if kind == "host_down":
        return SoakFault(index, kind, t, t + rng.uniform(1.0, max_outage_s), host=host,
                         host_rails=rails)
    # split: host a keeps some rails, host b keeps the others: no rail in common
    a, b = rng.sample(range(hosts), 2)
    order = list(range(rails))
    rng.shuffle(order)
    cut = rng.randint(1, rails - 1)
    keep_a = sorted(order[:cut])
    lost_a = tuple(r for r in range(rails) if r not in keep_a)
    lost_b = tuple(keep_a)
    return SoakFault(index, kind, t, t + rng.uniform(1.0, min(30.0, max_outage_s)),
                     hosts=(a, b), rails_lost=(lost_a, lost_b))


def outages(faults: Sequence[SoakFault], hosts: int, rails: int) -> List[Tuple[float, float]]:
    """The intervals in which some pair of hosts had no rail that both could use."""
    points = sorted({f.start_s for f in faults} | {f.end_s for f in faults})
    spans: List[Tuple[float, float]] = []
    for lo, hi in zip(points, points[1:]):
        mid = (lo + hi) / 2
        down = {nic for f in faults if f.start_s <= mid < f.end_s for nic in f.nics_down(hosts)}
        usable = [{r for r in range(rails) if (h, r) not in down} for h in range(hosts)]
        cut = any(not (usable[a] & usable[b]) for a in range(hosts) for b in range(a + 1, hosts))
        if cut:
            if spans and abs(spans[-1][1] - lo) < 1e-9:
                spans[-1] = (spans[-1][0], hi)
            else:
                spans.append((lo, hi))
    return spans


def overlap_s(spans: Sequence[Tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``spans`` inside [lo, hi]."""
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)

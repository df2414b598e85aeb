"""How a scheduled fault is made real: in the emulated fabric, or by inject_fault.

:class:`FabricFaults` (root) changes the kernel's view: veths and bridges go
down, nftables drops packets (all or a share), links flap, tbf slows a NIC. :class:`InjectedFaults` (anyone)
asks each affected rank to call :func:`torch_reccl.inject_fault` on its
loopback NIC, which the transport treats like the real event. Both take a
:class:`~torch_reccl.drill.schedule.Fault` and return a line describing what
was done.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch_reccl.drill.schedule import Fault


class FabricFaults:
    def __init__(self, fabric, flap_period_s: float, flap_count: int):
        self.fabric = fabric
        self.flap_period_s = flap_period_s
        self.flap_count = flap_count
        self._flaps: Dict[Tuple[int, int], object] = {}

    def apply(self, fault: Fault) -> str:
        f, r = self.fabric, fault.rail
        hosts = fault.hosts(f.hosts)
        if fault.host is not None:
            where = f"{f.nic_name(r)} of host {fault.host} ({f.netns(fault.host)})"
        elif fault.action in ("down", "up"):
            where = f"rail switch {f.rail_bridge(r)}"
        else:
            where = f"{f.nic_name(r)} of every host"
        if fault.action == "down":
            if fault.host is None:
                f.rail_down(r)
            else:
                f.nic_down(fault.host, r)
            return f"{where} down"
        if fault.action == "up":
            if fault.host is None:
                f.rail_up(r)
            else:
                f.nic_up(fault.host, r)
            return f"{where} up"
        if fault.action == "blackhole":
            for h in hosts:
                f.blackhole(h, r)
            return f"{where}: every packet dropped (link stays up)"
        if fault.action == "flap":
            for h in hosts:
                self._stop_flap(h, r)
                self._flaps[(h, r)] = f.flap(h, r, period_s=self.flap_period_s, count=self.flap_count)
            return (f"{where} flapping: down/up every {self.flap_period_s:g} s, "
                    f"{self.flap_count} times")
        if fault.action == "slow":
            for h in hosts:
                f.slow(h, r, fault.percent)
            return (f"{where} slowed to {fault.percent:g}% of {f.rate_mbit:g} mbit/s "
                    f"(link stays up)")
        if fault.action == "lossy":
            for h in hosts:
                f.lossy(h, r, fault.percent)
            return f"{where}: {fault.percent:g}% of frames dropped each way (link stays up)"
        # heal: undo every fault on the target
        for h in hosts:
            self._stop_flap(h, r)
        if fault.host is None and r in f.faults()["rail_down"]:
            f.rail_up(r)
        current = f.faults()
        for h in hosts:
            if (h, r) in current["blackhole"]:
                f.blackhole(h, r, on=False)
            if (h, r) in current["nic_down"]:
                f.nic_up(h, r)
            if any((sh, sr) == (h, r) for sh, sr, _ in current["slow"]):
                f.slow(h, r, on=False)
            if any((lh, lr) == (h, r) for lh, lr, _ in current["lossy"]):
                f.lossy(h, r, on=False)
        return f"{where} healed"

    def _stop_flap(self, host: int, rail: int) -> None:
        flap = self._flaps.pop((host, rail), None)
        if flap is not None:
            flap.stop()

    def heal_all(self) -> None:
        for key in list(self._flaps):
            self._stop_flap(*key)
        self.fabric.heal()

    def describe(self) -> str:
        return "faults are real kernel events in the emulated fabric"


class InjectedFaults:
    """Faults by torch_reccl.inject_fault inside the ranks (loopback NICs)."""

    KIND = {"down": "down", "up": "up", "blackhole": "blackhole", "flap": "flap", "heal": "up"}
    # a slow or lossy NIC is a kernel fault (tbf, nftables): no in-process equivalent
    FABRIC_ONLY = ("slow", "lossy")

    def __init__(self, job, placement, flap_period_s: float, flap_count: int):
        self.job = job
        self.placement = placement
        self.flap_period_s = flap_period_s
        self.flap_count = flap_count

    def apply(self, fault: Fault) -> str:
        if fault.action in self.FABRIC_ONLY:
            raise ValueError(f"fault {fault.text!r}: a {fault.action} NIC needs the emulated "
                             f"fabric; inject_fault has no equivalent")
        kind = self.KIND[fault.action]
        ranks: List[int] = fault.hosts(self.placement.ranks)
        nic = self.placement.nic_names(0)[fault.rail]
        for rank in ranks:
            self.job.send(rank, {"cmd": "inject", "nic": self.placement.nic_names(rank)[fault.rail],
                                 "kind": kind, "period": self.flap_period_s, "count": self.flap_count})
        who = "every rank" if fault.host is None else f"rank {fault.host}"
        return f"inject_fault({nic!r}, {kind!r}) in {who}"

    def heal_all(self) -> None:
        pass  # injected faults live in the rank processes, which end with the run

    @staticmethod
    def describe() -> str:
        return "faults are injected in-process with torch_reccl.inject_fault"

"""An emulated rail-optimized fabric built from network namespaces (docs/design.md §11).

Topology of ``Fabric(hosts=H, rails=K, name=N)``::

    host h  = netns "reccl-N-h{h}", with lo, NICs eth0..eth{K-1}, and mgmt0
    rail r  = bridge "rcN-r{r}" in the root namespace, joining eth{r} of every host
    mgmt    = bridge "rcN-m" joining mgmt0 of every host (never faulted)
    eth{r} of host h  <-veth->  "rcN-{h}r{r}" (bridge side, port of rail r)
    mgmt0  of host h  <-veth->  "rcN-{h}m"    (bridge side, port of mgmt)

Addresses: eth{r} of host h is 198.18.{r}.{h+1}/24, mgmt0 is 198.19.0.{h+1}/24
(RFC 2544 benchmarking range), so traffic for rail r leaves by eth{r}.

Every host uses TCP congestion control ``tcp_congestion`` (cubic, Linux's
default, unless told otherwise; None keeps the namespace's default, which comes
from this machine's): results do not depend on how this machine is tuned. An
algorithm missing from net.ipv4.tcp_allowed_congestion_control is added there
and taken off again when the last fabric that needed it is torn down.

The fabric name never contains '-', so every object whose name starts with
"rcN-" (links) or "reccl-N-h" (namespaces) belongs to fabric N and to no other;
``down()`` finds everything by those prefixes, even without a state file.

Faults are real kernel events:

* ``nic_down``: the bridge-side end of the veth goes admin-down, so the host
  end loses carrier (NO-CARRIER, IFF_LOWER_UP/IFF_RUNNING cleared, a netlink
  RTM_NEWLINK event inside the host);
* ``rail_down``: the rail bridge and all its ports go down;
* ``blackhole``: an nftables ``netdev`` table inside the host's namespace drops
  every frame on eth{r}'s ingress and egress hooks (the link stays up);
* ``flap``: ``nic_down``/``nic_up`` in a loop on a background thread;
* ``slow``: the NIC's tbf (both directions) is cut to a percentage of the
  fabric rate (a grey failure: link up, most of the speed gone);
* ``lossy``: an nftables ``netdev`` table inside the host drops a random
  percentage of the frames on eth{r}'s ingress and egress hooks (``numgen
  random``; this kernel has no netem).

Only pyroute2 (netlink) and, for blackholes, the ``nft`` binary are used;
the ``ip`` command is not needed.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Dict, Iterable, List, Optional, Set, Tuple

from torch_reccl.fabric import nsexec

STATE_DIR = "/run/reccl-fabric"
NAME_RE = re.compile(r"^[a-z0-9]{1,4}$")
MAX_HOSTS = 254   # host h is .{h+1} in a /24
MAX_RAILS = 256   # rail r is 198.18.{r}.0/24
MAX_RATE_MBIT = 32000  # tbf's 32-bit rate field (bytes/s)

# how long a link change may take to show inside the host (bounded wait)
LINK_SETTLE_S = 3.0
# bounded waits for subprocesses we start ourselves
NFT_TIMEOUT_S = 10.0
# lossy: nft draws numgen random mod LOSS_SCALE, so a percentage has two decimals
LOSS_SCALE = 10000
FAULT_KEYS = ("nic_down", "rail_down", "blackhole", "slow", "lossy")
# Every host runs Linux's default TCP congestion control unless told otherwise,
# whatever this machine's own default is: measurements must not depend on it
# (docs/fabric.md has what bbr does to lock-step traffic through the tbf queue).
DEFAULT_TCP_CONGESTION = "cubic"
TCP_CONGESTION_RE = re.compile(r"^[a-z0-9_]{1,15}$")  # TCP_CA_NAME_MAX is 16 with the NUL
TCP_CONGESTION_PATH = "/proc/sys/net/ipv4/tcp_congestion_control"
TCP_CONGESTION_AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
TCP_CONGESTION_ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
TCP_CONGESTION_INHERIT = "inherit"  # command lines: keep the namespaces' own default


def tcp_congestion_arg(text: str) -> Optional[str]:
    """A command line's --tcp-congestion: an algorithm's name, or "inherit" (None)."""
    if text == TCP_CONGESTION_INHERIT:
        return None
    if not TCP_CONGESTION_RE.match(text):
        raise ValueError(f"--tcp-congestion {text!r}: want an algorithm's name (such as cubic, reno, "
                         f"bbr) or {TCP_CONGESTION_INHERIT!r} for the namespaces' own default")
    return text


def nft_command() -> Optional[str]:
    """The nft binary (Debian's nftables), also where sbin is not on PATH; None if absent."""
    return shutil.which("nft") or next(
        (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.path.exists(p)), None)


def _check_percent(what: str, percent, high: float = 100.0) -> float:
    """A percentage in (0, high): slow/lossy faults take the share as a number."""
    ok = (isinstance(percent, (int, float)) and not isinstance(percent, bool)
          and 0 < float(percent) < high)
    if not ok:
        raise ValueError(f"{what} must be a number of percent in (0, {high:g}) "
                         f"(e.g. 10 for 10%); got {percent!r}")
    return float(percent)


class FabricError(RuntimeError):
    """The fabric could not be built, changed or torn down."""


def is_root() -> bool:
    return os.geteuid() == 0


def require_root() -> None:
    """Make sure we can build fabrics (root, pyroute2 importable).

    Under pytest this skips the calling test ("needs root for network
    namespaces"); elsewhere it raises FabricError.
    """
    reason = None
    if not sys.platform.startswith("linux"):
        reason = "needs Linux network namespaces"
    elif not is_root():
        reason = "needs root for network namespaces"
    else:
        import importlib.util

        if importlib.util.find_spec("pyroute2") is None:
            reason = "needs pyroute2 (pip install pyroute2)"
    if reason is None:
        return
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise FabricError(
        f"the emulated fabric {reason}; without it, use torch_reccl.inject_fault drills"
    )


def _iproute(netns: Optional[str] = None):
    try:
        from pyroute2 import IPRoute
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise FabricError("the emulated fabric needs pyroute2 (pip install pyroute2)") from e
    if netns is None:
        return IPRoute()
    return IPRoute(netns=netns)


def _pr_netns():
    try:
        from pyroute2 import netns
    except ImportError as e:  # pragma: no cover
        raise FabricError("the emulated fabric needs pyroute2 (pip install pyroute2)") from e
    return netns


def _state_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"{name}.json")


def _lock_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"{name}.lock")


# The TCP congestion controls fabrics added to the machine-wide allowed list:
# {algorithm: {"before": the list before, "fabrics": [names that need it]}}.
# Under /run, so it survives a killed builder for `reccl fabric down` and
# vanishes on reboot along with the sysctl's change.
ALLOWED_RECORD = os.path.join(STATE_DIR, "tcp-allowed.json")


def _read_allowed(name: str) -> List[str]:
    try:
        with open(TCP_CONGESTION_ALLOWED) as f:
            return f.read().split()
    except OSError as e:
        raise FabricError(f"fabric {name!r}: cannot read {TCP_CONGESTION_ALLOWED}: {e}") from e


@contextlib.contextmanager
def _allowed_record():
    """Read-modify-write ALLOWED_RECORD under a file lock shared by every fabric
    of this machine; an empty record removes the file."""
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(ALLOWED_RECORD + ".lock", "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            try:
                with open(ALLOWED_RECORD) as f:
                    record = json.load(f)
            except FileNotFoundError:
                record = {}
            yield record
            if record:
                tmp = f"{ALLOWED_RECORD}.{os.getpid()}.{threading.get_ident()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(record, f, indent=1, sort_keys=True)
                os.replace(tmp, ALLOWED_RECORD)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ALLOWED_RECORD)
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)


def _release_allowed(name: str) -> None:
    """Fabric ``name`` no longer needs what it added to the allowed list: an
    algorithm no fabric needs any more (none left up, going by the state files)
    is taken off it again, which restores the list recorded before it was added
    unless someone else changed the list meanwhile (their change stays)."""
    if not os.path.exists(ALLOWED_RECORD):
        return
    with _allowed_record() as record:
        for algorithm in sorted(record):
            entry = record[algorithm]
            entry["fabrics"] = [f for f in entry["fabrics"]
                                if f != name and os.path.exists(_state_path(f))]
            if entry["fabrics"]:
                continue
            allowed = _read_allowed(name)
            if algorithm in allowed:
                with open(TCP_CONGESTION_ALLOWED, "w") as f:
                    f.write(" ".join(a for a in allowed if a != algorithm))
            del record[algorithm]


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"fabric name must be 1-4 characters from [a-z0-9] (it is part of every "
            f"netns and interface name, which must fit 15 chars); got {name!r}"
        )
    return name


def list_fabrics() -> List[str]:
    """Names of fabrics that have a state file."""
    try:
        names = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and NAME_RE.match(n[:-5]))


class FlapHandle:
    """A running ``Fabric.flap``: ``join(timeout) -> bool``, ``stop()``."""

    def __init__(self, fabric: "Fabric", host: int, rail: int, period_s: float, count: int):
        self.fabric, self.host, self.rail = fabric, host, rail
        self.period_s, self.count = period_s, count
        self.flaps_done = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"reccl-flap-{fabric.name}-{host}:{rail}", daemon=True
        )

    def start(self) -> "FlapHandle":
        self._thread.start()
        return self

    def _run(self) -> None:
        f, h, r = self.fabric, self.host, self.rail
        half = self.period_s / 2.0
        try:
            for _ in range(self.count):
                if self._stop.is_set():
                    break
                f._set_flap_down(h, r, True)
                if self._stop.wait(half):
                    break
                f._set_flap_down(h, r, False)
                self.flaps_done += 1
                if self._stop.wait(half):
                    break
        except BaseException as e:  # reported through .error / join()
            self.error = e
        finally:
            try:
                f._set_flap_down(h, r, False)
                f._end_flap(self)
            except BaseException as e:
                if self.error is None:
                    self.error = e

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the flapping to end; True when it has ended (link is up)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop flapping now and leave the link up; True when done in time."""
        self._stop.set()
        return self.join(timeout)

    def __repr__(self) -> str:
        st = "running" if self.running else "done"
        return (f"<FlapHandle {self.fabric.name} host {self.host} rail {self.rail} "
                f"{self.flaps_done}/{self.count} {st}>")


class Fabric:
    """An emulated rail-optimized fabric; see the module docstring."""

    def __init__(self, hosts: int = 2, rails: int = 2, rate_mbit: Optional[float] = None,
                 name: str = "f0", tcp_congestion: Optional[str] = DEFAULT_TCP_CONGESTION):
        self.name = check_name(name)
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an int in 1..{MAX_HOSTS}; got {hosts!r}")
        if not isinstance(rails, int) or isinstance(rails, bool) or not 1 <= rails <= MAX_RAILS:
            raise ValueError(f"rails must be an int in 1..{MAX_RAILS}; got {rails!r}")
        if rate_mbit is not None:
            try:
                rate_ok = 0 < float(rate_mbit) <= MAX_RATE_MBIT
            except (TypeError, ValueError):
                rate_ok = False
            if not rate_ok:
                raise ValueError(
                    f"rate_mbit must be None (no cap) or a number in (0, {MAX_RATE_MBIT}]; "
                    f"got {rate_mbit!r}")
        if tcp_congestion is not None and not (isinstance(tcp_congestion, str)
                                               and TCP_CONGESTION_RE.match(tcp_congestion)):
            raise ValueError(f"tcp_congestion must be None (each host keeps its namespace's default) "
                             f"or an algorithm's name such as 'cubic'; got {tcp_congestion!r}")
        self.hosts = hosts
        self.rails = rails
        self.rate_mbit = rate_mbit
        self.tcp_congestion = tcp_congestion
        self._lock = threading.RLock()
        self._root = None               # IPRoute in the root namespace
        self._flap_down: Set[Tuple[int, int]] = set()
        self._flaps: List[FlapHandle] = []
        self._is_up = False

    # ------------------------------------------------------------------ names
    def netns(self, host: int) -> str:
        self._check_host(host)
        return f"reccl-{self.name}-h{host}"

    def nic_name(self, rail: int) -> str:
        """Name of NIC ``rail`` inside every host: ``eth{rail}``."""
        self._check_rail(rail)
        return f"eth{rail}"

    def nic_ip(self, host: int, rail: int) -> str:
        self._check_host(host)
        self._check_rail(rail)
        return f"198.18.{rail}.{host + 1}"

    def mgmt_ip(self, host: int) -> str:
        self._check_host(host)
        return f"198.19.0.{host + 1}"

    mgmt_name = "mgmt0"

    def rail_bridge(self, rail: int) -> str:
        self._check_rail(rail)
        return f"rc{self.name}-r{rail}"

    @property
    def mgmt_bridge(self) -> str:
        return f"rc{self.name}-m"

    def port_name(self, host: int, rail: int) -> str:
        """Bridge-side end of NIC ``rail`` of ``host`` (root namespace)."""
        self._check_host(host)
        self._check_rail(rail)
        return f"rc{self.name}-{host}r{rail}"

    def mgmt_port_name(self, host: int) -> str:
        self._check_host(host)
        return f"rc{self.name}-{host}m"

    @property
    def link_prefix(self) -> str:
        return f"rc{self.name}-"

    @property
    def netns_prefix(self) -> str:
        return f"reccl-{self.name}-h"

    def _check_host(self, host) -> None:
        if not isinstance(host, int) or isinstance(host, bool) or not 0 <= host < self.hosts:
            raise ValueError(
                f"fabric {self.name!r}: host must be an int in 0..{self.hosts - 1}; got {host!r}")

    def _check_rail(self, rail) -> None:
        if not isinstance(rail, int) or isinstance(rail, bool) or not 0 <= rail < self.rails:
            raise ValueError(
                f"fabric {self.name!r}: rail must be an int in 0..{self.rails - 1}; got {rail!r}")

    def __repr__(self) -> str:
        return (f"<Fabric {self.name!r} hosts={self.hosts} rails={self.rails} "
                f"rate_mbit={self.rate_mbit} tcp_congestion={self.tcp_congestion} "
                f"{'up' if self._is_up else 'down'}>")

    # ------------------------------------------------------------ state file
    def _state(self, status: str, faults: Optional[dict] = None) -> dict:
        return {
            "name": self.name,
            "hosts": self.hosts,
            "rails": self.rails,
            "rate_mbit": self.rate_mbit,
            "tcp_congestion": self.tcp_congestion,
            "status": status,
            "pid": os.getpid(),
            "created": time.time(),
            "netns": [self.netns(h) for h in range(self.hosts)],
            "bridges": [self.rail_bridge(r) for r in range(self.rails)] + [self.mgmt_bridge],
            "faults": faults or {k: [] for k in FAULT_KEYS},
        }

    @staticmethod
    def _read_state(name: str) -> Optional[dict]:
        try:
            with open(_state_path(name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise FabricError(f"fabric {name!r}: unreadable state file {_state_path(name)}: {e}")

    def _write_state(self, state: dict) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        path = _state_path(self.name)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    @contextlib.contextmanager
    def _faults(self):
        """Read-modify-write the persisted fault sets, under a file lock, so that
        several processes (a test and the CLI) agree on which faults are set."""
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(_lock_path(self.name), "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                st = self._read_state(self.name)
                if st is None:
                    raise FabricError(f"fabric {self.name!r} is not up (no state file "
                                      f"{_state_path(self.name)})")
                faults = self._decode_faults(st.get("faults") or {})
                yield faults
                st["faults"] = {
                    "nic_down": sorted(list(x) for x in faults["nic_down"]),
                    "rail_down": sorted(faults["rail_down"]),
                    "blackhole": sorted(list(x) for x in faults["blackhole"]),
                    "slow": sorted([h, r, p] for (h, r), p in faults["slow"].items()),
                    "lossy": sorted([h, r, p] for (h, r), p in faults["lossy"].items()),
                }
                self._write_state(st)
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    @staticmethod
    def _decode_faults(raw: dict) -> dict:
        """The state file's fault lists as sets (and {(h, r): percent} maps)."""
        return {
            "nic_down": {tuple(x) for x in raw.get("nic_down", [])},
            "rail_down": set(raw.get("rail_down", [])),
            "blackhole": {tuple(x) for x in raw.get("blackhole", [])},
            "slow": {(h, r): p for h, r, p in raw.get("slow", [])},
            "lossy": {(h, r): p for h, r, p in raw.get("lossy", [])},
        }

    def faults(self) -> dict:
        """The faults currently set: {"nic_down": [(h, r)], "rail_down": [r],
        "blackhole": [(h, r)], "slow": [(h, r, percent)], "lossy": [(h, r, percent)],
        "flapping": [(h, r)]}."""
        st = self._read_state(self.name) or {}
        raw = self._decode_faults(st.get("faults") or {})
        return {
            "nic_down": sorted(raw["nic_down"]),
            "rail_down": sorted(raw["rail_down"]),
            "blackhole": sorted(raw["blackhole"]),
            "slow": sorted((h, r, p) for (h, r), p in raw["slow"].items()),
            "lossy": sorted((h, r, p) for (h, r), p in raw["lossy"].items()),
            "flapping": sorted((f.host, f.rail) for f in self._flaps if f.running),
        }

    @classmethod
    def builder_pid(cls, name: str) -> Optional[int]:
        """The pid of the process that built fabric ``name``, from its state
        file; None when there is no state file."""
        st = cls._read_state(check_name(name))
        return None if st is None else st.get("pid")

    @classmethod
    def attach(cls, name: str) -> "Fabric":
        """The fabric ``name`` built earlier (maybe by another process), from its
        state file."""
        check_name(name)
        st = cls._read_state(name)
        if st is None:
            raise FabricError(
                f"no fabric named {name!r}: no state file {_state_path(name)} "
                f"(known fabrics: {', '.join(list_fabrics()) or 'none'})")
        try:
            fab = cls(hosts=int(st["hosts"]), rails=int(st["rails"]),
                      rate_mbit=st.get("rate_mbit"), name=name,
                      tcp_congestion=st.get("tcp_congestion"))
        except (KeyError, TypeError, ValueError) as e:
            raise FabricError(f"fabric {name!r}: bad state file {_state_path(name)}: {e}")
        fab._is_up = st.get("status") == "up"
        if not os.path.exists(nsexec.netns_path(fab.netns(0))):
            raise FabricError(
                f"fabric {name!r}: state file exists but netns {fab.netns(0)!r} does not; "
                f"run `reccl fabric down --name {name}` to clean up")
        return fab

    # ------------------------------------------------------------- netlink
    def _rt(self):
        if self._root is None:
            self._root = _iproute()
        return self._root

    @contextlib.contextmanager
    def _in_ns(self, host: int):
        """A netlink socket inside host ``host``'s namespace, for one job.
        (Not kept open: an open socket would keep the namespace alive after
        ``down()`` removed its name.)"""
        ns = self._ns_check(host)
        try:
            ipr = _iproute(ns)
        except FabricError:
            raise
        except Exception as e:
            raise FabricError(f"fabric {self.name!r}: cannot open netlink in {ns}: {e}") from e
        try:
            yield ipr
        finally:
            with contextlib.suppress(Exception):
                ipr.close()

    def _close_sockets(self) -> None:
        if self._root is not None:
            with contextlib.suppress(Exception):
                self._root.close()
        self._root = None

    def _index(self, ipr, ifname: str, where: str) -> int:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            raise FabricError(f"fabric {self.name!r}: interface {ifname!r} not found in {where}"
                              f" (is the fabric up? `reccl fabric show --name {self.name}`)")
        return idx[0]

    def _set_link(self, ifname: str, up: bool) -> None:
        ipr = self._rt()
        idx = self._index(ipr, ifname, "the root namespace")
        ipr.link("set", index=idx, state="up" if up else "down")

    # ------------------------------------------------------------- build
    def __enter__(self) -> "Fabric":
        self.up()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.down()
            return
        try:
            self.down()
        except Exception as e:  # do not hide the exception that got us here
            warnings.warn(f"fabric {self.name!r}: teardown after an error failed: {e}")

    def _existing(self) -> Tuple[List[str], List[str]]:
        """(netns, root links) that carry this fabric's name now."""
        ns = [n for n in _pr_netns().listnetns() if n.startswith(self.netns_prefix)]
        with _iproute() as ipr:
            links = [link.get("ifname") for link in ipr.get_links()]
        links = [name for name in links if name and name.startswith(self.link_prefix)]
        return sorted(ns), sorted(links)

    def up(self) -> "Fabric":
        """Build the fabric. Raises FabricError (after cleaning up) on failure."""
        if not is_root():
            raise FabricError(f"fabric {self.name!r}: building a fabric needs root "
                              f"(network namespaces, veths, bridges)")
        ns, links = self._existing()
        if ns or links or os.path.exists(_state_path(self.name)):
            raise FabricError(
                f"fabric {self.name!r} already exists (netns: {ns or 'none'}, links: "
                f"{links[:6] or 'none'}{'...' if len(links) > 6 else ''}); use another name, "
                f"Fabric.attach({self.name!r}), or `reccl fabric down --name {self.name}`")
        with self._lock:
            self._write_state(self._state("building"))
            try:
                self._build()
                self._write_state(self._state("up"))
                self._is_up = True
            except BaseException as e:
                try:
                    self.down()
                except Exception as e2:
                    warnings.warn(f"fabric {self.name!r}: cleanup after failed build: {e2}")
                if isinstance(e, FabricError):
                    raise FabricError(f"{e} (everything built so far was removed)") from e
                if not isinstance(e, Exception):
                    raise
                raise FabricError(f"fabric {self.name!r}: building failed ({e}); "
                                  f"everything built so far was removed") from e
        return self

    def _build(self) -> None:
        self._check_tcp_congestion()
        pns = _pr_netns()
        ipr = self._rt()
        br_opts = dict(kind="bridge", br_stp_state=0, br_forward_delay=0,
                       br_nf_call_iptables=0, br_nf_call_ip6tables=0,
                       br_nf_call_arptables=0)
        bridges = {}
        for br in [self.rail_bridge(r) for r in range(self.rails)] + [self.mgmt_bridge]:
            self._step(f"creating bridge {br}", ipr.link, "add", ifname=br, **br_opts)
            bridges[br] = self._index(ipr, br, "the root namespace")
            ipr.link("set", index=bridges[br], state="up")

        for h in range(self.hosts):
            nsname = self.netns(h)
            self._step(f"creating netns {nsname}", pns.create, nsname)
            if self.tcp_congestion is not None:
                self._step(f"TCP congestion control {self.tcp_congestion} in {nsname}",
                           nsexec.write_file_in, nsname, TCP_CONGESTION_PATH, self.tcp_congestion)
            nics = [(self.port_name(h, r), self.nic_name(r), self.rail_bridge(r),
                     f"{self.nic_ip(h, r)}", True) for r in range(self.rails)]
            nics.append((self.mgmt_port_name(h), self.mgmt_name, self.mgmt_bridge,
                         self.mgmt_ip(h), False))
            for port, inner, br, _, _ in nics:
                self._step(f"creating veth {port} <-> {nsname}:{inner}", ipr.link, "add",
                           ifname=port, kind="veth",
                           peer={"ifname": inner, "net_ns_fd": nsname})
                pidx = self._index(ipr, port, "the root namespace")
                ipr.link("set", index=pidx, master=bridges[br])
                if self.rate_mbit is not None and inner != self.mgmt_name:
                    self._step(f"tbf on {port}", self._tbf, ipr, pidx)
                ipr.link("set", index=pidx, state="up")
            with self._in_ns(h) as nsr:
                lo = self._index(nsr, "lo", nsname)
                nsr.link("set", index=lo, state="up")
                for _, inner, _, ip, capped in nics:
                    idx = self._index(nsr, inner, nsname)
                    self._step(f"address {ip}/24 on {nsname}:{inner}", nsr.addr, "add",
                               index=idx, address=ip, prefixlen=24)
                    if self.rate_mbit is not None and capped:
                        self._step(f"tbf on {nsname}:{inner}", self._tbf, nsr, idx)
                    nsr.link("set", index=idx, state="up")
        # wait (bounded) until every host NIC reports carrier
        self._wait_links({(h, r): True for h in range(self.hosts) for r in range(self.rails)})
        self._selfcheck()

    def _check_tcp_congestion(self) -> None:
        """The chosen algorithm exists, and host namespaces may default to it:
        the kernel lets a namespace other than the machine's own default only to
        an algorithm on the machine-wide allowed list (EPERM otherwise), so one
        missing from it is added (with a warning) and recorded, for
        ``cleanup()`` to take back when the last fabric needing it goes."""
        if self.tcp_congestion is None:
            return
        try:
            with open(TCP_CONGESTION_AVAILABLE) as f:
                available = f.read().split()
        except OSError as e:
            raise FabricError(f"fabric {self.name!r}: cannot read the kernel's TCP congestion "
                              f"controls to check tcp_congestion {self.tcp_congestion!r}: {e}") from e
        if self.tcp_congestion not in available:
            raise FabricError(f"fabric {self.name!r}: TCP congestion control {self.tcp_congestion!r} "
                              f"is not available in this kernel; available: {', '.join(available)}")
        with _allowed_record() as record:
            allowed = _read_allowed(self.name)
            entry = record.get(self.tcp_congestion)
            if self.tcp_congestion in allowed:
                if entry is not None and self.name not in entry["fabrics"]:
                    entry["fabrics"].append(self.name)  # added for another fabric still up
                return
            wanted = " ".join(allowed + [self.tcp_congestion])
            try:
                with open(TCP_CONGESTION_ALLOWED, "w") as f:
                    f.write(wanted)
            except OSError as e:
                raise FabricError(
                    f"fabric {self.name!r}: the hosts cannot use TCP congestion control "
                    f"{self.tcp_congestion!r}: a network namespace may only default to one in "
                    f"net.ipv4.tcp_allowed_congestion_control ({' '.join(allowed)}), and adding "
                    f"it failed ({e}); allow it (sysctl -w net.ipv4.tcp_allowed_congestion_control="
                    f"'{wanted}') or keep the machine's default (tcp_congestion=None, "
                    f"--tcp-congestion inherit)") from e
            if entry is None:
                record[self.tcp_congestion] = {"before": " ".join(allowed), "fabrics": [self.name]}
            else:  # taken off the list by hand while fabrics that added it were up
                entry["fabrics"].append(self.name)
        warnings.warn(f"fabric {self.name!r}: added {self.tcp_congestion} to "
                      f"net.ipv4.tcp_allowed_congestion_control (now '{wanted}'), the machine-wide "
                      f"list a host namespace may default to, until the last fabric that needs it "
                      f"is torn down (`reccl fabric down`); unprivileged programs may choose it "
                      f"meanwhile")

    def _selfcheck(self, timeout: float = 2.0) -> None:
        """UDP from host 0 to host 1 over every rail and mgmt: catches a host
        firewall that drops bridged traffic before anyone relies on the fabric."""
        if self.hosts < 2:
            return
        import socket

        pns = _pr_netns()
        targets = {f"rail {r} ({self.nic_ip(1, r)})": self.nic_ip(1, r)
                   for r in range(self.rails)}
        targets[f"mgmt ({self.mgmt_ip(1)})"] = self.mgmt_ip(1)
        rx = pns.create_socket(self.netns(1), socket.AF_INET, socket.SOCK_DGRAM)
        tx = pns.create_socket(self.netns(0), socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rx.bind(("0.0.0.0", 0))
            port = rx.getsockname()[1]
            missing = dict(targets)
            deadline = time.monotonic() + timeout
            next_send = 0.0
            while missing and time.monotonic() < deadline:
                if time.monotonic() >= next_send:
                    for label, ip in missing.items():
                        tx.sendto(label.encode(), (ip, port))
                    next_send = time.monotonic() + 0.2
                rx.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
                try:
                    data = rx.recv(256)
                except socket.timeout:
                    continue
                missing.pop(data.decode(errors="replace"), None)
        finally:
            rx.close()
            tx.close()
        if missing:
            hint = _bridge_netfilter_note() or "is something filtering bridged traffic?"
            raise FabricError(
                f"fabric {self.name!r}: self-check failed: host 0 cannot reach host 1 over "
                f"{', '.join(missing)} within {timeout:.0f}s; {hint}")

    def _step(self, what: str, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except FabricError:
            raise
        except Exception as e:
            raise FabricError(f"fabric {self.name!r}: {what} failed: {e}") from e

    def _tbf(self, ipr, idx: int, percent: float = 100.0, action: str = "add") -> None:
        rate_bps = float(self.rate_mbit) * 1e6 / 8.0 * percent / 100.0  # bytes/s
        # burst: ~4 ms at rate, at least 32 KiB (one GSO super-packet fits, so tbf
        # never has to segment the common case); queue: ~20 ms at rate, >= 256 KiB
        burst = int(max(32 * 1024, rate_bps * 0.004))
        limit = int(max(256 * 1024, rate_bps * 0.02)) + burst
        ipr.tc(action, "tbf", idx, handle=0x10000, rate=int(rate_bps),
               burst=burst, limit=limit)

    def _set_nic_rate(self, host: int, rail: int, percent: float) -> None:
        """Both tbfs of NIC ``rail`` of ``host`` (host egress and the bridge
        port's egress, i.e. the host's ingress) at ``percent`` of the fabric rate."""
        port = self.port_name(host, rail)
        try:
            self._tbf(self._rt(), self._index(self._rt(), port, "the root namespace"),
                      percent, "replace")
            with self._in_ns(host) as nsr:
                self._tbf(nsr, self._index(nsr, self.nic_name(rail), self.netns(host)),
                          percent, "replace")
        except FabricError:
            raise
        except Exception as e:
            raise FabricError(f"fabric {self.name!r}: setting host {host} rail {rail} to "
                              f"{percent:g}% of {self.rate_mbit:g} mbit/s failed: {e}") from e

    def nic_rate_mbit(self, host: int, rail: int) -> float:
        """The rate the kernel's tbf on host ``host``'s eth{rail} (egress) has now."""
        self._check_host(host)
        self._check_rail(rail)
        if self.rate_mbit is None:
            raise FabricError(f"fabric {self.name!r} has no rate cap (built without rate_mbit)")
        with self._in_ns(host) as nsr:
            idx = self._index(nsr, self.nic_name(rail), self.netns(host))
            for q in nsr.get_qdiscs(index=idx):
                if q.get_attr("TCA_KIND") == "tbf":
                    parms = q.get_nested("TCA_OPTIONS", "TCA_TBF_PARMS")
                    return parms["rate"] * 8 / 1e6
        raise FabricError(f"fabric {self.name!r}: no tbf on host {host} {self.nic_name(rail)}")

    # ------------------------------------------------------------- teardown
    def down(self) -> None:
        """Remove everything of this fabric (also a half-built one). Idempotent."""
        flaps = list(self._flaps)
        for fl in flaps:  # outside the lock: a flap thread takes it to finish
            fl._stop.set()
        for fl in flaps:
            fl.join(2.0)
        with self._lock:
            self._flaps.clear()
            self._flap_down.clear()
            self._close_sockets()
            self.cleanup(self.name)
            self._is_up = False

    @classmethod
    def cleanup(cls, name: str) -> None:
        """Remove every object carrying fabric name ``name`` (netns, links,
        state file), whether or not a state file exists; kills processes still
        running inside its namespaces. Raises FabricError naming what is left."""
        check_name(name)
        if not is_root():
            raise FabricError(f"fabric {name!r}: tearing down a fabric needs root")
        pns = _pr_netns()
        ns_prefix, link_prefix = f"reccl-{name}-h", f"rc{name}-"
        namespaces = [n for n in pns.listnetns() if n.startswith(ns_prefix)
                      and n[len(ns_prefix):].isdigit()]
        _kill_ns_processes(namespaces)
        errors = []
        with _iproute() as ipr:
            links = [(link["index"], link.get("ifname"), link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND"))
                     for link in ipr.get_links()]
            mine = [x for x in links if x[1] and x[1].startswith(link_prefix)]
            # veths first (deleting one end deletes the other, inside the netns),
            # then the bridges
            mine.sort(key=lambda x: x[2] == "bridge")
            for idx, ifname, _ in mine:
                try:
                    ipr.link("del", index=idx)
                except Exception as e:
                    if getattr(e, "code", None) != errno.ENODEV:
                        errors.append(f"link {ifname}: {e}")
        for n in namespaces:
            try:
                pns.remove(n)
            except FileNotFoundError:
                pass
            except Exception as e:
                errors.append(f"netns {n}: {e}")
        for p in (_state_path(name), _lock_path(name)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        try:
            _release_allowed(name)
        except (OSError, ValueError, FabricError) as e:
            errors.append(f"net.ipv4.tcp_allowed_congestion_control: {e}")
        left_ns = [n for n in pns.listnetns() if n.startswith(ns_prefix)]
        with _iproute() as ipr:
            left_links = [link.get("ifname") for link in ipr.get_links()
                          if (link.get("ifname") or "").startswith(link_prefix)]
        if errors or left_ns or left_links:
            raise FabricError(
                f"fabric {name!r}: teardown incomplete; left: netns {left_ns}, links "
                f"{left_links}; errors: {errors}")

    # ------------------------------------------------------------- processes
    def _ns_check(self, host: int) -> str:
        ns = self.netns(host)
        if not os.path.exists(nsexec.netns_path(ns)):
            raise FabricError(f"fabric {self.name!r}: netns {ns!r} of host {host} does not "
                              f"exist (is the fabric up?)")
        return ns

    def popen(self, host: int, argv, **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace (with its own /sys)."""
        ns = self._ns_check(host)
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of arguments, not a string")
        fd = nsexec.open_netns(ns)
        try:
            popen_kwargs["preexec_fn"] = nsexec.make_preexec(
                fd, ns, then=popen_kwargs.get("preexec_fn"))
            return subprocess.Popen(list(argv), **popen_kwargs)
        finally:
            os.close(fd)

    def run(self, host: int, argv, timeout: float = 60, check: bool = False,
            input=None, capture_output: bool = True, text: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``host`` and wait at most ``timeout`` seconds
        (then kill it and raise subprocess.TimeoutExpired)."""
        if capture_output:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        with self.popen(host, argv, text=text, **kw) as p:
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate(timeout=5)
                raise subprocess.TimeoutExpired(p.args, timeout, output=out, stderr=err)
            except BaseException:
                p.kill()
                raise
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    # ------------------------------------------------------------- faults
    def _desired_port_up(self, faults: dict, host: int, rail: int) -> bool:
        return ((host, rail) not in faults["nic_down"] and rail not in faults["rail_down"]
                and (host, rail) not in self._flap_down)

    def _apply_port(self, faults: dict, host: int, rail: int) -> bool:
        up = self._desired_port_up(faults, host, rail)
        self._set_link(self.port_name(host, rail), up)
        return up

    def _host_link(self, nsr, host: int, rail: int) -> dict:
        idx = self._index(nsr, self.nic_name(rail), self.netns(host))
        link = nsr.get_links(idx)[0]
        return {
            "carrier": bool(link.get("IFLA_CARRIER")),
            "operstate": link.get("IFLA_OPERSTATE"),
            "flags": link["flags"],
        }

    def _wait_links(self, want: Dict[Tuple[int, int], bool], timeout: float = LINK_SETTLE_S):
        """Wait until each host NIC (h, r) has carrier == want[(h, r)] and an
        operstate that agrees (UP / not UP)."""
        deadline = time.monotonic() + timeout
        for host in sorted({h for h, _ in want}):
            pending = {r: up for (h, r), up in want.items() if h == host}
            with self._in_ns(host) as nsr:
                while True:
                    for rail, up in list(pending.items()):
                        st = self._host_link(nsr, host, rail)
                        if st["carrier"] == up and (st["operstate"] == "UP") == up:
                            del pending[rail]
                    if not pending:
                        break
                    if time.monotonic() > deadline:
                        bad = ", ".join(f"eth{r} want {'up' if u else 'down'}"
                                        for r, u in sorted(pending.items()))
                        raise FabricError(
                            f"fabric {self.name!r}: links of host {host} did not settle "
                            f"within {timeout:.1f}s: {bad}")
                    time.sleep(0.01)

    def nic_down(self, host: int, rail: int, wait: bool = True) -> None:
        """Host ``host`` loses link on NIC ``rail`` (its veth peer goes down)."""
        self._check_host(host)
        self._check_rail(rail)
        with self._lock, self._faults() as faults:
            faults["nic_down"].add((host, rail))
            self._apply_port(faults, host, rail)
        if wait:
            self._wait_links({(host, rail): False})

    def nic_up(self, host: int, rail: int, wait: bool = True) -> None:
        """Undo ``nic_down`` (the link comes back unless its rail is down)."""
        self._check_host(host)
        self._check_rail(rail)
        with self._lock, self._faults() as faults:
            faults["nic_down"].discard((host, rail))
            up = self._apply_port(faults, host, rail)
        if wait:
            self._wait_links({(host, rail): up})

    def _set_flap_down(self, host: int, rail: int, down: bool) -> None:
        with self._lock:
            if down:
                self._flap_down.add((host, rail))
            else:
                self._flap_down.discard((host, rail))
            faults = self._faults_snapshot()
            self._apply_port(faults, host, rail)

    def _end_flap(self, handle: FlapHandle) -> None:
        with self._lock:
            if handle in self._flaps:
                self._flaps.remove(handle)

    def _faults_snapshot(self) -> dict:
        st = self._read_state(self.name) or {}
        return self._decode_faults(st.get("faults") or {})

    def flap(self, host: int, rail: int, period_s: float = 0.2, count: int = 10) -> FlapHandle:
        """Take NIC ``rail`` of ``host`` down and up ``count`` times, each state
        lasting ``period_s / 2``, on a background thread; it ends with the link
        up. Returns a handle with ``.join(timeout)`` and ``.stop()``."""
        self._check_host(host)
        self._check_rail(rail)
        if not (isinstance(period_s, (int, float)) and 0.002 <= period_s <= 3600):
            raise ValueError(f"period_s must be in [0.002, 3600] seconds; got {period_s!r}")
        if not isinstance(count, int) or not 1 <= count <= 1_000_000:
            raise ValueError(f"count must be an int in 1..1000000; got {count!r}")
        with self._lock:
            for fl in self._flaps:
                if (fl.host, fl.rail) == (host, rail) and fl.running:
                    raise FabricError(f"fabric {self.name!r}: host {host} rail {rail} is "
                                      f"already flapping; stop() it first")
            # flapping ends with the link up: it clears a nic_down on that NIC
            with self._faults() as faults:
                faults["nic_down"].discard((host, rail))
            handle = FlapHandle(self, host, rail, float(period_s), count)
            self._flaps.append(handle)
        return handle.start()

    def rail_down(self, rail: int, wait: bool = True) -> None:
        """Rail switch ``rail`` dies: its bridge and every port go down."""
        self._check_rail(rail)
        with self._lock, self._faults() as faults:
            faults["rail_down"].add(rail)
            for h in range(self.hosts):
                self._apply_port(faults, h, rail)
            self._set_link(self.rail_bridge(rail), False)
        if wait:
            self._wait_links({(h, rail): False for h in range(self.hosts)})

    def rail_up(self, rail: int, wait: bool = True) -> None:
        """Undo ``rail_down`` (NICs that are down by themselves stay down)."""
        self._check_rail(rail)
        with self._lock, self._faults() as faults:
            faults["rail_down"].discard(rail)
            self._set_link(self.rail_bridge(rail), True)
            want = {(h, rail): self._apply_port(faults, h, rail) for h in range(self.hosts)}
        if wait:
            self._wait_links(want)

    @staticmethod
    def _bh_table(rail: int) -> str:
        return f"reccl_bh_eth{rail}"

    def _nft(self, host: int, script: str) -> None:
        nft = nft_command()
        if nft is None:
            raise FabricError("blackholes and lossy NICs need the nft command "
                              "(apt-get install -y nftables)")
        try:
            cp = self.run(host, [nft, "-f", "-"], input=script, timeout=NFT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FabricError(f"fabric {self.name!r}: nft in host {host} timed out "
                              f"after {NFT_TIMEOUT_S}s")
        if cp.returncode != 0:
            raise FabricError(f"fabric {self.name!r}: nft in host {host} failed "
                              f"(rc {cp.returncode}): {cp.stderr.strip()}\nscript:\n{script}")

    def _bh_script(self, rail: int, on: bool) -> str:
        t, dev = self._bh_table(rail), self.nic_name(rail)
        # "add; delete" first makes it idempotent on nft versions without "destroy"
        s = f"add table netdev {t}\ndelete table netdev {t}\n"
        if on:
            s += (f"table netdev {t} {{\n"
                  f"  chain in {{ type filter hook ingress device \"{dev}\" priority -500; "
                  f"policy drop; }}\n"
                  f"  chain out {{ type filter hook egress device \"{dev}\" priority -500; "
                  f"policy drop; }}\n"
                  f"}}\n")
        return s

    def blackhole(self, host: int, rail: int, on: bool = True) -> None:
        """Silently drop every frame in and out of NIC ``rail`` of ``host``
        (nftables netdev ingress+egress hooks in the host; link stays up)."""
        self._check_host(host)
        self._check_rail(rail)
        with self._lock, self._faults() as faults:
            self._nft(host, self._bh_script(rail, on))
            if on:
                faults["blackhole"].add((host, rail))
            else:
                faults["blackhole"].discard((host, rail))

    def blackholes_in_kernel(self, host: int) -> List[int]:
        """Rails of ``host`` that have a blackhole table in the kernel now."""
        self._check_host(host)
        nft = nft_command()
        if nft is None:
            return []
        cp = self.run(host, [nft, "list", "tables"], timeout=NFT_TIMEOUT_S)
        rails = []
        for line in cp.stdout.splitlines():
            m = re.match(r"table netdev reccl_bh_eth(\d+)$", line.strip())
            if m:
                rails.append(int(m.group(1)))
        return sorted(rails)

    def slow(self, host: int, rail: int, percent: float = 10.0, on: bool = True) -> None:
        """A grey failure: NIC ``rail`` of ``host`` keeps its link but carries only
        ``percent`` of the fabric rate, both directions (tbf rate cut).
        ``on=False`` gives it the full rate back."""
        self._check_host(host)
        self._check_rail(rail)
        if on:
            percent = _check_percent("slow: percent of the fabric rate", percent)
        if self.rate_mbit is None:
            raise FabricError(
                f"fabric {self.name!r}: a slow NIC needs a rate-capped fabric (build it with "
                f"rate_mbit=..., `reccl fabric up --rate-mbit M`); this one has no tbf to cut")
        with self._lock, self._faults() as faults:
            self._set_nic_rate(host, rail, percent if on else 100.0)
            if on:
                faults["slow"][(host, rail)] = percent
            else:
                faults["slow"].pop((host, rail), None)

    @staticmethod
    def _loss_table(rail: int) -> str:
        return f"reccl_loss_eth{rail}"

    def _loss_script(self, rail: int, percent: Optional[float]) -> str:
        t, dev = self._loss_table(rail), self.nic_name(rail)
        s = f"add table netdev {t}\ndelete table netdev {t}\n"
        if percent is not None:
            below = int(round(percent * LOSS_SCALE / 100.0))
            rule = f"numgen random mod {LOSS_SCALE} < {below} drop"
            s += (f"table netdev {t} {{\n"
                  f"  chain in {{ type filter hook ingress device \"{dev}\" priority -400; "
                  f"policy accept; {rule}; }}\n"
                  f"  chain out {{ type filter hook egress device \"{dev}\" priority -400; "
                  f"policy accept; {rule}; }}\n"
                  f"}}\n")
        return s

    def lossy(self, host: int, rail: int, percent: float = 5.0, on: bool = True) -> None:
        """NIC ``rail`` of ``host`` drops ``percent`` of its frames at random, in
        each direction (nftables netdev ingress+egress, ``numgen random``; the
        link stays up). ``on=False`` stops the loss."""
        self._check_host(host)
        self._check_rail(rail)
        if on:
            percent = _check_percent("lossy: percent of frames dropped", percent)
            if int(round(percent * LOSS_SCALE / 100.0)) == 0:
                raise ValueError(f"lossy: percent must be at least {100.0 / LOSS_SCALE:g} "
                                 f"(the resolution of the random draw); got {percent!r}")
        with self._lock, self._faults() as faults:
            self._nft(host, self._loss_script(rail, percent if on else None))
            if on:
                faults["lossy"][(host, rail)] = percent
            else:
                faults["lossy"].pop((host, rail), None)

    def heal(self, wait: bool = True) -> None:
        """Undo every fault: stop flapping, all links up, no blackholes, full
        rate, no loss."""
        with self._lock:
            flaps = list(self._flaps)
        for fl in flaps:
            fl.stop()
        with self._lock, self._faults() as faults:
            faults["nic_down"].clear()
            faults["rail_down"].clear()
            faults["blackhole"].clear()
            self._flap_down.clear()
            for h, r in sorted(faults["slow"]):
                self._set_nic_rate(h, r, 100.0)
            faults["slow"].clear()
            faults["lossy"].clear()
            for r in range(self.rails):
                self._set_link(self.rail_bridge(r), True)
            for h in range(self.hosts):
                for r in range(self.rails):
                    self._apply_port(faults, h, r)
            if shutil.which("nft"):
                for h in range(self.hosts):
                    self._nft(h, "".join(self._bh_script(r, False) + self._loss_script(r, None)
                                         for r in range(self.rails)))
        if wait:
            self._wait_links({(h, r): True for h in range(self.hosts)
                              for r in range(self.rails)})

    # ------------------------------------------------------------- report
    def show(self) -> dict:
        """Live state: per host, per NIC carrier/operstate/ip/blackhole, and the
        slow/lossy percentages set (None when not set)."""
        faults = self.faults()
        slow = {(h, r): p for h, r, p in faults["slow"]}
        lossy = {(h, r): p for h, r, p in faults["lossy"]}
        hosts = []
        for h in range(self.hosts):
            bh = set(self.blackholes_in_kernel(h))
            nics = []
            with self._in_ns(h) as nsr:
                links = [self._host_link(nsr, h, r) for r in range(self.rails)]
            for r, st in enumerate(links):
                nics.append({"nic": self.nic_name(r), "ip": self.nic_ip(h, r),
                             "carrier": st["carrier"], "operstate": st["operstate"],
                             "blackhole": r in bh, "slow_pct": slow.get((h, r)),
                             "lossy_pct": lossy.get((h, r))})
            hosts.append({"host": h, "netns": self.netns(h), "mgmt_ip": self.mgmt_ip(h),
                          "nics": nics})
        return {"name": self.name, "hosts": self.hosts, "rails": self.rails,
                "rate_mbit": self.rate_mbit, "tcp_congestion": self.tcp_congestion,
                "faults": faults, "host_state": hosts}


def _bridge_netfilter_note() -> Optional[str]:
    """A warning when bridged traffic goes through the root's iptables (Docker
    hosts load br_netfilter; a FORWARD policy of DROP then drops fabric traffic)."""
    try:
        with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
            on = f.read().strip() == "1"
    except OSError:
        return None
    if not on:
        return None
    return ("net.bridge.bridge-nf-call-iptables=1: bridged traffic passes the root "
            "namespace's iptables FORWARD chain (Docker's DROP policy drops it); set "
            "`sysctl -w net.bridge.bridge-nf-call-iptables=0` or accept forwarding on the "
            "rc* bridges")


def _kill_ns_processes(namespaces: Iterable[str], timeout: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every process living in one of ``namespaces``."""
    keys = set()
    for n in namespaces:
        with contextlib.suppress(OSError):
            st = os.stat(nsexec.netns_path(n))
            keys.add((st.st_dev, st.st_ino))
    if not keys:
        return

    def pids():
        out = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == os.getpid():
                continue
            try:
                st = os.stat(f"/proc/{p}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in keys:
                out.append(int(p))
        return out

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
        victims = pids()
        if not victims:
            return
        for p in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.02)

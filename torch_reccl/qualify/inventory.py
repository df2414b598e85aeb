"""Step 1 of ``reccl qualify``: what each host has, and what the hosts disagree on.

Per host (its lowest rank collects it): the NICs reccl will use (``RECCL_NICS`` or
discovered, as ``reccl topo`` lists them) with their link state, speed, MTU, NUMA
node and subnet from sysfs; the RDMA devices with their ports and GIDs from
``/sys/class/infiniband`` and whether libibverbs loads; the GPUs and their PCI
distance to each NIC (NVML where pynvml answers, else sysfs: ``reccl topo``'s
code); versions. Rank 0 then compares the hosts (:func:`compare`): a problem fails
the check (a NIC down, a different NIC count, an RDMA port down where the plugin
runs over IB, a host that could not list its NICs), a warning is reported (a rail
whose subnet, MTU or speed differs between hosts, the same address on two hosts).
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

SIOCGIFNETMASK = 0x891B
SYSFS_NET = "/sys/class/net"
SYSFS_IB = "/sys/class/infiniband"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def netmask(interface: str) -> Optional[str]:
    """The interface's IPv4 netmask (of its primary address), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def subnet(address: str, interface: str) -> Optional[str]:
    mask = netmask(interface)
    if mask is None or not address:
        return None
    return str(ipaddress.ip_network(f"{address}/{mask}", strict=False))


def nic_rows(nics: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``torch_reccl.nics()`` rows with sysfs's view of each interface added."""
    rows = []
    for nic in nics:
        iface = nic["interface"]
        base = os.path.join(SYSFS_NET, iface)
        speed = _int_or_none(_read(os.path.join(base, "speed")))
        rows.append({
            "rail": nic["index"], "name": nic["name"], "interface": iface, "address": nic["address"],
            "up": bool(nic["up"]), "operstate": _read(os.path.join(base, "operstate")),
            # virtual interfaces (loopback, veth) have no speed; sysfs says -1 or refuses
            "speed_mbps": speed if speed is not None and speed > 0 else None,
            "mtu": _int_or_none(_read(os.path.join(base, "mtu"))),
            "numa_node": nic["numa_node"], "pci_path": nic["pci_path"],
            "subnet": subnet(nic["address"], iface), "backup": nic["backup"],
        })
    return rows


def rdma_devices(root: str = SYSFS_IB) -> List[Dict[str, Any]]:
    """Every RDMA device in sysfs with its ports (state, rate, link layer, GIDs in use)."""
    if not os.path.isdir(root):
        return []
    devices = []
    for name in sorted(os.listdir(root)):
        base = os.path.join(root, name)
        ports = []
        for port in sorted(os.listdir(os.path.join(base, "ports")) if os.path.isdir(os.path.join(base, "ports"))
                           else [], key=lambda p: int(p) if p.isdigit() else 0):
            pbase = os.path.join(base, "ports", port)
            gids = []
            gid_dir = os.path.join(pbase, "gids")
            for index in sorted(os.listdir(gid_dir) if os.path.isdir(gid_dir) else [], key=int):
                gid = _read(os.path.join(gid_dir, index))
                if not gid or set(gid.replace(":", "")) == {"0"}:
                    continue
                gids.append({"index": int(index), "gid": gid,
                             "type": _read(os.path.join(pbase, "gid_attrs", "types", index)),
                             "netdev": _read(os.path.join(pbase, "gid_attrs", "ndevs", index))})
            ports.append({"port": int(port) if port.isdigit() else port,
                          "state": _read(os.path.join(pbase, "state")),
                          "phys_state": _read(os.path.join(pbase, "phys_state")),
                          "rate": _read(os.path.join(pbase, "rate")),
                          "link_layer": _read(os.path.join(pbase, "link_layer")), "gids": gids})
        device = os.path.realpath(os.path.join(base, "device")) if os.path.exists(os.path.join(base, "device")) else ""
        devices.append({"name": name, "pci_path": device,
                        "numa_node": _int_or_none(_read(os.path.join(base, "device", "numa_node"))),
                        "ports": ports})
    return devices


def port_active(port: Dict[str, Any]) -> bool:
    return (port.get("state") or "").upper().endswith("ACTIVE")


def _verbs() -> Dict[str, Any]:
    """Whether libibverbs loads here, and which transport the plugin would choose."""
    from torch_reccl._native import native

    c = native()
    out: Dict[str, Any] = {"headers_compiled": bool(c.ib_verbs_headers_compiled())}
    try:
        out["libibverbs"] = dict(c.ib_load_system_verbs())
    except Exception as error:  # noqa: BLE001 - reported, never fatal
        out["libibverbs"] = {"loaded": False, "error": str(error), "devices": []}
    try:
        out["plugin_transport"] = dict(c.choose_transport(None, None))
    except Exception as error:  # noqa: BLE001 - RECCL_TRANSPORT=ib without devices
        out["plugin_transport"] = {"kind": None, "reason": str(error)}
    return out


def gpus(nics: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``reccl topo``'s GPU report (NVML where it answers, else sysfs)."""
    from torch_reccl import gpu_topo
    from torch_reccl.cli.topo import gpu_report

    return gpu_report(gpu_topo.discover(), nics)


def _plugin_setting() -> Dict[str, Any]:
    """NCCL_NET_PLUGIN as this process has it, and whether it names torch_reccl's plugin
    (``import torch_reccl`` sets it unless the user did)."""
    from torch_reccl._native import plugin_path
    from torch_reccl.nccl_setup import OUR_NAMES

    value = os.environ.get("NCCL_NET_PLUGIN")
    try:
        ours = plugin_path()
    except ImportError:
        ours = None
    return {"value": value, "ours": value is not None and (
        value in OUR_NAMES or (ours is not None and os.path.realpath(value) == ours))}


def collect() -> Dict[str, Any]:
    """This host's inventory. A bad RECCL_NICS (an entry that matches no local NIC)
    is reported in ``error``, naming the entry and the NICs there are."""
    from torch_reccl._native import nics as discover_nics
    from torch_reccl.qualify.job import versions

    out: Dict[str, Any] = {"hostname": socket.gethostname(), "error": None,
                           "nics_setting": os.environ.get("RECCL_NICS"), "versions": versions(),
                           "nccl_net_plugin": _plugin_setting()}
    try:
        raw = discover_nics()
    except ValueError as error:  # ConfigError: names the entry and what is there
        out["error"] = str(error)
        raw = []
    out["nics"] = nic_rows(raw)
    if not raw and out["error"] is None:
        out["error"] = ("no NIC: RECCL_NICS is unset and this host has no up, non-loopback IPv4 "
                        "interface; set RECCL_NICS to the interfaces (or addresses) of the data NICs")
    out["rdma"] = {"devices": rdma_devices(), **_verbs()}
    try:
        out["gpu"] = gpus(raw)
    except Exception as error:  # noqa: BLE001 - a GPU report must never stop the run
        out["gpu"] = {"source": None, "detail": f"GPU topology failed: {error}", "gpus": []}
    return out


def _hosts_by(values: Dict[int, Any]) -> str:
    """"10.0.0.0/24 (hosts 0, 1), 10.0.1.0/24 (host 2)" from {host: value}."""
    groups: Dict[Any, List[int]] = {}
    for host, value in sorted(values.items()):
        groups.setdefault(value, []).append(host)
    parts = []
    for value, hosts in groups.items():
        label = "hosts " if len(hosts) > 1 else "host "
        parts.append(f"{value if value is not None else 'unknown'} ({label}{', '.join(map(str, hosts))})")
    return ", ".join(parts)


def compare(hosts: List[Dict[str, Any]]) -> Tuple[List[str], List[str], int]:
    """(problems, warnings, rails both reach and failover can use) over every host's
    inventory (host index = list position)."""
    problems: List[str] = []
    warnings: List[str] = []
    for h, inv in enumerate(hosts):
        if inv.get("error"):
            problems.append(f"host {h} ({inv['hostname']}): {inv['error']}")
    usable = [inv for inv in hosts if not inv.get("error")]
    if not usable:
        return problems, warnings, 0
    counts = {h: len(inv["nics"]) for h, inv in enumerate(hosts) if not inv.get("error")}
    rails = min(counts.values())
    if len(set(counts.values())) > 1:
        problems.append(f"the hosts have different NIC counts: {_hosts_by(counts)}; NIC r of every host "
                        f"is rail r, so the rails do not line up (set RECCL_NICS alike on every host)")
    for h, inv in enumerate(hosts):
        for nic in inv["nics"]:
            if not nic["up"]:
                problems.append(f"host {h} ({inv['hostname']}): rail {nic['rail']} NIC {nic['name']} "
                                f"({nic['address']}) is down (operstate {nic['operstate']})")
    for rail in range(rails):
        at = {h: inv["nics"][rail] for h, inv in enumerate(hosts) if not inv.get("error")}
        for field, what, why in (
                ("subnet", "subnet", "traffic on this rail crosses a router, or a NIC is cabled to "
                                     "another rail's switch; reachability below says whether it connects"),
                ("mtu", "MTU", "the path runs at the smaller one"),
                ("speed_mbps", "speed (Mb/s)", "the rail runs at its slowest NIC")):
            values = {h: nic[field] for h, nic in at.items()}
            if len(set(values.values())) > 1:
                warnings.append(f"rail {rail}: the hosts disagree on the {what}: {_hosts_by(values)}; {why}")
        addresses = {h: nic["address"] for h, nic in at.items()}
        seen: Dict[str, int] = {}
        for h, address in addresses.items():
            if address in seen and not ipaddress.ip_address(address).is_loopback:
                warnings.append(f"rail {rail}: hosts {seen[address]} and {h} both have address {address}")
            seen.setdefault(address, h)
    ib_plugin = any(((inv.get("rdma") or {}).get("plugin_transport") or {}).get("kind") == "ib" for inv in usable)
    for h, inv in enumerate(hosts):
        for device in (inv.get("rdma") or {}).get("devices", []):
            for port in device["ports"]:
                if not port_active(port):
                    text = (f"host {h} ({inv['hostname']}): RDMA device {device['name']} port {port['port']} "
                            f"is {port['state']}")
                    (problems if ib_plugin else warnings).append(text)
    rdma_counts = {h: len((inv.get("rdma") or {}).get("devices", [])) for h, inv in enumerate(hosts)
                   if not inv.get("error")}
    if len(set(rdma_counts.values())) > 1:
        warnings.append(f"the hosts have different RDMA device counts: {_hosts_by(rdma_counts)}")
    gpu_counts = {h: len((inv.get("gpu") or {}).get("gpus", [])) for h, inv in enumerate(hosts)
                  if not inv.get("error")}
    if len(set(gpu_counts.values())) > 1:
        warnings.append(f"the hosts have different GPU counts: {_hosts_by(gpu_counts)}")
    for h, inv in enumerate(hosts):
        plugin = inv.get("nccl_net_plugin") or {}
        if plugin.get("value") and not plugin.get("ours"):
            warnings.append(f"host {h} ({inv['hostname']}): NCCL_NET_PLUGIN={plugin['value']} is not "
                            f"torch_reccl's plugin: NCCL jobs there will not fail over")
    for key in ("torch_reccl", "torch", "nccl"):
        found = {h: inv["versions"].get(key) for h, inv in enumerate(hosts)}
        if len(set(found.values())) > 1:
            warnings.append(f"the hosts run different {key} versions: {_hosts_by(found)}")
    return problems, warnings, rails

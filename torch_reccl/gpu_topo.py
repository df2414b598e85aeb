"""Where the GPUs sit: PCI distances between GPUs and NICs in ``nvidia-smi topo -m``'s
terms, NVLink peers, and the NVLink pairs NVL's transit choice may use.

Two sources, NVML first:

- **nvml**: pynvml (the ``nvidia-ml-py`` package, ``pip install torch_reccl[nvml]``)
  with the NVIDIA driver answering. GPUs in NVML's order (PCI order, as
  ``nvidia-smi``) with their PCI bus ids; between GPUs, NVLink links
  (``nvmlDeviceGetNvLinkState`` / ``nvmlDeviceGetNvLinkRemotePciInfo``; links to an
  NVSwitch count for every GPU pair ``nvmlDeviceGetP2PStatus`` says NVLink joins)
  and otherwise the common PCI ancestor (``nvmlDeviceGetTopologyCommonAncestor``).
- **sysfs**, when pynvml is not installed or NVML cannot start (no driver): NVIDIA
  display and 3D controllers under ``/sys/bus/pci/devices``, distances from their
  PCI paths; NVLink is unknown.

NVML knows no NICs, so a GPU-NIC distance always comes from the sysfs PCI paths of
both ends (NVML, where present, names the GPU's bus id). pynvml is imported lazily
and only here: nothing else in torch_reccl needs it.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

# nvmlGpuTopologyLevel_t -> nvidia-smi's legend. INTERNAL (two GPUs on one board) is
# the nearest there is; nvidia-smi has no label of its own for it.
NVML_LEVEL_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

# nvidia-smi's legend, for the report
LEGEND = (
    "X = self; NV# = # NVLink links; PIX = at most one PCIe switch; PXB = several PCIe "
    "switches, no host bridge; PHB = through a PCIe host bridge; NODE = between host "
    "bridges of one NUMA node; SYS = across NUMA nodes; ? = no PCI path"
)

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA / 3D controller (the class file reads 0x030200)

_BUS_ID = re.compile(r"^(?:[0-9a-f]{4}|0000[0-9a-f]{4}):[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
_ROOT_COMPLEX = re.compile(r"/(pci[0-9a-f]{4}:[0-9a-f]{2})(/|$)")


def canonical_bus_id(bus_id) -> str:
    """NVML's ``00000000:3B:00.0`` (bytes or str) or CUDA's ``0000:3B:00.0`` ->
    sysfs's ``0000:3b:00.0``. The plugin reads the same forms (core/topology.cc)."""
    text = (bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)).strip().lower()
    if not _BUS_ID.match(text):
        raise ValueError(f"{bus_id!r} is not a PCI bus id (domain:bus:device.function)")
    return text[-12:]


@dataclass
class Gpu:
    index: int      # NVML's index (PCI order), or the position in sysfs's PCI order
    bus_id: str     # canonical, "0000:18:00.0"
    name: str
    pci_path: str   # sysfs device path; "" when sysfs does not list the bus id
    numa_node: int


@dataclass
class GpuTopology:
    source: str                         # "nvml" or "sysfs"
    detail: str                         # the NVML and driver versions, or why not NVML
    gpus: List[Gpu] = field(default_factory=list)
    links: List[List[str]] = field(default_factory=list)  # [gpu][gpu]: X, NV#, PIX ... SYS
    # [gpu][gpu]: NVLink links joining them; None when unknown (sysfs)
    nvlinks: Optional[List[List[int]]] = None

    def nvlink_pairs(self) -> List[Tuple[str, str]]:
        """The GPU pairs joined by NVLink, by bus id (empty: none, or unknown)."""
        if self.nvlinks is None:
            return []
        return [(a.bus_id, b.bus_id) for a in self.gpus for b in self.gpus
                if a.index < b.index and self.nvlinks[a.index][b.index] > 0]

    def nvlink_setting(self) -> Optional[str]:
        """RECCL_NVLINK_PEERS for these NVLink pairs; None when NVLink is unknown."""
        if self.nvlinks is None:
            return None
        return ",".join(f"{a}-{b}" for a, b in self.nvlink_pairs()) or "none"

    def describe_source(self) -> str:
        return f"topology source: {self.source} ({self.detail})"


# --------------------------------------------------------------------------- PCI paths


def pci_location(bus_id: str, sysfs_root: str = "/sys") -> Tuple[str, int]:
    """(sysfs device path, NUMA node) of the device at `bus_id`; ("", -1) when sysfs
    does not list it."""
    link = os.path.join(sysfs_root, "bus", "pci", "devices", canonical_bus_id(bus_id))
    if not os.path.exists(link):
        return "", -1
    return os.path.realpath(link), _read_int(os.path.join(link, "numa_node"), -1)


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (OSError, ValueError):
        return default


def _components(path: str) -> List[str]:
    """"/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0" -> from the root complex on."""
    match = _ROOT_COMPLEX.search(path or "")
    return path[match.start(1):].split("/") if match else []


def pci_link(a: Tuple[str, int], b: Tuple[str, int]) -> str:
    """nvidia-smi's label for two devices given (sysfs path, NUMA node) each.

    Paths run [root complex, root port, (switch upstream port, downstream port)...,
    device]. Different root complexes: SYS across NUMA nodes, NODE within one (or
    NUMA unknown); sharing only the root complex: PHB; below a shared root or switch
    port, PIX when each device is at most one bridge below it (one switch), else PXB.
    """
    pa, pb = _components(a[0]), _components(b[0])
    if not pa or not pb:
        return "?"
    if pa == pb:
        return "X"
    if pa[0] != pb[0]:
        return "SYS" if a[1] >= 0 and b[1] >= 0 and a[1] != b[1] else "NODE"
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common == 1:
        return "PHB"
    return "PIX" if max(len(pa), len(pb)) - common <= 2 else "PXB"


# --------------------------------------------------------------------------- sources


def _pynvml():
    """The pynvml module, or raises ImportError."""
    return importlib.import_module("pynvml")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Nvml:
    """An initialised NVML session (nvmlInit ... nvmlShutdown)."""

    def __init__(self, nvml):
        self.nvml = nvml

    def __enter__(self):
        self.nvml.nvmlInit()
        return self.nvml

    def __exit__(self, *exc):
        self.nvml.nvmlShutdown()
        return False


def _nvml_links(nvml, handle) -> List[str]:
    """Bus ids at the far end of `handle`'s active NVLink links (a GPU or an NVSwitch)."""
    remotes = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            remotes.append(canonical_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except nvml.NVMLError:
            continue  # this GPU has fewer links, or none (NOT_SUPPORTED / INVALID_ARGUMENT)
    return remotes


def _nvlink_p2p(nvml, a, b) -> bool:
    try:
        return nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK
    except nvml.NVMLError:
        return False


def _nvml_level(nvml, a, b, gpu_a: Gpu, gpu_b: Gpu) -> str:
    """NVML's common ancestor of two GPUs; where NVML cannot tell (some VMs), their
    sysfs PCI paths'."""
    try:
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except nvml.NVMLError:
        return pci_link((gpu_a.pci_path, gpu_a.numa_node), (gpu_b.pci_path, gpu_b.numa_node))
    return NVML_LEVEL_LABELS.get(level, f"level {level}")


def from_nvml(nvml, sysfs_root: Optional[str] = "/sys") -> GpuTopology:
    """The topology NVML reports through the pynvml module `nvml`, the GPUs' PCI
    paths from `sysfs_root` (None: not looked up); raises nvml.NVMLError when NVML
    cannot start or answer."""
    with _Nvml(nvml):
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = []
        for i, handle in enumerate(handles):
            bus = canonical_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
            path, numa = pci_location(bus, sysfs_root) if sysfs_root else ("", -1)
            gpus.append(Gpu(i, bus, _text(nvml.nvmlDeviceGetName(handle)), path, numa))
        remotes = [_nvml_links(nvml, h) for h in handles]
        buses = {g.bus_id for g in gpus}
        nvlinks = [[0] * count for _ in range(count)]
        links = [["X"] * count for _ in range(count)]
        for i in range(count):
            switch_links = sum(1 for r in remotes[i] if r not in buses)
            for j in range(count):
                if i == j:
                    continue
                direct = sum(1 for r in remotes[i] if r == gpus[j].bus_id)
                # NVSwitch systems: every link of i ends at a switch; NVML says whether
                # the switches join i and j
                switched = switch_links if switch_links and _nvlink_p2p(nvml, handles[i], handles[j]) else 0
                nvlinks[i][j] = direct + switched
                links[i][j] = f"NV{nvlinks[i][j]}" if nvlinks[i][j] else _nvml_level(
                    nvml, handles[i], handles[j], gpus[i], gpus[j])
        detail = f"pynvml, NVIDIA driver {_text(nvml.nvmlSystemGetDriverVersion())}"
    return GpuTopology("nvml", detail, gpus, links, nvlinks)


def from_sysfs(sysfs_root: str = "/sys", why: str = "") -> GpuTopology:
    """NVIDIA GPUs as sysfs lists them, distances from PCI paths, NVLink unknown."""
    devices = os.path.join(sysfs_root, "bus", "pci", "devices")
    gpus = []
    for entry in sorted(os.listdir(devices)) if os.path.isdir(devices) else []:
        base = os.path.join(devices, entry)
        try:
            with open(os.path.join(base, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(base, "class")) as f:
                pci_class = f.read().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and pci_class[:6] in GPU_CLASSES:
            path, numa = pci_location(entry, sysfs_root)
            gpus.append(Gpu(len(gpus), canonical_bus_id(entry), "NVIDIA GPU (sysfs)", path, numa))
    links = [[pci_link((a.pci_path, a.numa_node), (b.pci_path, b.numa_node)) if a is not b else "X"
              for b in gpus] for a in gpus]
    return GpuTopology("sysfs", why + "; NVLink unknown", gpus, links, None)


def nvml_problem(error: BaseException) -> str:
    if isinstance(error, ImportError):
        return f"pynvml is not installed ({error}); pip install nvidia-ml-py for NVML"
    return f"NVML did not answer ({type(error).__name__}: {error}): no NVIDIA driver here?"


def discover(sysfs_root: str = "/sys") -> GpuTopology:
    """NVML's topology where pynvml and the driver answer, else sysfs's, saying why."""
    try:
        nvml = _pynvml()
    except ImportError as error:
        return from_sysfs(sysfs_root, nvml_problem(error))
    try:
        return from_nvml(nvml, sysfs_root)
    except nvml.NVMLError as error:
        return from_sysfs(sysfs_root, nvml_problem(error))


# --------------------------------------------------------------------------- NICs and NVL


def nic_links(topology: GpuTopology, nics: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """[gpu][nic] labels from the sysfs PCI paths of both."""
    return [[pci_link((g.pci_path, g.numa_node), (n["pci_path"], n["numa_node"])) for n in nics]
            for g in topology.gpus]


def transit(topology: GpuTopology, nics: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """NVL's transit choice on these GPUs and NICs, by the plugin's own code
    (csrc/gpu/transit_map.h through torch_reccl._C): ``nic_gpus`` (the GPU next to
    each NIC, -1: none) and ``transit[g][n]`` (the GPU a buffer on GPU g stages
    through for NIC n, -1: direct). Transit GPUs are NVLink peers from the same
    RECCL_NVLINK_PEERS value the plugin reads; without NVML (sysfs) every pair counts
    as peers here, as CUDA peer access decides in the plugin."""
    from torch_reccl._native import native

    c = native()
    setting = topology.nvlink_setting()
    buses = [g.bus_id for g in topology.gpus]
    if setting is None:
        peers = [[True] * len(buses) for _ in buses]
    else:
        peers = c.nvlink_peer_matrix(setting.split(","), buses)
    out = c.transit_map_from_pci([(g.pci_path, g.numa_node) for g in topology.gpus],
                                 [(n["pci_path"], n["numa_node"]) for n in nics], peers)
    out["peers_from"] = "NVML's NVLink pairs" if setting is not None else \
        "unknown without NVML: any GPU with CUDA peer access"
    return out


def export_nvlink_peers(environ=None) -> str:
    """Called by ``import torch_reccl``: when RECCL_NVL=on and RECCL_NVLINK_PEERS is
    unset, sets it from NVML so the plugin's transit GPUs are NVLink peers. Returns
    what it did, for logs and tests; never raises (the plugin then falls back to CUDA
    peer access and says so)."""
    env = os.environ if environ is None else environ
    if env.get("RECCL_NVL") != "on":
        return "RECCL_NVL is not on"
    if "RECCL_NVLINK_PEERS" in env:
        return f"RECCL_NVLINK_PEERS={env['RECCL_NVLINK_PEERS']} set by the user"
    try:
        nvml = _pynvml()
    except ImportError as error:
        return nvml_problem(error)
    try:
        setting = from_nvml(nvml, sysfs_root=None).nvlink_setting()  # pairs are named by bus id
    except Exception as error:  # noqa: BLE001 -- an import must not fail on a broken NVML
        return nvml_problem(error)
    env["RECCL_NVLINK_PEERS"] = setting
    return f"RECCL_NVLINK_PEERS={setting} from NVML"

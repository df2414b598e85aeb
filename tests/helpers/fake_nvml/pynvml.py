"""A stand-in for pynvml (nvidia-ml-py) modelling one machine, for tests on hosts
without NVIDIA GPUs: the calls torch_reccl.gpu_topo makes, with NVML's return
values and errors (uninitialised calls fail, missing links raise, PCI bus ids come
as bytes with NVML's 8-digit domain and upper-case hex).

The machine is ``BOX`` (a dict, see DEFAULT_BOX); a test replaces it in-process, or
names a JSON file of one in FAKE_NVML_BOX for a child process. ``"driver": null``
models a host whose NVIDIA driver is not loaded (nvmlInit fails as NVML does).
"""
from __future__ import annotations

import json
import os

# NVML's values (nvml.h)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_P2P_CAPS_INDEX_READ = 0
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50

_MESSAGES = {1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported", 9: "Driver Not Loaded"}


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


# Two GPUs on two NUMA nodes, each under a PCIe switch of its own root complex,
# joined by 4 NVLink links; the PCI tree (and the NICs) are in the test's sysfs.
DEFAULT_BOX = {
    "driver": "550.54.15",
    "gpus": [
        {"bus": "00000000:18:00.0", "name": "NVIDIA H200", "links": 18,
         "nvlink": {"0": "00000000:9A:00.0", "1": "00000000:9A:00.0", "2": "00000000:9A:00.0",
                    "3": "00000000:9A:00.0"}},
        {"bus": "00000000:9A:00.0", "name": "NVIDIA H200", "links": 18,
         "nvlink": {"0": "00000000:18:00.0", "1": "00000000:18:00.0", "2": "00000000:18:00.0",
                    "3": "00000000:18:00.0"}},
    ],
    "ancestor": {"0,1": NVML_TOPOLOGY_SYSTEM},
}

BOX = json.load(open(os.environ["FAKE_NVML_BOX"])) if os.environ.get("FAKE_NVML_BOX") else DEFAULT_BOX
_initialised = 0
calls = []  # (function name, args) of every call, for tests that check what was asked


class _Handle:
    """Opaque, as NVML's nvmlDevice_t: not an index."""

    def __init__(self, index):
        self._index = index


class _PciInfo:
    def __init__(self, bus):
        self.busId = bus.encode()
        self.busIdLegacy = bus[4:].encode()


def _live(name, *args):
    calls.append((name, args))
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _gpu(handle):
    if not isinstance(handle, _Handle):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return BOX["gpus"][handle._index]


def nvmlInit():
    global _initialised
    calls.append(("nvmlInit", ()))
    if BOX.get("driver") is None:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    _initialised += 1


def nvmlShutdown():
    global _initialised
    _live("nvmlShutdown")
    _initialised -= 1


def nvmlSystemGetDriverVersion():
    _live("nvmlSystemGetDriverVersion")
    return BOX["driver"]


def nvmlDeviceGetCount():
    _live("nvmlDeviceGetCount")
    return len(BOX["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    _live("nvmlDeviceGetHandleByIndex", index)
    if not 0 <= index < len(BOX["gpus"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index)


def nvmlDeviceGetName(handle):
    _live("nvmlDeviceGetName")
    return _gpu(handle)["name"]


def nvmlDeviceGetPciInfo(handle):
    _live("nvmlDeviceGetPciInfo")
    return _PciInfo(_gpu(handle)["bus"])


def nvmlDeviceGetNvLinkState(handle, link):
    _live("nvmlDeviceGetNvLinkState", link)
    gpu = _gpu(handle)
    if not gpu.get("links"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= link < gpu["links"]:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return NVML_FEATURE_ENABLED if str(link) in gpu.get("nvlink", {}) else NVML_FEATURE_DISABLED


def nvmlDeviceGetNvLinkRemotePciInfo(handle, link):
    _live("nvmlDeviceGetNvLinkRemotePciInfo", link)
    remote = _gpu(handle).get("nvlink", {}).get(str(link))
    if remote is None:  # NVML answers only for active links
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _PciInfo(remote)


def nvmlDeviceGetP2PStatus(handle1, handle2, index):
    _live("nvmlDeviceGetP2PStatus", index)
    a, b = _gpu(handle1), _gpu(handle2)
    if index != NVML_P2P_CAPS_INDEX_NVLINK:
        return NVML_P2P_STATUS_OK
    far_a, far_b = set(a.get("nvlink", {}).values()), set(b.get("nvlink", {}).values())
    joined = b["bus"] in far_a or bool(far_a & far_b)  # direct, or a shared NVSwitch
    return NVML_P2P_STATUS_OK if joined else NVML_P2P_STATUS_NOT_SUPPORTED


def nvmlDeviceGetTopologyCommonAncestor(handle1, handle2):
    _live("nvmlDeviceGetTopologyCommonAncestor")
    i, j = sorted((handle1._index, handle2._index))
    if i == j:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    level = BOX["ancestor"].get(f"{i},{j}")
    if level is None:  # as in VMs that hide the PCI tree from NVML
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return level

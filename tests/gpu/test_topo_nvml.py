"""GPU check of torch_reccl.gpu_topo against the real NVML and `nvidia-smi topo -m`:
needs a CUDA GPU and pynvml (``pip install nvidia-ml-py``, or ``.[nvml]``); each
comparison with nvidia-smi needs nvidia-smi; skipped with the reason otherwise.
tests/tools/test_gpu_topo.py runs the same code on a stand-in NVML without GPUs.

1. NVML answers (source "nvml"), and lists the GPUs nvidia-smi lists, by PCI bus id.
2. Every GPU pair's label (NV# from NVLink links, else PIX/PXB/PHB/NODE/SYS from
   NVML's common ancestor) is the one in `nvidia-smi topo -m`.
3. Every GPU-NIC pair nvidia-smi lists (its NICs are RDMA devices, located here
   through /sys/class/infiniband) gets the same label from our sysfs PCI paths.
4. The RECCL_NVLINK_PEERS value `import torch_reccl` sets with RECCL_NVL=on names
   exactly the CUDA devices nvidia-smi shows joined by NVLink, and CUDA grants
   peer access between each pair (NVL's transit needs it).

Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md);
``-s`` prints both matrices.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from torch_reccl import gpu_topo

from conftest import needs_gpus

pytestmark = needs_gpus(1)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def topology():
    try:
        import pynvml  # noqa: F401
    except ImportError as error:
        pytest.skip(f"needs pynvml (pip install nvidia-ml-py): {error}")
    t = gpu_topo.discover()
    print("\n" + t.describe_source())
    for g, row in zip(t.gpus, t.links):
        print(f"GPU{g.index} {g.bus_id} {' '.join(row)}")
    return t


def nvidia_smi(*args) -> str:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi to compare with")
    proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return ANSI.sub("", proc.stdout)


@pytest.fixture(scope="module")
def smi_matrix():
    """`nvidia-smi topo -m` as ({device: {device: label}}, {"NIC0": "mlx5_0", ...})."""
    text = nvidia_smi("topo", "-m")
    print("\n" + text)
    lines = text.splitlines()
    header = [cell.strip() for cell in lines[0].split("\t")]
    devices = [cell for cell in header[1:] if re.fullmatch(r"(GPU|NIC)\d+", cell)]
    matrix = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split("\t")]
        if cells and cells[0] in devices:
            matrix[cells[0]] = dict(zip(devices, cells[1:1 + len(devices)]))
    nic_names = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.MULTILINE))
    return matrix, nic_names


def test_nvml_answers_and_lists_the_gpus_nvidia_smi_lists(topology):
    assert topology.source == "nvml", topology.detail
    out = nvidia_smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    listed = [gpu_topo.canonical_bus_id(line.split(",")[1].strip()) for line in out.strip().splitlines()]
    assert [g.bus_id for g in topology.gpus] == listed


def test_gpu_pairs_match_nvidia_smi_topo(topology, smi_matrix):
    matrix, _ = smi_matrix
    if len(topology.gpus) < 2:
        pytest.skip("needs 2 GPUs for a GPU pair")
    for a in topology.gpus:
        for b in topology.gpus:
            ours, theirs = topology.links[a.index][b.index], matrix[f"GPU{a.index}"][f"GPU{b.index}"]
            assert ours == theirs, f"GPU{a.index}-GPU{b.index}: ours {ours}, nvidia-smi {theirs}"


def test_gpu_nic_pairs_match_nvidia_smi_topo(topology, smi_matrix):
    matrix, nic_names = smi_matrix
    if not nic_names:
        pytest.skip("nvidia-smi topo -m lists no NICs here (it lists RDMA devices only)")
    for nic, rdma in sorted(nic_names.items()):
        link = f"/sys/class/infiniband/{rdma}/device"
        path = os.path.realpath(link)
        numa = gpu_topo._read_int(os.path.join(link, "numa_node"), -1)
        for g in topology.gpus:
            ours = gpu_topo.pci_link((g.pci_path, g.numa_node), (path, numa))
            theirs = matrix[f"GPU{g.index}"][nic]
            assert ours == theirs, f"GPU{g.index}-{nic} ({rdma}): ours {ours}, nvidia-smi {theirs}"


CHILD = """
import json, os, torch
import torch_reccl
from torch_reccl._native import native
n = torch.cuda.device_count()
props = [torch.cuda.get_device_properties(i) for i in range(n)]
if all(hasattr(p, "pci_bus_id") for p in props):
    buses = ["%04x:%02x:%02x.0" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id) for p in props]
else:  # an older torch: CUDA_DEVICE_ORDER=PCI_BUS_ID numbers CUDA devices in NVML's order
    assert "CUDA_VISIBLE_DEVICES" not in os.environ, "this torch cannot name CUDA devices' bus ids"
    from torch_reccl import gpu_topo
    buses = [g.bus_id for g in gpu_topo.discover().gpus][:n]
setting = os.environ.get("RECCL_NVLINK_PEERS")
print(json.dumps({
    "setting": setting, "buses": buses,
    "joined": native().nvlink_peer_matrix(setting.split(","), buses) if setting else None,
    "peer_access": [[i != j and torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                    for i in range(n)],
}))
"""


def test_import_exports_the_nvlink_pairs_nvidia_smi_shows(topology, smi_matrix):
    matrix, _ = smi_matrix
    env = {**os.environ, "RECCL_NVL": "on", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env.pop("RECCL_NVLINK_PEERS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    print(child)
    assert child["setting"] == topology.nvlink_setting()
    by_bus = {g.bus_id: g.index for g in topology.gpus}  # CUDA order -> NVML/nvidia-smi order
    nvml_index = [by_bus[bus] for bus in child["buses"]]
    for i, a in enumerate(nvml_index):
        for j, b in enumerate(nvml_index):
            nvlink = i != j and matrix[f"GPU{a}"][f"GPU{b}"].startswith("NV")
            assert child["joined"][i][j] == nvlink, f"CUDA {i}-{j}: exported {child['joined'][i][j]}"
            if nvlink:
                assert child["peer_access"][i][j], f"NVLink but no CUDA peer access: CUDA {i}-{j}"

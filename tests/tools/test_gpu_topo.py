"""GPU topology from NVML (torch_reccl.gpu_topo) and what NVL's transit choice makes
of it, on a host without NVIDIA GPUs: NVML is tests/helpers/fake_nvml/pynvml.py (a stand-in
for the pynvml module modelling one machine), the PCI tree is a sysfs directory
built here. The same checks against the real NVML and `nvidia-smi topo -m` run on
a GPU host: tests/gpu/test_topo_nvml.py.

The machine: GPU0 (NUMA 0) and NIC0 under one PCIe switch of root complex 0,
NIC1 on its own root port of root complex 0, GPU1 (NUMA 1) under a switch of root
complex 0x80, GPU0 and GPU1 joined by 4 NVLink links.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from torch_reccl import cli, gpu_topo
from torch_reccl.cli import topo
from torch_reccl.transport import _C, ConfigError

from conftest import HELPERS, REPO

FAKE_DIR = os.path.join(HELPERS, "fake_nvml")

GPU0, GPU1, NIC0, NIC1 = "0000:18:00.0", "0000:9a:00.0", "0000:19:00.0", "0000:20:00.0"
# bus id -> (path below /sys/devices, NUMA node, vendor, class)
DEVICES = {
    "0000:00:01.0": ("pci0000:00/0000:00:01.0", 0, "0x8086", "0x060400"),
    "0000:16:00.0": ("pci0000:00/0000:00:01.0/0000:16:00.0", 0, "0x1000", "0x060400"),
    "0000:17:00.0": ("pci0000:00/0000:00:01.0/0000:16:00.0/0000:17:00.0", 0, "0x1000", "0x060400"),
    "0000:17:01.0": ("pci0000:00/0000:00:01.0/0000:16:00.0/0000:17:01.0", 0, "0x1000", "0x060400"),
    GPU0: ("pci0000:00/0000:00:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0", 0, "0x10de", "0x030200"),
    NIC0: ("pci0000:00/0000:00:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0", 0, "0x15b3", "0x020000"),
    "0000:00:03.0": ("pci0000:00/0000:00:03.0", 0, "0x8086", "0x060400"),
    NIC1: ("pci0000:00/0000:00:03.0/0000:20:00.0", 0, "0x15b3", "0x020000"),
    "0000:80:01.0": ("pci0000:80/0000:80:01.0", 1, "0x8086", "0x060400"),
    "0000:98:00.0": ("pci0000:80/0000:80:01.0/0000:98:00.0", 1, "0x1000", "0x060400"),
    "0000:99:00.0": ("pci0000:80/0000:80:01.0/0000:98:00.0/0000:99:00.0", 1, "0x1000", "0x060400"),
    GPU1: ("pci0000:80/0000:80:01.0/0000:98:00.0/0000:99:00.0/0000:9a:00.0", 1, "0x10de", "0x030200"),
    # an NVIDIA device that is no GPU (an NVSwitch's bridge function): not listed as one
    "0000:a0:00.0": ("pci0000:80/0000:80:01.0/0000:a0:00.0", 1, "0x10de", "0x068000"),
}


@pytest.fixture
def sysfs(tmp_path):
    root = tmp_path / "sys"
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    for bus, (path, numa, vendor, pci_class) in DEVICES.items():
        device = root / "devices" / path
        device.mkdir(parents=True, exist_ok=True)
        (device / "numa_node").write_text(f"{numa}\n")
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
        os.symlink(device, root / "bus" / "pci" / "devices" / bus)
    return str(root)


def nic_rows(sysfs_root):
    """NIC rows as torch_reccl.nics() gives them, at this machine's PCI paths."""
    rows = []
    for index, (name, bus) in enumerate((("eth0", NIC0), ("eth1", NIC1))):
        path, numa = gpu_topo.pci_location(bus, sysfs_root)
        rows.append({"index": index, "name": name, "address": f"10.0.{index}.1", "up": True,
                     "grey": "healthy", "backup": ("eth1", "eth0")[index], "backup_cost": 100,
                     "numa_node": numa, "pci_path": path})
    return rows


@pytest.fixture
def fake_nvml(monkeypatch):
    """The stand-in pynvml as `import pynvml` finds it, on a fresh copy of its box."""
    spec = importlib.util.spec_from_file_location("pynvml", os.path.join(FAKE_DIR, "pynvml.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.delenv("FAKE_NVML_BOX", raising=False)
    spec.loader.exec_module(module)
    module.BOX = copy.deepcopy(module.DEFAULT_BOX)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def no_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError


# --------------------------------------------------------------------------- distances


def test_bus_ids_from_nvml_cuda_and_sysfs_agree():
    assert gpu_topo.canonical_bus_id(b"00000000:9A:00.0") == GPU1
    assert gpu_topo.canonical_bus_id("0000:9A:00.0") == GPU1
    assert gpu_topo.canonical_bus_id(GPU1) == GPU1
    with pytest.raises(ValueError, match="not a PCI bus id"):
        gpu_topo.canonical_bus_id("emulated:0")
    with pytest.raises(ValueError, match="not a PCI bus id"):
        gpu_topo.canonical_bus_id("00010000:9a:00.0")  # an 8-digit domain too wide for sysfs


def test_pci_labels_follow_nvidia_smis_legend(sysfs):
    loc = {bus: gpu_topo.pci_location(bus, sysfs) for bus in (GPU0, GPU1, NIC0, NIC1)}
    assert loc[GPU0][0].endswith(DEVICES[GPU0][0]) and loc[GPU1][1] == 1
    assert gpu_topo.pci_link(loc[GPU0], loc[NIC0]) == "PIX"   # one switch
    assert gpu_topo.pci_link(loc[GPU0], loc[NIC1]) == "PHB"   # through the host bridge
    assert gpu_topo.pci_link(loc[GPU1], loc[NIC0]) == "SYS"   # across NUMA nodes
    assert gpu_topo.pci_link(loc[GPU0], loc[GPU0]) == "X"
    assert gpu_topo.pci_link(loc[GPU0], ("", -1)) == "?"
    # another root complex of the same NUMA node (or NUMA unknown): NODE
    assert gpu_topo.pci_link((loc[GPU1][0], 0), loc[NIC0]) == "NODE"
    assert gpu_topo.pci_link((loc[GPU1][0], -1), loc[NIC0]) == "NODE"
    # two switches in a row below the shared one: PXB
    cascaded = (loc[NIC0][0] + "/0000:1a:00.0/0000:1b:00.0/0000:1c:00.0", 0)
    assert gpu_topo.pci_link(loc[GPU0], cascaded) == "PXB"


# --------------------------------------------------------------------------- NVML source


def test_nvml_reports_nvlink_peers_and_distances(fake_nvml, sysfs):
    t = gpu_topo.discover(sysfs)
    assert t.source == "nvml" and "driver 550.54.15" in t.detail
    assert [(g.index, g.bus_id, g.name, g.numa_node) for g in t.gpus] == [
        (0, GPU0, "NVIDIA H200", 0), (1, GPU1, "NVIDIA H200", 1)]
    assert t.gpus[1].pci_path.endswith(DEVICES[GPU1][0])
    assert t.nvlinks == [[0, 4], [4, 0]]
    assert t.links == [["X", "NV4"], ["NV4", "X"]]
    assert t.nvlink_pairs() == [(GPU0, GPU1)]
    assert t.nvlink_setting() == f"{GPU0}-{GPU1}"
    assert gpu_topo.nic_links(t, nic_rows(sysfs)) == [["PIX", "PHB"], ["SYS", "SYS"]]
    # every nvmlInit was matched by an nvmlShutdown
    assert fake_nvml._initialised == 0
    assert [c[0] for c in fake_nvml.calls].count("nvmlShutdown") == 1


def test_nvml_without_nvlink_uses_the_common_ancestor(fake_nvml, sysfs):
    for gpu in fake_nvml.BOX["gpus"]:
        gpu["nvlink"] = {}
    t = gpu_topo.discover(sysfs)
    assert t.source == "nvml"
    assert t.nvlinks == [[0, 0], [0, 0]]
    assert t.links == [["X", "SYS"], ["SYS", "X"]]   # NVML_TOPOLOGY_SYSTEM
    assert t.nvlink_pairs() == [] and t.nvlink_setting() == "none"


def test_nvml_gpus_without_nvlink_support(fake_nvml, sysfs):
    """PCIe-only GPUs: nvmlDeviceGetNvLinkState raises NOT_SUPPORTED on every link."""
    for gpu in fake_nvml.BOX["gpus"]:
        gpu["links"], gpu["nvlink"] = 0, {}
    fake_nvml.BOX["ancestor"]["0,1"] = fake_nvml.NVML_TOPOLOGY_HOSTBRIDGE
    t = gpu_topo.discover(sysfs)
    assert t.links == [["X", "PHB"], ["PHB", "X"]] and t.nvlink_setting() == "none"


def test_nvml_without_an_ancestor_answer_labels_from_sysfs(fake_nvml, sysfs):
    """Where NVML cannot name the common ancestor (NOT_SUPPORTED, as in some VMs), the
    GPUs' sysfs PCI paths give the label; NVML stays the source of the rest."""
    for gpu in fake_nvml.BOX["gpus"]:
        gpu["nvlink"] = {}
    fake_nvml.BOX["ancestor"] = {}
    t = gpu_topo.discover(sysfs)
    assert t.source == "nvml" and t.links == [["X", "SYS"], ["SYS", "X"]]


def test_nvml_nvswitch_links_join_every_gpu_pair(fake_nvml, sysfs):
    """HGX: each GPU's links end at NVSwitches, not at the other GPU; NVML's P2P status
    says which GPU pairs the switches join."""
    switches = ["00000000:A0:00.0", "00000000:A1:00.0"]
    for gpu in fake_nvml.BOX["gpus"]:
        gpu["nvlink"] = {str(link): switches[link % 2] for link in range(18)}
    t = gpu_topo.discover(sysfs)
    assert t.nvlinks == [[0, 18], [18, 0]] and t.links[0][1] == "NV18"
    assert t.nvlink_setting() == f"{GPU0}-{GPU1}"


def test_nvml_gpu_that_sysfs_does_not_list(fake_nvml, sysfs):
    """A container may hide the GPU's sysfs entry: NVML still names it and its NVLink,
    its PCI distances are unknown."""
    os.unlink(os.path.join(sysfs, "bus", "pci", "devices", GPU1))
    t = gpu_topo.discover(sysfs)
    assert t.gpus[1].pci_path == "" and t.links[0][1] == "NV4"
    assert gpu_topo.nic_links(t, nic_rows(sysfs))[1] == ["?", "?"]


# --------------------------------------------------------------------------- fallback


def test_without_pynvml_sysfs_is_used_and_says_why(no_pynvml, sysfs):
    t = gpu_topo.discover(sysfs)
    assert t.source == "sysfs"
    assert t.describe_source().startswith("topology source: sysfs (pynvml is not installed")
    assert "NVLink unknown" in t.detail
    assert [g.bus_id for g in t.gpus] == [GPU0, GPU1]   # the NVIDIA non-GPU device is left out
    assert t.links == [["X", "SYS"], ["SYS", "X"]]      # from the PCI paths
    assert t.nvlinks is None and t.nvlink_setting() is None
    assert gpu_topo.nic_links(t, nic_rows(sysfs)) == [["PIX", "PHB"], ["SYS", "SYS"]]


def test_without_a_driver_sysfs_is_used_and_says_why(fake_nvml, sysfs):
    fake_nvml.BOX["driver"] = None  # nvmlInit fails: Driver Not Loaded
    t = gpu_topo.discover(sysfs)
    assert t.source == "sysfs" and "NVML did not answer" in t.detail
    assert "Driver Not Loaded" in t.detail
    assert len(t.gpus) == 2 and t.nvlinks is None


def test_sysfs_without_gpus(no_pynvml, tmp_path):
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    t = gpu_topo.discover(str(tmp_path))
    assert t.source == "sysfs" and t.gpus == [] and t.links == []


# --------------------------------------------------------------------------- NVL transit


def test_transit_goes_over_nvlink_to_the_gpu_next_to_the_nic(fake_nvml, sysfs):
    t = gpu_topo.discover(sysfs)
    m = gpu_topo.transit(t, nic_rows(sysfs))
    assert m["nic_gpus"] == [0, 0]  # NIC1's nearest GPU is GPU0, but across the host bridge
    # GPU1's data for NIC0 crosses NVLink to GPU0 (next to NIC0); NIC1 has no near GPU
    assert m["transit"] == [[-1, -1], [0, -1]]
    assert m["peers_from"] == "NVML's NVLink pairs"


def test_no_nvlink_no_transit(fake_nvml, sysfs):
    """Without NVLink the detour would cross PCIe anyway: NVML's answer turns it off,
    where CUDA peer access over PCIe would have allowed it."""
    for gpu in fake_nvml.BOX["gpus"]:
        gpu["nvlink"] = {}
    m = gpu_topo.transit(gpu_topo.discover(sysfs), nic_rows(sysfs))
    assert m["transit"] == [[-1, -1], [-1, -1]] and not m["any_transit"]


def test_transit_from_sysfs_leaves_peers_to_cuda(no_pynvml, sysfs):
    m = gpu_topo.transit(gpu_topo.discover(sysfs), nic_rows(sysfs))
    assert m["transit"] == [[-1, -1], [0, -1]]
    assert m["peers_from"].startswith("unknown without NVML")


def test_nvlink_peer_matrix_reads_the_setting_as_the_plugin_does():
    setting = [f"{GPU0.upper()}-00000000:9A:00.0"]  # any case, NVML's 8-digit domain
    assert _C.nvlink_peer_matrix(setting, [GPU0, GPU1, "0000:3b:00.0"]) == [
        [False, True, False], [True, False, False], [False, False, False]]
    assert _C.nvlink_peer_matrix(["none"], [GPU0, GPU1]) == [[False, False], [False, False]]
    # CUDA emulation's ids are no PCI bus ids: never NVLink peers
    assert _C.nvlink_peer_matrix(setting, ["emulated:0", "emulated:1"]) == [[False, False], [False, False]]


@pytest.mark.parametrize("value", ["0000:18:00.0", "0000:18:00.0-0000:18:00.0", "gpu0-gpu1",
                                   "0000:18:00.0-0000:9a:00.0,none"])
def test_a_malformed_nvlink_peers_setting_is_named(value):
    with pytest.raises(ConfigError, match="RECCL_NVLINK_PEERS entry .* valid: 'none' or a comma list"):
        _C.validate_config({"RECCL_NVLINK_PEERS": value})
    _C.validate_config({"RECCL_NVLINK_PEERS": f"{GPU0}-{GPU1}"})
    _C.validate_config({"RECCL_NVLINK_PEERS": "none"})


# --------------------------------------------------------------------------- reccl topo


def run_topo(monkeypatch, capsys, sysfs, *args):
    monkeypatch.setattr(topo, "nics", lambda: nic_rows(sysfs))
    real = gpu_topo.discover
    monkeypatch.setattr(gpu_topo, "discover", lambda: real(sysfs))
    assert cli.main(["topo", *args]) == 0
    return capsys.readouterr().out


def test_topo_cli_shows_the_nvml_matrix_and_transit(fake_nvml, sysfs, monkeypatch, capsys):
    out = run_topo(monkeypatch, capsys, sysfs)
    gpu_part = out.split("\n\n", 1)[1].splitlines()
    assert gpu_part[0] == "topology source: nvml (pynvml, NVIDIA driver 550.54.15)"
    grid = [line.split() for line in gpu_part[1:6]]
    assert grid == [["GPU0", "GPU1", "eth0", "eth1"],
                    ["GPU0", "X", "NV4", "PIX", "PHB"],
                    ["GPU1", "NV4", "X", "SYS", "SYS"],
                    ["eth0", "PIX", "SYS", "X", "PHB"],
                    ["eth1", "PHB", "SYS", "PHB", "X"]]
    assert "  eth0: next to GPU0; GPU1 via GPU0" in gpu_part
    assert "  eth1: next to GPU0; every GPU direct" in gpu_part
    assert f"RECCL_NVLINK_PEERS={GPU0}-{GPU1} (what `import torch_reccl` sets for the plugin " \
           "when RECCL_NVL=on)" in gpu_part


def test_topo_cli_json_has_the_gpu_topology(fake_nvml, sysfs, monkeypatch, capsys):
    report = json.loads(run_topo(monkeypatch, capsys, sysfs, "--json"))
    assert [n["name"] for n in report["nics"]] == ["eth0", "eth1"]
    gpus = report["gpu_topology"]
    assert gpus["source"] == "nvml" and gpus["nvlinks"] == [[0, 4], [4, 0]]
    assert [g["bus_id"] for g in gpus["gpus"]] == [GPU0, GPU1]
    assert gpus["nic_links"] == [["PIX", "PHB"], ["SYS", "SYS"]]
    assert gpus["nvl"]["transit"] == [[-1, -1], [0, -1]]
    assert gpus["nvlink_peers_setting"] == f"{GPU0}-{GPU1}"


def test_topo_cli_says_sysfs_was_used_without_pynvml(no_pynvml, sysfs, monkeypatch, capsys):
    out = run_topo(monkeypatch, capsys, sysfs)
    gpu_part = out.split("\n\n", 1)[1].splitlines()
    assert gpu_part[0].startswith("topology source: sysfs (pynvml is not installed")
    assert gpu_part[2].split() == ["GPU0", "X", "SYS", "PIX", "PHB"]
    assert any(line.startswith("NVL transit (RECCL_NVL=on; transit GPUs: unknown without NVML")
               for line in gpu_part)
    assert not any(line.startswith("RECCL_NVLINK_PEERS=") for line in gpu_part)


# --------------------------------------------------------------------------- import torch_reccl


def import_in_child(tmp_path, box, **env):
    """RECCL_NVLINK_PEERS after `import torch_reccl` in a fresh process whose pynvml is
    the stand-in on `box` (None: no pynvml at all)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    path = [os.environ.get("PYTHONPATH", "")]
    if box is not None:
        (tmp_path / "box.json").write_text(json.dumps(box))
        child_env["FAKE_NVML_BOX"] = str(tmp_path / "box.json")
        path.insert(0, FAKE_DIR)
    child_env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), **env)
    probe = ("import sys\n"
             "if 'FAKE_NVML_BOX' not in __import__('os').environ: sys.modules['pynvml'] = None\n"
             "import os, torch_reccl\n"
             "print(os.environ.get('RECCL_NVLINK_PEERS', '<unset>'))")
    proc = subprocess.run([sys.executable, "-c", probe], env=child_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def fake_box():
    spec = importlib.util.spec_from_file_location("fake_pynvml_box", os.path.join(FAKE_DIR, "pynvml.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return copy.deepcopy(module.DEFAULT_BOX)


def test_import_exports_nvml_nvlink_peers_when_nvl_is_on(tmp_path):
    assert import_in_child(tmp_path, fake_box(), RECCL_NVL="on") == f"{GPU0}-{GPU1}"
    # NVL off: NVML is not even asked
    assert import_in_child(tmp_path, fake_box()) == "<unset>"
    # the user's value stays
    assert import_in_child(tmp_path, fake_box(), RECCL_NVL="on", RECCL_NVLINK_PEERS="none") == "none"


def test_import_without_nvml_leaves_the_plugin_to_cuda_peer_access(tmp_path):
    assert import_in_child(tmp_path, None, RECCL_NVL="on") == "<unset>"
    box = fake_box()
    box["driver"] = None
    assert import_in_child(tmp_path, box, RECCL_NVL="on") == "<unset>"
    box = fake_box()
    for gpu in box["gpus"]:
        gpu["nvlink"] = {}
    assert import_in_child(tmp_path, box, RECCL_NVL="on") == "none"


def test_export_says_what_it_did(fake_nvml):
    env = {"RECCL_NVL": "on"}
    assert gpu_topo.export_nvlink_peers(env) == f"RECCL_NVLINK_PEERS={GPU0}-{GPU1} from NVML"
    assert env["RECCL_NVLINK_PEERS"] == f"{GPU0}-{GPU1}"
    fake_nvml.BOX["driver"] = None
    env = {"RECCL_NVL": "on"}
    assert gpu_topo.export_nvlink_peers(env).startswith("NVML did not answer")
    assert "RECCL_NVLINK_PEERS" not in env


# --------------------------------------------------------------------------- the plugin

PLUGIN_PROBE = """
import json, sys
sys.modules["pynvml"] = None  # this probe's NVLink answer is RECCL_NVLINK_PEERS alone
from torch_reccl import _native
testing = _native.testing()
testing.nccl_plugin_use_cuda(testing.CudaEmulation(2))
from torch_reccl.bench.nccl_net import Plugin
p = Plugin(11, require_init=False)
print(json.dumps({"init_code": p.init_code, "messages": p.messages}))
"""


def plugin_nvl_line(**env_changes) -> str:
    """The plugin's NVL init message over the CUDA emulation (2 GPUs, peer access
    between them), NIC 0 next to GPU 0 and NIC 1 next to GPU 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env.update(RECCL_NICS="127.0.0.1,127.0.0.2", RECCL_NVL="on", RECCL_NIC_GPUS="0,1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_changes)
    proc = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [m for m in report["messages"] if "RECCL_NVL=on" in m or "disabled" in m]
    assert len(lines) == 1, report["messages"]
    return lines[0]


def test_plugin_transits_between_cuda_peers_without_nvml():
    line = plugin_nvl_line()
    assert "transit GPUs: any GPU with CUDA peer access (RECCL_NVLINK_PEERS unset: `import " \
           "torch_reccl` sets it where pynvml and NVML answer; `reccl topo` says why not)" in line
    assert "GPU 0 via GPU 1 for NIC 1, GPU 1 via GPU 0 for NIC 0" in line


def test_plugin_transits_only_between_nvlink_peers():
    """NVML said these GPUs share no NVLink: the plugin goes direct although CUDA
    grants peer access. (The emulation's GPUs have no PCI bus ids, so no NVML pair
    can name them; the pairs that do match are checked through nvlink_peer_matrix.)"""
    for value, pairs in (("none", "0 pairs"), (f"{GPU0}-{GPU1}", "1 pair")):
        line = plugin_nvl_line(RECCL_NVLINK_PEERS=value)
        assert f"transit GPUs: NVLink peers only (RECCL_NVLINK_PEERS: {pairs})" in line
        assert "none used, every GPU goes direct" in line


def test_plugin_refuses_a_malformed_nvlink_peers_setting():
    line = plugin_nvl_line(RECCL_NVLINK_PEERS="gpu0-gpu1")
    assert "ReCCL plugin disabled" in line and "RECCL_NVLINK_PEERS entry 'gpu0-gpu1'" in line


def test_topo_cli_prints_the_setting_for_jobs_without_torch_reccl(fake_nvml, sysfs, monkeypatch, capsys):
    assert run_topo(monkeypatch, capsys, sysfs, "--nvlink-peers") == f"{GPU0}-{GPU1}\n"


def test_topo_cli_nvlink_peers_without_nvml_fails_saying_why(no_pynvml, sysfs, monkeypatch, capsys):
    real = gpu_topo.discover
    monkeypatch.setattr(gpu_topo, "discover", lambda: real(sysfs))
    assert cli.main(["topo", "--nvlink-peers"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("reccl topo: no NVLink answer: pynvml is not installed")

"""NVL (csrc/gpu): where data is staged, and how the plugin behaves where it
cannot stage. The copies themselves need GPUs: tests/gpu/test_nvl_transit.py runs
them on a GPU host (stager bit-exactness, NCCL through a NIC failure).

Here: the transit map from RECCL_NIC_GPUS and from PCI paths, RECCL_NVL* and
RECCL_NIC_GPUS validation, and the plugin without NVL (the default: host
buffers only, GPU memory refused) and without GPUs (on is a clear init error).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_reccl.transport import _C, ConfigError

from conftest import HELPERS, REPO

ALL_PEERS = [[True] * 4 for _ in range(4)]
NO_GPU = bool(_C.cuda_driver_problem())

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- transit map


def test_nic_gpus_map_sends_far_traffic_through_the_nics_gpu():
    m = _C.transit_map_from_nic_gpus([0, 1], 2, 2, ALL_PEERS)
    assert m["nic_gpus"] == [0, 1]
    # GPU 0's data over NIC 1 crosses NVLink to GPU 1; over its own NIC it goes direct.
    assert m["transit"] == [[-1, 1], [0, -1]]
    assert m["any_transit"]


def test_nic_gpus_map_without_peer_access_goes_direct():
    peers = [[True, False], [False, True]]
    m = _C.transit_map_from_nic_gpus([0, 1], 2, 2, peers)
    assert m["transit"] == [[-1, -1], [-1, -1]] and not m["any_transit"]


def test_all_nics_next_to_one_gpu():
    """Every channel on one NIC (small groups): the other GPUs stage through its GPU."""
    m = _C.transit_map_from_nic_gpus([2, 2], 2, 4, ALL_PEERS)
    assert m["transit"] == [[2, 2], [2, 2], [-1, -1], [2, 2]]


@pytest.mark.parametrize("nic_gpus, nics, gpus, message", [
    ([0], 2, 2, "RECCL_NIC_GPUS has 1 entries; expected one GPU index per NIC, 2"),
    ([0, 2], 2, 2, "RECCL_NIC_GPUS names GPU 2 for NIC 1; valid GPUs here: 0..1"),
])
def test_nic_gpus_map_rejects_a_wrong_table(nic_gpus, nics, gpus, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        _C.transit_map_from_nic_gpus(nic_gpus, nics, gpus, ALL_PEERS)


def _dev(root, *ports):
    return "/sys/devices/" + "/".join([f"pci{root}"] + list(ports))


# Two sockets, each with a PCIe switch holding one GPU and one NIC (an H100/H200
# HGX board in miniature), and a NIC on socket 0's root port with no switch.
GPU0 = (_dev("0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"), 0)
NIC0 = (_dev("0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"), 0)
GPU1 = (_dev("0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0"), 1)
NIC1 = (_dev("0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:01.0", "0000:84:00.0"), 1)
LONE = (_dev("0000:00", "0000:00:03.0", "0000:05:00.0"), 0)


def test_pci_map_uses_the_gpu_under_the_same_switch():
    m = _C.transit_map_from_pci([GPU0, GPU1], [NIC0, NIC1], ALL_PEERS)
    assert m["nic_gpus"] == [0, 1]
    assert m["transit"] == [[-1, 1], [0, -1]]


def test_pci_map_leaves_a_nic_without_a_near_gpu_alone():
    """LONE shares only socket 0's root complex with GPU 0 (cost 100): no GPU is
    near it, so nothing is gained by a transit; virtual NICs have no path."""
    m = _C.transit_map_from_pci([GPU0, GPU1], [LONE, ("", -1)], ALL_PEERS)
    assert m["nic_gpus"] == [0, -1]
    assert not m["any_transit"]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("env, message", [
    ({"RECCL_NVL": "yes"}, "RECCL_NVL=yes is not valid: expected off or on"),
    ({"RECCL_NVL": "auto"}, "RECCL_NVL=auto is not valid: expected off or on"),
    ({"RECCL_NVL_MAX_BYTES": "1000"}, "expected an integer in 1048576..1073741824"),
    ({"RECCL_NIC_GPUS": "0,,1"}, "RECCL_NIC_GPUS=0,,1 is not valid: expected a comma list"),
    ({"RECCL_NIC_GPUS": "0,x"}, "RECCL_NIC_GPUS entry=x is not valid: expected an integer in 0..1023"),
])
def test_bad_nvl_settings_are_named(env, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        _C.validate_config(env)


def test_good_nvl_settings():
    _C.validate_config({"RECCL_NVL": "on", "RECCL_NVL_MAX_BYTES": str(40 << 20),
                        "RECCL_NIC_GPUS": "0,1,1,0"})


# --------------------------------------------------------------------------- without GPUs

PLUGIN_PROBE = """
import json, sys
import numpy as np
from torch_reccl.bench.nccl_net import Plugin, PTR_CUDA, SUCCESS
p = Plugin(11, require_init=False)
out = {"init_code": p.init_code, "messages": p.messages}
if p.init_code == SUCCESS:
    out["ptrSupport"] = p.properties(0).ptrSupport
    handle, listen_comm = p.listen(0)
    code, _ = p.reg_mr(listen_comm, np.zeros(16, np.uint8), PTR_CUDA)
    out["reg_cuda_code"] = code
    out["messages"] = p.messages
print(json.dumps(out))
"""


def probe_plugin(**env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env = {**env, "RECCL_NICS": "127.0.0.1,127.0.0.2",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_changes}
    proc = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], env=env, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_default_claims_host_buffers_only():
    report = probe_plugin()
    assert report["init_code"] == 0
    assert report["ptrSupport"] == 1  # NCCL_PTR_HOST only
    text = "\n".join(report["messages"])
    assert "NVL off, host buffers only: RECCL_NVL=off" in text, text
    assert report["reg_cuda_code"] != 0  # GPU memory is refused, not crashed on
    assert "regMr: memory type 2 is not supported; valid: host (GPU buffers need RECCL_NVL)" in text


@pytest.mark.skipif(not NO_GPU, reason="this host has GPUs")
def test_nvl_on_without_gpus_is_a_clear_init_error():
    report = probe_plugin(RECCL_NVL="on")
    assert report["init_code"] != 0
    text = "\n".join(report["messages"])
    assert "ReCCL plugin disabled: RECCL_NVL=on needs CUDA GPUs:" in text, text


@pytest.mark.skipif(not NO_GPU, reason="this host has GPUs")
def test_stager_without_gpus_is_a_clear_error():
    with pytest.raises(ConfigError, match="DeviceStager needs CUDA GPUs: "):
        _C.DeviceStager()


def test_stats_show_transit_memory_and_nvl_bytes():
    import torch_reccl

    stats = torch_reccl.stats()
    assert stats["nvl_transit_bytes"] >= 0
    assert stats["nvl_transit_peak_bytes"] >= stats["nvl_transit_bytes"]
    for nic in stats["nics"].values():
        assert "nvl_bytes" in nic


# --------------------------------------------------------------------------- the plugin over the CUDA emulation

CAP = 1 << 20  # the smallest cap: 2 MiB messages go through the transit buffer in pieces


@pytest.fixture(scope="module")
def emulated_nvl_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env.update({"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_NVL": "on", "RECCL_NIC_GPUS": "0,1",
                "RECCL_NVL_MAX_BYTES": str(CAP), "RECCL_HEARTBEAT_MS": "300",
                "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "nvl_plugin_case.py")], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_emulated_nvl_claims_gpu_buffers_and_says_how(emulated_nvl_run):
    assert emulated_nvl_run["ptrSupport"] == 3  # NCCL_PTR_HOST | NCCL_PTR_CUDA
    text = "\n".join(emulated_nvl_run["messages"])
    assert "RECCL_NVL=on: GPU buffers staged in reccl's own CUDA contexts" in text
    assert "NIC 0 next to GPU 0, NIC 1 next to GPU 1" in text


@pytest.mark.timeout(120)
def test_emulated_nvl_stream_through_a_nic_failure_is_exact(emulated_nvl_run):
    run = emulated_nvl_run
    assert run["wrong"] == []
    streamed = run["streamed"]
    # every byte staged out of GPU memory and back in, at least once
    assert streamed["to_host_bytes"] >= run["bytes"] and streamed["to_device_bytes"] >= run["bytes"]


@pytest.mark.timeout(120)
def test_emulated_nvl_routes_by_the_active_nic(emulated_nvl_run):
    before, after = emulated_nvl_run["nvl_before_fault"], emulated_nvl_run["nvl_after"]
    # before: the sender (GPU 1) on NIC 0 transits through GPU 0; the receiver is direct
    assert before["lo:127.0.0.1"] > 0 and before["lo:127.0.0.2"] == 0
    # after NIC 0 died: the receiver (GPU 0) on NIC 1 transits through GPU 1
    assert after["lo:127.0.0.2"] > 0
    assert after["lo:127.0.0.1"] == before["lo:127.0.0.1"]
    assert emulated_nvl_run["streamed"]["peer_bytes"] == sum(after.values())


@pytest.mark.timeout(120)
def test_emulated_nvl_memory_is_capped_and_released(emulated_nvl_run):
    registered, released = emulated_nvl_run["registered"], emulated_nvl_run["released"]
    # one transit buffer per registered region (GPU 1 -> GPU 0 and GPU 0 -> GPU 1), capped
    assert registered["stats"] == 2 * CAP
    assert registered["emulation"]["pinned_bytes_allocated"] == 2 * (4 * (2 << 20))  # the mirrors
    assert released["stats"] == 0
    assert released["emulation"]["pinned_bytes_allocated"] == 0
    assert released["emulation"]["device_bytes_allocated"] == 2 * (4 * (2 << 20))  # the test's own
    assert released["emulation"]["streams"] == 0 and released["emulation"]["events"] == 0


@pytest.mark.timeout(120)
def test_emulated_nvl_copies_in_flight_do_not_reorder_messages(emulated_nvl_run):
    run = emulated_nvl_run["pipelined"]
    # the copies really were seen in flight, and every message still arrived whole, in order
    assert run["polls_not_done"] > 0
    assert run["left"] == 0 and run["wrong"] == []


@pytest.mark.timeout(120)
def test_emulated_nvl_more_sends_than_copy_slots_asks_nccl_to_retry(emulated_nvl_run):
    run = emulated_nvl_run["slots"]
    assert run["accepted_at_once"] == 16  # DeviceStager::kMaxInFlight; the 17th got a NULL request
    assert run["wrong"] == []


@pytest.mark.timeout(120)
def test_emulated_nvl_refuses_cudamalloc_buffers_and_keeps_nothing(emulated_nvl_run):
    run = emulated_nvl_run
    assert run["legacy_code"] != 0
    text = "\n".join(run["messages"])
    assert "RECCL_NVL stages only GPU buffers from CUDA's virtual memory API" in text
    assert "Set NCCL_CUMEM_ENABLE=1 (and, for tensors registered with NCCL, " in text
    assert "expandable_segments:True) or RECCL_NVL=off" in text
    # nothing was allocated for the refused buffer
    before, after = run["registered"], run["after_legacy"]
    assert after["stats"] == before["stats"]
    assert after["emulation"]["pinned_bytes_allocated"] == before["emulation"]["pinned_bytes_allocated"]


@pytest.mark.timeout(120)
def test_emulated_nvl_refuses_a_message_outside_its_buffer(emulated_nvl_run):
    assert emulated_nvl_run["outside_code"] != 0
    text = "\n".join(emulated_nvl_run["messages"])
    assert "bytes lie outside the GPU buffer registered for them" in text

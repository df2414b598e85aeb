"""GPU check of NVL (csrc/gpu): needs two GPUs that reach each other's memory
(NVLink); skipped with the reason elsewhere, one GPU included.

1. The stager alone: random bytes GPU -> pinned host -> GPU, directly and through
   a transit buffer on the other GPU, at sizes below, at and above the transit
   cap (pieces alternating two lanes); every byte compared, transit memory held
   never above the cap and shown in stats().
2. NCCL through the plugin with GPU buffers (RECCL_NVL=on; the loopback NICs
   have no PCI path, so RECCL_NIC_GPUS=0,1 puts NIC 0 next to GPU 0 and NIC 1
   next to GPU 1, and NCCL_NET_GDR_LEVEL=SYS lets NCCL hand GPU buffers over):
   NCCL reports GPU Direct RDMA enabled for our NICs, all_reduce/all_gather
   results are bit-identical to the same run with RECCL_NVL=off and no fault
   although rank 0's primary NIC goes down mid-run and the loop never
   synchronises (each step's pageable host-to-device copies wait in the driver
   while the collective before them is in flight), and the per-NIC nvl_bytes
   show the traffic that crossed NVLink: rank 1 (GPU 1) sends over NIC 0 from
   the start, rank 0 (GPU 0) over NIC 1 once its NIC 0 is down.

Each rank's NCCL log stays in pytest's tmp_path for a post-mortem.
Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from torch_reccl.cli.launch import spawn_bounded

from conftest import BACKUP, PRIMARY, needs_gpus, two_host_env

pytestmark = needs_gpus(2)

CAP = 4 << 20
STEPS = 24
FAULT_AT = 8
RUN_TIMEOUT_S = 120
NVL_ENV = {"RECCL_NVL": "on", "RECCL_NIC_GPUS": "0,1", "NCCL_NET_GDR_LEVEL": "SYS",
           "NCCL_NET_GDR_READ": "1", "RECCL_NVL_MAX_BYTES": str(CAP)}


@pytest.fixture(scope="module")
def two_linked_gpus():
    """Skips unless GPU 0 and GPU 1 can access each other's memory. Asked in a child
    process: the question initialises CUDA, which pytest's process should not hold."""
    ask = "import torch; print(torch.cuda.can_device_access_peer(0, 1))"
    answer = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    if answer.stdout.strip() != "True":
        pytest.skip("needs GPU 0 and GPU 1 to reach each other's memory (NVLink); they cannot here")


def stager_worker(_rank: int, out_dir: str):
    """Own process: the stagers' CUDA contexts and reccl's native state stay out of pytest's."""
    import torch_reccl
    from torch_reccl import _native

    C = _native.native()
    for gpu in range(2):
        torch.cuda.set_device(gpu)
        torch.empty(1, device=f"cuda:{gpu}")  # the primary contexts exist before we measure
    free_before = [torch.cuda.mem_get_info(gpu)[0] for gpu in range(2)]
    stagers = [C.DeviceStager(max_transit_bytes=CAP) for _ in range(2)]
    wrong = []
    for gpu, other in ((0, 1), (1, 0)):
        stager = stagers[gpu]
        stager.prepare(gpu, 33 << 20, [other])
        for size in (1, 4095, 1 << 20, CAP, (5 << 20) + 3, 33 << 20):
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=f"cuda:{gpu}")
            expected = src.cpu()
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            for transit in (-1, other):
                host.zero_()
                stager.to_host(host.data_ptr(), src.data_ptr(), gpu, size, transit)
                if not torch.equal(host, expected):
                    wrong.append(f"to_host gpu {gpu} transit {transit} size {size}")
                dst = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{gpu}")
                stager.to_device(dst.data_ptr(), gpu, host.data_ptr(), size, transit)
                if not torch.equal(dst.cpu(), expected):
                    wrong.append(f"to_device gpu {gpu} transit {transit} size {size}")
    used = [free_before[gpu] - torch.cuda.mem_get_info(gpu)[0] for gpu in range(2)]
    with open(os.path.join(out_dir, "stager.json"), "w") as f:
        json.dump({"wrong": wrong, "held": sum(s.transit_bytes for s in stagers),
                   "stats_transit": torch_reccl.stats()["nvl_transit_bytes"], "used": used}, f)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_stager_copies_every_byte_directly_and_through_the_other_gpu(tmp_path, two_linked_gpus):
    spawn_bounded(stager_worker, (str(tmp_path),), nprocs=1, timeout_s=RUN_TIMEOUT_S)
    result = json.loads((tmp_path / "stager.json").read_text())
    # transit is held on the other GPU; the rest is reccl's own context on each
    print(f"GPU memory taken by the stagers: {[u >> 20 for u in result['used']]} MiB "
          f"(transit {CAP >> 20} MiB on each)")
    assert not result["wrong"], f"bytes differ: {result['wrong']}"
    assert result["held"] == 2 * CAP, f"transit memory {result['held']}, expected cap {CAP} x 2 routes"
    assert result["stats_transit"] == result["held"], "stats()['nvl_transit_bytes'] does not show it"


def worker(rank: int, out_dir: str, label: str, nvl: bool, fault: bool):
    os.environ.update(two_host_env(rank, "nvl-host"))
    os.environ.update({
        "NCCL_NET": "ReCCL", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": os.path.join(out_dir, f"{label}-nccl-{rank}.%p.log"),
        "RECCL_NVL": "off",
    })
    if nvl:
        os.environ.update(NVL_ENV)
    import torch_reccl  # sets NCCL_NET_PLUGIN to our library

    torch.cuda.set_device(rank)  # NVL needs each rank on its own GPU
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(out_dir, f"{label}.store"), 2),
                            rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    gen = torch.Generator().manual_seed(1234 + rank)
    outputs = []
    for step in range(STEPS):
        if fault and step == FAULT_AT and rank == 0:
            torch_reccl.inject_fault(torch_reccl.nics()[0]["name"], "down")
        # No synchronisation between steps, as in a training loop: each step's
        # pageable host-to-device copies wait in the CUDA driver, holding the
        # application's context, for the collective in flight, whose staging
        # copies the plugin makes meanwhile (docs/nvl.md, "Own CUDA contexts").
        x = torch.randn(3 << 20, generator=gen).cuda()  # 12 MiB: several NCCL channels and steps
        dist.all_reduce(x)
        g = torch.empty(2 * 4099, device="cuda")
        dist.all_gather_into_tensor(g, torch.randn(4099, generator=gen).cuda())
        outputs.append(torch.cat([x, g]))
    outputs = [o.cpu() for o in outputs]
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    stats = torch_reccl.stats()
    dist.destroy_process_group()
    torch.save(torch.stack(outputs), os.path.join(out_dir, f"{label}-out-{rank}.pt"))
    with open(os.path.join(out_dir, f"{label}-stats-{rank}.json"), "w") as f:
        json.dump(stats, f)


def run(out: str, label: str, nvl: bool, fault: bool):
    spawn_bounded(worker, (out, label, nvl, fault), nprocs=2, timeout_s=RUN_TIMEOUT_S)
    outs = [torch.load(os.path.join(out, f"{label}-out-{r}.pt")) for r in range(2)]
    stats = []
    for r in range(2):
        with open(os.path.join(out, f"{label}-stats-{r}.json")) as f:
            stats.append(json.load(f))
    log = "".join(open(p).read() for p in glob.glob(os.path.join(out, f"{label}-nccl-*.log")))
    return outs, stats, log


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_nccl_with_gpu_buffers_stages_over_nvlink_and_stays_exact_through_a_nic_failure(
        tmp_path, two_linked_gpus):
    out = str(tmp_path)
    base, base_stats, base_log = run(out, "host-buffers", nvl=False, fault=False)
    nvl, nvl_stats, nvl_log = run(out, "nvl-fault", nvl=True, fault=True)
    checks = {
        "baseline: NCCL hands host buffers (GDR disabled)": "GPU Direct RDMA Disabled" in base_log,
        "NVL: NCCL hands GPU buffers (GDR enabled for our NICs)": "GPU Direct RDMA Enabled" in nvl_log,
        "NVL + NIC down: every output bit-identical to the fault-free host-buffer run": all(
            torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(base, nvl)),
        # two_host_env's NICS: NIC 0 is PRIMARY, NIC 1 BACKUP
        "rank 0 failed over": nvl_stats[0]["nics"][PRIMARY]["failovers"] >= 1,
        "rank 0 (GPU 0) staged through GPU 1 for NIC 1 after the fault":
            nvl_stats[0]["nics"][BACKUP]["nvl_bytes"] > 0,
        "rank 1 (GPU 1) staged through GPU 0 for NIC 0": nvl_stats[1]["nics"][PRIMARY]["nvl_bytes"] > 0,
        "no NVL bytes without NVL": all(n["nvl_bytes"] == 0 for s in base_stats for n in s["nics"].values()),
        "transit memory was used": 0 < max(s["nvl_transit_peak_bytes"] for s in nvl_stats),
    }
    summary = "\n".join(
        f"rank {r}: transit now {s['nvl_transit_bytes']} peak {s['nvl_transit_peak_bytes']}; "
        + ", ".join(f"{k}: nvl {v['nvl_bytes']} sent {v['bytes_sent']} failovers {v['failovers']}"
                    for k, v in s["nics"].items()) for r, s in enumerate(nvl_stats))
    print(summary)
    failed = [name for name, passed in checks.items() if not passed]
    assert not failed, f"failed: {failed}\n{summary}\nNCCL logs: {out}"

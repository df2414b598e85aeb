"""GPU validation of NVL (csrc/gpu): run on a machine with two NVLink-joined GPUs.

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

    python tests/gpu/nvl_transit.py
Exit status 0 when every check passes; one line per check.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_reccl.launch import spawn_bounded  # noqa: E402

CAP = 4 << 20
STEPS = 24
FAULT_AT = 8
NVL_ENV = {"RECCL_NVL": "on", "RECCL_NIC_GPUS": "0,1", "NCCL_NET_GDR_LEVEL": "SYS",
           "NCCL_NET_GDR_READ": "1", "RECCL_NVL_MAX_BYTES": str(CAP)}


def stager_checks() -> dict:
    from torch_reccl import _native

    C = _native.native()
    for gpu in range(2):
        torch.cuda.set_device(gpu)
        torch.empty(1, device=f"cuda:{gpu}")  # the primary contexts exist before we measure
    free_before = [torch.cuda.mem_get_info(gpu)[0] for gpu in range(2)]
    stagers = [C.DeviceStager(max_transit_bytes=CAP) for _ in range(2)]
    exact = True
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
                exact = exact and torch.equal(host, expected)
                dst = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{gpu}")
                stager.to_device(dst.data_ptr(), gpu, host.data_ptr(), size, transit)
                exact = exact and torch.equal(dst.cpu(), expected)
    import torch_reccl

    held = sum(s.transit_bytes for s in stagers)
    used = [free_before[gpu] - torch.cuda.mem_get_info(gpu)[0] for gpu in range(2)]
    # transit is held on the other GPU: what remains is reccl's own context on each
    print(f"GPU memory taken by the stagers: {[u >> 20 for u in used]} MiB (transit {CAP >> 20} MiB on each)")
    return {"stager: every byte exact, direct and through the other GPU": exact,
            f"stager: transit memory {held} = cap {CAP} x 2 routes": held == 2 * CAP,
            "stats(): nvl_transit_bytes shows it": torch_reccl.stats()["nvl_transit_bytes"] == held}


def worker(rank: int, out_dir: str, label: str, nvl: bool, fault: bool):
    os.environ.update({
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
        "NCCL_HOSTID": f"nvl-host-{rank}", "RECCL_NICS": "127.0.0.1,127.0.0.2",
        "RECCL_HEARTBEAT_MS": "500", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NET": "ReCCL",
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": os.path.join(out_dir, f"{label}-nccl-{rank}.%p.log"),
        "RECCL_NVL": "off",
    })
    if nvl:
        os.environ.update(NVL_ENV)
    import torch_reccl  # sets NCCL_NET_PLUGIN to our library

    torch.cuda.set_device(rank)
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
    spawn_bounded(worker, (out, label, nvl, fault), nprocs=2, timeout_s=90)
    outs = [torch.load(os.path.join(out, f"{label}-out-{r}.pt")) for r in range(2)]
    stats = []
    for r in range(2):
        with open(os.path.join(out, f"{label}-stats-{r}.json")) as f:
            stats.append(json.load(f))
    log = "".join(open(p).read() for p in glob.glob(os.path.join(out, f"{label}-nccl-*.log")))
    return outs, stats, log


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs; skipped")
        return 0
    checks = stager_checks()
    keep = os.environ.get("NVL_TEST_LOG_DIR")  # keeps NCCL's logs for a post-mortem
    with tempfile.TemporaryDirectory() as scratch:
        out = keep or scratch
        os.makedirs(out, exist_ok=True)
        base, base_stats, base_log = run(out, "host-buffers", nvl=False, fault=False)
        nvl, nvl_stats, nvl_log = run(out, "nvl-fault", nvl=True, fault=True)
    checks["baseline: NCCL hands host buffers (GDR disabled)"] = "GPU Direct RDMA Disabled" in base_log
    checks["NVL: NCCL hands GPU buffers (GDR enabled for our NICs)"] = "GPU Direct RDMA Enabled" in nvl_log
    checks["NVL + NIC down: every output bit-identical to the fault-free host-buffer run"] = all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(base, nvl))
    nic0, nic1 = "lo:127.0.0.1", "lo:127.0.0.2"
    checks["rank 0 failed over"] = nvl_stats[0]["nics"][nic0]["failovers"] >= 1
    checks["rank 0 (GPU 0) staged through GPU 1 for NIC 1 after the fault"] = nvl_stats[0]["nics"][nic1]["nvl_bytes"] > 0
    checks["rank 1 (GPU 1) staged through GPU 0 for NIC 0"] = nvl_stats[1]["nics"][nic0]["nvl_bytes"] > 0
    checks["no NVL bytes without NVL"] = all(n["nvl_bytes"] == 0 for s in base_stats for n in s["nics"].values())
    peak = max(s["nvl_transit_peak_bytes"] for s in nvl_stats)
    checks[f"transit memory was used (peak {peak} bytes over all connections)"] = 0 < peak
    failed = 0
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
        failed += not passed
    for r in range(2):
        s = nvl_stats[r]
        print(f"rank {r}: transit now {s['nvl_transit_bytes']} peak {s['nvl_transit_peak_bytes']}; "
              + ", ".join(f"{k}: nvl {v['nvl_bytes']} sent {v['bytes_sent']} failovers {v['failovers']}"
                          for k, v in s["nics"].items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU validation: the "reccl" backend with CUDA and CPU tensors in one group.

Two ranks on two GPUs look like two hosts (NCCL_HOSTID, NCCL P2P/SHM off), so
NCCL's traffic goes through our net plugin. The group is made with
``init_process_group("reccl", pg_options=ProcessGroupNCCL.Options(...))``; the
script checks that CUDA tensors run on torch's own ProcessGroupNCCL built with
those options, CPU tensors on the reccl engine, that a NIC failing mid-run
(inject_fault on rank 0's primary NIC) changes no result bit, and that the
fault picture (the per-op agreement and the job's fault board) shows the NIC down and counts NCCL's collectives.

Run on a GPU machine (two ranks on two GPUs, or sharing one):  python tests/gpu/reccl_backend_cuda.py
Exit status 0 when every check passes; prints one line per check.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_reccl.launch import spawn_bounded  # noqa: E402

STEPS = 40
FAULT_AT = 15


def expected_sum(step: int, n: int) -> torch.Tensor:
    return sum(torch.arange(n, dtype=torch.float32) * (r + 1) + step for r in range(2))


def worker(rank: int, out_dir: str):
    os.environ.update({
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
        "NCCL_HOSTID": f"reccl-host-{rank}", "RECCL_NICS": "127.0.0.1,127.0.0.2",
        "RECCL_HEARTBEAT_MS": "500", "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
    })
    import torch_reccl  # sets NCCL_NET_PLUGIN to our library
    from torch.distributed import ProcessGroupNCCL
    from torch_reccl.backend import backend_info, fault_picture

    events = []
    torch_reccl.on_event(lambda e: events.append(e.kind), kinds=["failover", "failback", "nic_down"])
    device = rank % torch.cuda.device_count()  # one GPU: both ranks share it (own NCCL_HOSTID)
    torch.cuda.set_device(device)
    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    dist.init_process_group("reccl", store=dist.FileStore(os.path.join(out_dir, "store"), 2),
                            rank=rank, world_size=2, pg_options=options,
                            device_id=torch.device("cuda", device))
    pg = dist.group.WORLD
    checks = {}
    cuda_backend = pg._get_backend(torch.device("cuda"))
    checks["cuda tensors go to ProcessGroupNCCL"] = isinstance(cuda_backend, ProcessGroupNCCL)
    checks["caller's NCCL options kept"] = bool(cuda_backend.options.is_high_priority_stream)
    checks["cpu tensors go to reccl"] = pg._get_backend(torch.device("cpu")).name() == "reccl"
    checks["no CPU engine before the first CPU collective"] = backend_info()["channels"] == 0
    n = 1 << 22  # 16 MiB of float32: large enough for several NCCL channels
    ok = True
    for step in range(STEPS):
        if step == FAULT_AT and rank == 0:
            torch_reccl.inject_fault(torch_reccl.nics()[0]["name"], "down")
        x = torch.arange(n, dtype=torch.float32, device="cuda") * (rank + 1) + step
        dist.all_reduce(x)
        c = torch.arange(1 << 16, dtype=torch.float32) * (rank + 1) + step
        dist.all_reduce(c)
        ok = ok and torch.equal(x.cpu(), expected_sum(step, n)) and torch.equal(c, expected_sum(step, 1 << 16))
    torch.cuda.synchronize()
    checks["results exact through the fault"] = ok
    time.sleep(0.5)  # a few control-plane periods
    checks["the first CPU collective built the engine"] = backend_info()["channels"] >= 1
    picture = fault_picture()
    degraded = {d["rank"]: d for d in picture["degraded"]}
    checks["picture shows rank 0's NIC down"] = 0 in degraded and 0 in degraded[0]["nics_down"]
    checks["picture counts NCCL ops"] = (0 in degraded and degraded[0]["device_ops_done"] >= STEPS)
    torch_reccl.flush_events()
    time.sleep(0.1)
    checks["failover events"] = "failover" in events if rank == 0 else True
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": checks, "picture": picture}, f)


def main() -> int:
    if torch.cuda.device_count() < 1:
        print("needs a GPU (two ranks share one when there is only one)")
        return 1
    with tempfile.TemporaryDirectory() as out:
        spawn_bounded(worker, (out,), nprocs=2, timeout_s=300)
        failed = 0
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                result = json.load(f)
            for name, passed in result["checks"].items():
                print(f"rank {rank}  {'PASS' if passed else 'FAIL'}  {name}")
                failed += not passed
            if rank == 0:
                print("picture:", json.dumps(result["picture"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU validation: NCCL over the ReCCL plugin, training through a NIC failure.

Two ranks on two GPUs of one machine are made to look like two hosts
(NCCL_HOSTID), with NCCL's P2P and SHM transports off, so every byte between them
goes through the net plugin, i.e. through our bonded connections. A small model is
trained for --steps steps three times: fault-free; with rank 0's primary NIC
failing at --fault-step (a real veth link down when --fabric is given and we are
root, else inject_fault); and with the NIC failing and healing (failback). Loss
curves and final parameters must be bit-identical to the fault-free run.

Run on a 2-GPU machine:  python tests/gpu/nccl_failover_train.py [--fabric]
Prints a short table; exit status 0 when all runs match.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from torch_reccl.launch import spawn_bounded  # noqa: E402


def worker(rank: int, args, mode: str, out_dir: str, nics: str, in_fabric: bool):
    import torch_reccl

    if not os.environ.get("GPU_TEST_PLAIN_NCCL"):  # diagnosis: NCCL's own socket transport
        os.environ.update({"NCCL_NET_PLUGIN": torch_reccl.plugin_path(), "NCCL_NET": "ReCCL"})
    os.environ.update({
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
        "NCCL_HOSTID": f"reccl-host-{rank}", "RECCL_NICS": nics, "RECCL_HEARTBEAT_MS": "500",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
    })
    if in_fabric:
        os.environ["NCCL_SOCKET_IFNAME"] = "mgmt0"  # NCCL's bootstrap rides the unfaulted network
    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()))
    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(out_dir, "store"), 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator(device="cuda").manual_seed(1234 + rank)
    primary = torch_reccl.nics()[0]["name"]
    losses, step_times = [], []
    progress = os.path.join(out_dir, f"progress-{rank}")
    for step in range(args.steps):
        if in_fabric:
            with open(progress, "w") as f:  # the driver breaks real links at these steps
                f.write(str(step))
        elif rank == 0 and mode != "fault_free" and step == args.fault_step:
            torch_reccl.inject_fault(primary, "down")
        elif rank == 0 and mode == "failback" and step == args.heal_step:
            torch_reccl.inject_fault(primary, "up")
        start = time.perf_counter()
        x = torch.randn(512, 256, device="cuda", generator=generator)
        y = torch.randint(0, 10, (512,), device="cuda", generator=generator)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_times.append(time.perf_counter() - start)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    # A large AllReduce too, so the plugin moves real volume.
    big = torch.full((64 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(big)
    torch.cuda.synchronize()
    ok_big = bool((big == 3.0).all().item())
    dist.destroy_process_group()
    torch_reccl.events.flush_events()
    with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "params": digest.hexdigest(), "events": events, "step_times": step_times,
                   "big_allreduce_ok": ok_big, "median_step_s": sorted(step_times)[len(step_times) // 2],
                   "stats": torch_reccl.stats()}, f)


def current_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "progress-0")) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def run_in_fabric(fabric, args, mode: str, run_dir: str, nics: str) -> None:
    """Ranks run inside the emulated hosts; the driver breaks and heals host 0's eth0."""
    code = ("import sys, json; sys.path.insert(0, %r); import nccl_failover_train as t; "
            "t.worker(%%d, t.argparse.Namespace(**json.loads(%r)), %r, %r, %r, True)"
            % (HERE, json.dumps(vars(args)), mode, run_dir, nics))
    logs = [open(os.path.join(run_dir, f"log-{r}"), "w") for r in range(2)]
    procs = [fabric.popen(r, [sys.executable, "-X", "faulthandler", "-c", code % r], stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(2)]
    deadline = time.monotonic() + 600
    broken = healed = False
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            step = current_step(run_dir)
            if mode != "fault_free" and not broken and step >= args.fault_step:
                fabric.nic_down(0, 0)
                broken = True
            if mode == "failback" and broken and not healed and step >= args.heal_step:
                fabric.nic_up(0, 0)
                healed = True
            time.sleep(0.002)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        fabric.heal()
    if any(p.returncode != 0 for p in procs):
        for r in range(2):
            with open(os.path.join(run_dir, f"log-{r}")) as f:
                print(f"--- rank {r} (exit {procs[r].returncode})\n" + f.read()[-4000:], file=sys.stderr)
        raise RuntimeError(f"a rank failed in the {mode} run")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fault-step", type=int, default=100)
    parser.add_argument("--heal-step", type=int, default=200)
    parser.add_argument("--out", help="also write each run's rank-0 record (JSON) here")
    parser.add_argument("--fabric", action="store_true",
                        help="real veth links in network namespaces (needs root and pyroute2)")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs; skipped")
        return 0
    fabric = None
    nics = "127.0.0.1,127.0.0.2"
    if args.fabric:
        from torch_reccl.fabric import Fabric
        fabric = Fabric(hosts=2, rails=2, name="gpu").up()
        nics = "eth0,eth1"
    rows, ok = [], True
    try:
        with tempfile.TemporaryDirectory() as out:
            results = {}
            for mode in ("fault_free", "failover", "failback"):
                run_dir = os.path.join(out, mode)
                os.makedirs(run_dir)
                if fabric is None:
                    spawn_bounded(worker, (args, mode, run_dir, nics, False), nprocs=2,
                                  timeout_s=600)
                else:
                    run_in_fabric(fabric, args, mode, run_dir, nics)
                with open(os.path.join(run_dir, f"{mode}-0.json")) as f:
                    results[mode] = json.load(f)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, f"{mode}.json"), "w") as f:
                        json.dump(results[mode], f)
            base = results["fault_free"]
            for mode, r in results.items():
                same = r["losses"] == base["losses"] and r["params"] == base["params"]
                kinds = sorted({e["kind"] for e in r["events"]} & {"failover", "failback", "nic_down"})
                ok &= same and r["big_allreduce_ok"] and (mode == "fault_free" or "failover" in kinds)
                rows.append((mode, "yes" if same else "NO", f"{r['losses'][-1]:.6f}",
                             f"{r['median_step_s'] * 1e3:.2f}", ",".join(kinds) or "-"))
    finally:
        if fabric is not None:
            fabric.down()
    print(f"{'run':11s} {'bit-identical':13s} {'final loss':10s} {'step ms':8s} events")
    for row in rows:
        print(f"{row[0]:11s} {row[1]:13s} {row[2]:10s} {row[3]:8s} {row[4]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

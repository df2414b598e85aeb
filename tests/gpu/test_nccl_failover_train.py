"""GPU check: NCCL over the ReCCL plugin, training through a NIC failure.

Two ranks look like two hosts (``two_host_env``: own NCCL_HOSTID, NCCL's P2P and
SHM transports off), so every byte between them goes through the net plugin,
i.e. through our bonded connections; with one GPU both ranks share it. A small
model is trained with DDP for STEPS steps three times: fault-free; with rank 0's
primary NIC failing at FAULT_STEP; and failing there and healing at HEAL_STEP
(failback). On both ranks the loss of every step and the final parameters must
be bit-identical to the fault-free run, the fault runs must fail over (and back),
and a 256 MiB all_reduce afterwards must be exact.

The NIC fails by ``inject_fault`` on loopback NICs (any GPU host), or as a real
veth link going down in an emulated fabric (network namespaces: needs root and
pyroute2, skipped otherwise). Each run's per-rank record (losses, step times,
events, stats) stays in pytest's tmp_path; the summary table is printed (``-s``).

Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from torch_reccl.cli.launch import spawn_bounded

from conftest import EventLog, gpu_of, needs_gpus, two_host_env

pytestmark = needs_gpus(1)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)
STEPS, FAULT_STEP, HEAL_STEP = 300, 100, 200
MODES = ("fault_free", "failover", "failback")
EXPECTED_EVENTS = {"fault_free": set(), "failover": {"nic_down", "failover"},
                   "failback": {"nic_down", "failover", "nic_up", "failback"}}
RUN_TIMEOUT_S = 300
# Failback is asynchronous (the sender re-dials the healed primary with a backoff
# of up to 2 s): rank 0 waits this long for it before the final all_reduce.
FAILBACK_WAIT_S = 10


def worker(rank: int, mode: str, out_dir: str, in_fabric: bool):
    os.environ.update(two_host_env(rank, "reccl-host"))
    os.environ["NCCL_NET"] = "ReCCL"  # insist: NCCL would otherwise fall back to its own sockets
    if in_fabric:  # the fabric's NICs; NCCL's bootstrap rides the unfaulted management network
        os.environ.update({"RECCL_NICS": "eth0,eth1", "NCCL_SOCKET_IFNAME": "mgmt0"})
    import torch_reccl  # sets NCCL_NET_PLUGIN to our library

    events = EventLog()
    torch_reccl.on_event(events)
    device = gpu_of(rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(out_dir, "store"), 2),
                            rank=rank, world_size=2, device_id=torch.device("cuda", device))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device], bucket_cap_mb=1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator(device="cuda").manual_seed(1234 + rank)
    primary = torch_reccl.nics()[0]["name"]
    losses, step_times = [], []
    progress = os.path.join(out_dir, f"progress-{rank}")
    for step in range(STEPS):
        if in_fabric:
            with open(progress, "w") as f:  # the driver breaks real links at these steps
                f.write(str(step))
        elif rank == 0 and mode != "fault_free" and step == FAULT_STEP:
            torch_reccl.inject_fault(primary, "down")
        elif rank == 0 and mode == "failback" and step == HEAL_STEP:
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
    if rank == 0 and mode == "failback":
        events.wait_for(FAILBACK_WAIT_S, kind="failback")
    # A large all_reduce too, so the plugin moves real volume.
    big = torch.full((64 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(big)
    torch.cuda.synchronize()
    ok_big = bool((big == 3.0).all().item())
    dist.destroy_process_group()
    torch_reccl.flush_events()
    with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "params": digest.hexdigest(), "step_times": step_times,
                   "events": [e.to_dict() for e in events.all()], "big_allreduce_ok": ok_big,
                   "stats": torch_reccl.stats()}, f)


def current_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "progress-0")) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def run_in_fabric(fabric, mode: str, run_dir: str) -> None:
    """Ranks run inside the emulated hosts; the driver breaks and heals host 0's eth0
    when rank 0 reaches FAULT_STEP and HEAL_STEP."""
    code = (f"import sys; sys.path[:0] = {[HERE, TESTS, REPO]!r}; import test_nccl_failover_train as t; "
            f"t.worker(%d, {mode!r}, {run_dir!r}, True)")
    logs = [open(os.path.join(run_dir, f"log-{r}"), "w") for r in range(2)]
    procs = [fabric.popen(r, [sys.executable, "-X", "faulthandler", "-c", code % r], stdout=logs[r],
                          stderr=subprocess.STDOUT) for r in range(2)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    broken = healed = False
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            step = current_step(run_dir)
            if mode != "fault_free" and not broken and step >= FAULT_STEP:
                fabric.nic_down(0, 0)
                broken = True
            if mode == "failback" and broken and not healed and step >= HEAL_STEP:
                fabric.nic_up(0, 0)
                healed = True
            time.sleep(0.002)
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for log in logs:
            log.close()
        fabric.heal()
    if hung or any(p.returncode != 0 for p in procs):
        tails = [f"--- rank {r} ({'hung' if r in hung else f'exit {procs[r].returncode}'})\n"
                 + open(os.path.join(run_dir, f"log-{r}")).read()[-4000:] for r in range(2)]
        raise AssertionError(f"the {mode} run failed:\n" + "\n".join(tails))


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_runs(results) -> None:
    """results[mode][rank]: every run bit-identical to the fault-free one on both ranks,
    the replicas equal, the big all_reduce exact, and each fault run's events there."""
    base = results["fault_free"]
    problems = []
    rows = [f"{'run':11s} {'bit-identical':13s} {'final loss':10s} {'median ms':9s} {'max ms':7s} "
            f"events (rank 0)"]
    for mode, ranks in results.items():
        same = True
        for rank, record in enumerate(ranks):
            if record["losses"] != base[rank]["losses"]:
                step = first_difference(record["losses"], base[rank]["losses"])
                problems.append(f"{mode}, rank {rank}: loss differs from the fault-free run at step {step}")
                same = False
            if record["params"] != base[rank]["params"]:
                problems.append(f"{mode}, rank {rank}: final parameters differ from the fault-free run's")
                same = False
            if not record["big_allreduce_ok"]:
                problems.append(f"{mode}, rank {rank}: the 256 MiB all_reduce after training was wrong")
        if ranks[0]["params"] != ranks[1]["params"]:
            problems.append(f"{mode}: the ranks' replicas differ (DDP keeps them equal)")
        kinds = [{e["kind"] for e in record["events"]} for record in ranks]
        if not EXPECTED_EVENTS[mode] <= kinds[0]:
            problems.append(f"{mode}: rank 0 missed {sorted(EXPECTED_EVENTS[mode] - kinds[0])} events")
        if mode == "fault_free" and any("failover" in k for k in kinds):
            problems.append("fault_free: a failover without a fault")
        times = sorted(ranks[0]["step_times"])
        rows.append(f"{mode:11s} {'yes' if same else 'NO':13s} {ranks[0]['losses'][-1]:<10.6f} "
                    f"{times[len(times) // 2] * 1e3:<9.2f} {times[-1] * 1e3:<7.2f} "
                    f"{','.join(sorted(kinds[0] & {'failover', 'failback', 'nic_down', 'nic_up'})) or '-'}")
    table = "\n".join(rows)
    print(table)
    assert not problems, "\n".join(problems) + "\n" + table


def records(run_dir: str, mode: str):
    out = []
    for rank in range(2):
        with open(os.path.join(run_dir, f"{mode}-{rank}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.timeout(len(MODES) * RUN_TIMEOUT_S + 60)
def test_training_is_bit_identical_through_an_injected_nic_failure(tmp_path):
    results = {}
    for mode in MODES:
        run_dir = tmp_path / mode
        run_dir.mkdir()
        spawn_bounded(worker, (mode, str(run_dir), False), nprocs=2, timeout_s=RUN_TIMEOUT_S)
        results[mode] = records(str(run_dir), mode)
    check_runs(results)


@pytest.mark.timeout(len(MODES) * RUN_TIMEOUT_S + 120)
def test_training_is_bit_identical_through_a_real_link_down(tmp_path):
    """The same with host 0's eth0 veth taken down (and up) in an emulated fabric."""
    from torch_reccl.fabric import Fabric, require_root

    require_root()
    fabric = Fabric(hosts=2, rails=2, name="gpu").up()
    try:
        results = {}
        for mode in MODES:
            run_dir = tmp_path / mode
            run_dir.mkdir()
            run_in_fabric(fabric, mode, str(run_dir))
            results[mode] = records(str(run_dir), mode)
    finally:
        fabric.down()
    check_runs(results)

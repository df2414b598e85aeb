"""The store never holds a process group hostage, and unused groups cost nothing.

A reccl group talks to the store only when its engine starts (its first CPU
collective: one counter, one key with its listen handles), when it first sends
to a peer (that peer's key), and when it is destroyed in order (it deletes its
key). If the store's host stops answering (here: its process is SIGSTOPped, so
connections stay open and calls block), destroying the group must still return
promptly: the deletion is bounded and then left to finish on its own.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import stop_process

STORE_HOST = r'''
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=120),
                      wait_for_workers=False)
print(store.port, flush=True)
time.sleep(300)
'''


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update({"RECCL_NICS": "127.0.0.1,127.0.0.2"})
    result = {}
    try:
        import torch
        import torch.distributed as dist

        import torch_reccl  # noqa: F401
        from torch_reccl.backend import fault_picture

        store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("reccl", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        t = torch.ones(1 << 16)
        dist.all_reduce(t)
        time.sleep(0.3)
        result["agreed_at_op"] = fault_picture()["agreed_at_op"]
        open(os.path.join(out_dir, f"ready{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        start = time.monotonic()
        dist.destroy_process_group()
        result["destroy_s"] = time.monotonic() - start
        result["sum_ok"] = bool(torch.all(t == 2))
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = repr(error)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.timeout(120)
def test_destroy_is_bounded_when_the_store_stops_answering(tmp_path):
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, port, str(tmp_path)), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "ranks did not get ready"
            assert all(p.is_alive() for p in procs), "a rank died early"
            time.sleep(0.05)
        stop_process(host.pid)
        (tmp_path / "go").touch()
        for p in procs:
            p.join(60)
            assert not p.is_alive(), "destroy_process_group hung with the store stopped"
        results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait(10)
    for r in results:
        assert "error" not in r, r
        assert r["sum_ok"] and r["agreed_at_op"] == 0, r  # the engine ran and agreed
        assert r["destroy_s"] < 10, r  # the bounded key deletion + the connections' close


def two_rank_entry(body, rank: int, port: int, out_dir: str) -> None:
    """A rank of a 2-rank reccl job on the test's store: runs body(rank, store,
    result) and writes result (or the error) as JSON for the test."""
    os.environ.update({"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_DCR_PERIOD_MS": "200"})
    result = {}
    try:
        import torch.distributed as dist

        import torch_reccl  # noqa: F401

        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("reccl", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        body(rank, store, result)
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = repr(error)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def run_two_ranks(body, tmp_path, timeout_s: float = 90):
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60),
                         wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=two_rank_entry, args=(body, r, host.port, str(tmp_path)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
        assert not p.is_alive(), "a rank hung"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r
    return results


def unused_groups(rank, store, result):
    import torch
    import torch.distributed as dist

    from torch_reccl._native import native
    from torch_reccl.bench import procstat

    # Threads by task id, not a count: one of init's short-lived threads may end
    # meanwhile (a count then read -1 on a loaded 2-core CI box).
    threads = set(procstat.threads())
    groups = [dist.new_group([0, 1]) for _ in range(8)]
    now = procstat.threads()
    result["threads_added"] = sorted(now[tid].name for tid in now.keys() - threads)
    cpu = [g._get_backend(torch.device("cpu")) for g in groups]
    result["engines"] = sum(native()._reccl_backend_info(b)["channels"] > 0 for b in cpu)
    result["keys"] = sorted(k for k in store.list_keys() if "reccl/" in k) if rank == 0 else []
    store.add("listed", 1)  # the store itself, not a reccl collective, keeps the ranks in step
    deadline = time.monotonic() + 30
    while store.add("listed", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t = torch.ones(4)
    dist.all_reduce(t, group=groups[3])          # one group used: only it starts its engine
    result["engines_after"] = sum(native()._reccl_backend_info(b)["channels"] > 0 for b in cpu)
    result["sum_ok"] = bool(torch.all(t == 2))
    dist.barrier(groups[3])


@pytest.mark.timeout(120)
def test_groups_cost_nothing_until_their_first_cpu_collective(tmp_path):
    results = run_two_ranks(unused_groups, tmp_path)
    for r in results:
        assert r["engines"] == 0 and r["threads_added"] == [], r
        assert r["engines_after"] == 1 and r["sum_ok"], r
    assert results[0]["keys"] == [], results[0]["keys"]  # no reccl key before any CPU op


def fault_board(rank, store, result):
    import torch
    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.backend import fault_picture

    group = dist.new_group([0, 1])  # never runs a CPU collective: no agreement to read
    dist.all_reduce(torch.ones(1))  # the world's engine registers this process's NICs
    healthy = torch_reccl.stats()["control"]["fault_board_store_requests"]
    time.sleep(1.0)
    result["idle_requests"] = torch_reccl.stats()["control"]["fault_board_store_requests"] - healthy
    dist.barrier()
    nic = "lo:127.0.0.2"
    if rank == 1:
        torch_reccl.inject_fault(nic, "down")
    dist.barrier()
    if rank == 0:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not fault_picture(group)["degraded"]:
            time.sleep(0.1)
        result["seen"] = fault_picture(group)["degraded"]
    dist.barrier()
    if rank == 1:
        torch_reccl.inject_fault(nic, "up")
    dist.barrier()
    if rank == 0:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and fault_picture(group)["degraded"]:
            time.sleep(0.1)
        result["healed"] = fault_picture(group)["degraded"] == []
    dist.barrier()


@pytest.mark.timeout(120)
def test_the_fault_board_shows_a_nic_down_to_a_group_without_cpu_collectives(tmp_path):
    results = run_two_ranks(fault_board, tmp_path)
    for r in results:
        assert r["idle_requests"] == 0, r  # healthy: the board writes nothing
    seen = results[0]["seen"]
    assert seen and seen[0]["rank"] == 1 and seen[0]["nics_down"] == [1], seen
    assert results[0]["healed"], results[0]

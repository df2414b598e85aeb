"""The control plane never holds a process group hostage.

Each reccl group's control-plane thread talks to the group's store. If the
store's host stops answering (here: its process is SIGSTOPped, so connections
stay open and calls block), destroying the group must still return promptly:
the thread's stop is bounded by one period plus a grace of 5 s, after which a
call stuck on the store is left to finish on its own.
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

STORE_HOST = r'''
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=120),
                      wait_for_workers=False)
print(store.port, flush=True)
time.sleep(300)
'''


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update({"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_DCR_PERIOD_MS": "50"})
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
        result["rounds"] = fault_picture()["round"]
        open(os.path.join(out_dir, f"ready{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the control thread is now blocked in a store call
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
        os.kill(host.pid, signal.SIGSTOP)
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
        assert r["sum_ok"] and r["rounds"] >= 1, r  # the control plane was running
        assert r["destroy_s"] < 10, r  # one period + 5 s grace + the connections' close
